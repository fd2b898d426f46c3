"""Index types at 1M passages: recall@10 against exact Flat, memory, build time and per-query cost.

    python bench/retriever_ann.py                     # 1M vectors, every type (~25 min on 2 cores once cached)
    python bench/retriever_ann.py --n 200000 --types flat,ivfpq96

What is measured, exactly (no 1M-passage corpus is encoded: MiniLM on 2 CPU cores encodes ~75
passages/s, 1M would take ~4 hours):

1. Real embeddings: the passages of a synthetic corpus (world `--real`, default 10k: ~9.9k passages)
   as bench/retriever_load.py's dense MiniLM Flat index holds them (built once, cached), and 1,000
   single-hop questions encoded as the server encodes queries.
2. A generative model fitted to the real passage vectors: k-means with 256 centres, then the
   covariance of the residuals (vector - its centre) pooled over all clusters. N synthetic vectors
   are drawn as centre (by cluster frequency) + Gaussian residual with that covariance, normalized.
   This keeps the anisotropy (a few directions carry most variance) and the cluster structure that
   make ANN indexes work on real embeddings; i.i.d. random vectors would understate every ANN
   type's recall. The structure check below says how close it is.
3. Queries: the 1,000 real question vectors. Ground truth: exact Flat top-10 over the N vectors.
4. Each type is built once (cached), then loaded in a fresh process that reports its private
   (anonymous) memory, the file size, and the search time for batches of 64 queries on one faiss
   thread (the per-query cost a shard's thread pays) and on all cores.
5. Structure check: IVF-PQ and HNSW recall@10 on the real vectors and on the same number of
   synthetic ones (`--check`): if they agree, the 1M figures are what real vectors of this kind give.

Recall@10 = |top-10 of the type ∩ top-10 of Flat| / 10, averaged over queries (1.0 for Flat).
Target (issue 18): IVF-PQ keeps recall@10 >= 0.9 of Flat's in <= 1/8 of Flat's memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# name -> (faiss index_factory string with {nlist}, search parameter sweeps)
TYPES = {
    "flat": ("Flat", [{}]),
    "hnsw32": ("HNSW32", [{"efSearch": 64}, {"efSearch": 128}, {"efSearch": 256}]),
    "ivf": ("IVF{nlist},Flat", [{"nprobe": 16}, {"nprobe": 64}]),
    "ivfpq48": ("IVF{nlist},PQ48", [{"nprobe": 16}, {"nprobe": 64}]),
    "ivfpq96": ("IVF{nlist},PQ96", [{"nprobe": 16}, {"nprobe": 32}, {"nprobe": 64}, {"nprobe": 128}]),
    "ivfpq128": ("IVF{nlist},PQ128", [{"nprobe": 32}, {"nprobe": 64}, {"nprobe": 128}]),
}
DEFAULT_TYPES = "flat,hnsw32,ivf,ivfpq48,ivfpq96,ivfpq128"


# --- data -------------------------------------------------------------------------------------------

def real_embeddings(cache: Path, real: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(passages [n, d], queries [1000, d]) of a synthetic world: the vectors of bench/retriever_load.py's
    cached dense MiniLM index of that world (built once, shared with bench/retriever_ray.py) and its
    single-hop questions encoded as the server encodes queries."""
    out_p, out_q = cache / f"real_{real}_passages.npy", cache / f"real_{real}_queries.npy"
    if out_p.exists() and out_q.exists():
        return np.load(out_p), np.load(out_q)
    import faiss
    import torch

    from bench.retriever_load import load_questions, prepare_index, prepare_world
    from retriever_server.dense_index import DenseSearcher
    from retriever_server.manifest import read_manifest
    torch.set_num_threads(os.cpu_count() or 1)
    world = prepare_world(cache, real, seed)
    index_dir = prepare_index(cache, world, real, "dense", [])
    flat = faiss.read_index(str(index_dir / "dense.faiss"))
    passages = flat.reconstruct_n(0, flat.ntotal)
    searcher = DenseSearcher(index_dir, read_manifest(index_dir).params, load_index=False)
    queries = searcher.encode([q.text for q in load_questions(world, 1000)])
    np.save(out_p, passages)
    np.save(out_q, queries)
    return passages, queries


class FittedMixture:
    """Gaussian mixture with a shared residual covariance, fitted to real vectors (module doc, 2)."""

    def __init__(self, x: np.ndarray, k: int = 256, seed: int = 0):
        import faiss
        km = faiss.Kmeans(x.shape[1], k, niter=20, seed=seed, spherical=True, verbose=False)
        km.train(x)
        _, assign = km.index.search(x, 1)
        self.centres = km.centroids.copy()                                   # [k, d]
        self.weights = np.bincount(assign[:, 0], minlength=k) / len(x)       # [k]
        resid = x - self.centres[assign[:, 0]]                               # [n, d]
        cov = resid.T @ resid / len(x)                                       # [d, d]
        eigval, eigvec = np.linalg.eigh(cov)
        self.scale = (eigvec * np.sqrt(np.clip(eigval, 0, None))).T.astype(np.float32)   # [d, d]
        self.seed = seed

    def sample(self, n: int, chunk: int = 100_000) -> np.ndarray:
        rng = np.random.default_rng(self.seed + 1)
        out = np.empty((n, self.centres.shape[1]), np.float32)
        for s in range(0, n, chunk):
            m = min(chunk, n - s)
            c = rng.choice(len(self.weights), m, p=self.weights)
            v = self.centres[c] + rng.standard_normal((m, self.centres.shape[1]), dtype=np.float32) @ self.scale
            out[s:s + m] = v / np.linalg.norm(v, axis=1, keepdims=True)
        return out


def exact_topk(x: np.ndarray, q: np.ndarray, k: int = 10) -> np.ndarray:
    import faiss
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    return index.search(q, k)[1]


# --- building -----------------------------------------------------------------------------------------

def build(kind: str, x: np.ndarray, path: Path, quantizer=None) -> float:
    """Build one type over x and write it; returns build seconds (cached file: 0)."""
    import faiss
    if path.exists():
        return float(json.loads(path.with_suffix(".json").read_text())["build_s"])
    n, d = x.shape
    nlist = max(1, min(int(4 * np.sqrt(n)), n // 39))
    t0 = time.time()
    index = faiss.index_factory(d, TYPES[kind][0].format(nlist=nlist), faiss.METRIC_INNER_PRODUCT)
    if kind.startswith("hnsw"):
        index.hnsw.efConstruction = 64   # `build --faiss hnsw` with M=32: max(40, 2*M)
    if quantizer is not None and kind.startswith("ivf"):
        ivf = faiss.extract_index_ivf(index)
        ivf.quantizer.add(quantizer)     # the same trained coarse centres for every IVF type
    if not index.is_trained:
        rng = np.random.default_rng(0)
        index.train(x[rng.choice(n, min(n, 64 * nlist), replace=False)])
    for s in range(0, n, 100_000):
        index.add(x[s:s + 100_000])
    build_s = time.time() - t0
    faiss.write_index(index, str(path))
    path.with_suffix(".json").write_text(json.dumps({"build_s": build_s}))
    return build_s


def coarse_centres(x: np.ndarray) -> np.ndarray:
    """IVF coarse centres trained once (k-means, ~4*sqrt(N) lists) and shared by the IVF types."""
    import faiss
    n, d = x.shape
    nlist = max(1, min(int(4 * np.sqrt(n)), n // 39))
    rng = np.random.default_rng(0)
    km = faiss.Kmeans(d, nlist, niter=10, seed=0, spherical=True, max_points_per_centroid=64)
    km.train(x[rng.choice(n, min(n, 64 * nlist), replace=False)])
    return km.centroids


# --- measuring (in a fresh process) -------------------------------------------------------------------

def measure_one(path: Path, queries: Path, truth: Path, params: list[dict], seconds: float) -> dict:
    """Load the index, report private memory, then recall@10 and search time per parameter setting."""
    import faiss

    def anon_mb() -> float:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:")) / 1024
    before = anon_mb()
    t0 = time.time()
    index = faiss.read_index(str(path))
    load_s = time.time() - t0
    mem = anon_mb() - before
    q, gt = np.load(queries), np.load(truth)
    faiss.cvar.distance_compute_blas_threshold = 16   # as the server (dense_index.configure_faiss)
    out = {"memory_mb": mem, "file_mb": path.stat().st_size / 2**20, "load_s": load_s, "runs": []}
    for p in params:
        if "nprobe" in p:
            faiss.extract_index_ivf(index).nprobe = p["nprobe"]
        if "efSearch" in p:
            index.hnsw.efSearch = p["efSearch"]
        run = dict(p)
        for threads in (1, os.cpu_count() or 1):
            faiss.omp_set_num_threads(threads)
            index.search(q[:64], 10)                    # warm-up
            done, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds or done < len(q):
                b = q[(done % len(q)):(done % len(q)) + 64]
                _, rows = index.search(b, 10)
                done += len(b)
            run[f"qps_{threads}t"] = done / (time.perf_counter() - t0)
        _, rows = index.search(q, 10)
        run["recall10"] = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, gt)]))
        out["runs"].append(run)
    return out


def measure(path: Path, data: Path, kind: str, seconds: float) -> dict:
    cmd = [sys.executable, __file__, "--measure-one", str(path), "--data", str(data), "--kind", kind,
           "--seconds", str(seconds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if proc.returncode:
        raise SystemExit(f"measuring {path} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- report -------------------------------------------------------------------------------------------

def render(rows: list[tuple[str, int, float, dict]], notes: list[str], n: int, d: int) -> str:
    flat_mem = next((r[3]["memory_mb"] for r in rows if r[0] == "flat"), None)
    head = ("| index | N | build s | memory MB (private) | file MB | memory / Flat | search params | recall@10 vs Flat "
            "| q/s 1 thread | ms/query 1 thread | q/s all cores | target |")
    lines = [f"Index types over {n:,} vectors of dimension {d} (synthetic, fitted to real MiniLM embeddings; "
             "queries: real MiniLM question embeddings), batches of 64 queries, top-10.", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for kind, size, build_s, m in rows:
        for run in m["runs"]:
            params = ", ".join(f"{k}={v}" for k, v in run.items() if k in ("nprobe", "efSearch")) or "exact"
            ratio = m["memory_mb"] / flat_mem if flat_mem else float("nan")
            target = ""
            if kind.startswith("ivfpq"):
                met = run["recall10"] >= 0.9 and ratio <= 1 / 8
                target = f"recall >= 0.9 in <= 1/8 memory: {'met' if met else 'not met'}"
            lines.append(f"| {kind} | {size:,} | {build_s:.0f} | {m['memory_mb']:,.0f} | {m['file_mb']:,.0f} "
                         f"| {ratio:.3f} | {params} | {run['recall10']:.3f} | {run['qps_1t']:,.0f} "
                         f"| {1e3 / run['qps_1t']:.2f} | {run[f'qps_{os.cpu_count() or 1}t']:,.0f} | {target} |")
    return "\n".join(lines + [""] + [f"- {x}" for x in notes]) + "\n"


def main(argv=None) -> int:
    from search_r1.paths import home
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="synthetic vectors to index")
    p.add_argument("--types", default=DEFAULT_TYPES, help=f"comma-separated, from {sorted(TYPES)}")
    p.add_argument("--real", default="10k", choices=["10k", "100k"],
                   help="size of the real world whose MiniLM embeddings the model is fitted to (10k: ~2-4 "
                        "min to encode once; 100k: ~25 min)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="structure check: HNSW / IVF-PQ recall on real vs synthetic vectors of the same count")
    p.add_argument("--seconds", type=float, default=3.0, help="timed search per setting and thread count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=home() / "bench" / "retriever",
                   help="embeddings, worlds and built indexes are kept here between runs")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "retriever_ann.md")
    p.add_argument("--measure-one", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure_one:
        res = measure_one(args.measure_one, args.data / "queries.npy", args.data / "truth.npy",
                          TYPES[args.kind][1], args.seconds)
        print(json.dumps(res))
        return 0
    kinds = [k.strip() for k in args.types.split(",") if k.strip()]
    for k in kinds:
        if k not in TYPES:
            p.error(f"--types {k!r} unknown; allowed: {sorted(TYPES)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t_all = time.time()
    cache = args.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    real_p, real_q = real_embeddings(cache, args.real, args.seed)
    mixture = FittedMixture(real_p, seed=args.seed)
    notes = [f"real vectors: {len(real_p):,} MiniLM passage embeddings of the synthetic corpus "
             f"(world {args.real}) and {len(real_q):,} question embeddings ('query' side of the convention)"]
    if args.check:
        notes.append(structure_check(real_p, real_q, mixture, cache))
        notes.append(gold_recall(cache, args.real, args.seed, real_p, real_q))
    data = cache / f"ann_{args.n}_{args.real}_{args.seed}"
    data.mkdir(exist_ok=True)
    if not (data / "truth.npy").exists():
        x = mixture.sample(args.n)
        np.save(data / "vectors.npy", x)
        np.save(data / "queries.npy", real_q)
        np.save(data / "truth.npy", exact_topk(x, real_q))
    x = np.load(data / "vectors.npy")
    centres = None
    rows = []
    for kind in kinds:
        path = data / f"{kind}.faiss"
        if not path.exists() and kind.startswith("ivf") and centres is None:
            centres = coarse_centres(x)
        print(f"[ann] {kind}: build ...", file=sys.stderr, flush=True)
        build_s = build(kind, x, path, centres)
        print(f"[ann] {kind}: built in {build_s:.0f}s; measuring ...", file=sys.stderr, flush=True)
        m = measure(path, data, kind, args.seconds)
        rows.append((kind, args.n, build_s, m))
        print(f"[ann] {kind}: " + json.dumps(m), file=sys.stderr, flush=True)
    notes.append("memory: private (anonymous) memory of a fresh process after faiss.read_index (what a "
                 "server holds; `serve --mmap` keeps Flat/HNSW/IVF data in the shared page cache instead)")
    notes.append(f"CPU: {cpu_name()}, {os.cpu_count()} cores, 1-min load average {os.getloadavg()[0]:.1f} at "
                 "the end (other work on the machine slows the q/s columns, not recall or memory)")
    notes.append(f"command: python bench/retriever_ann.py {' '.join(sys.argv[1:] if argv is None else argv)} "
                 f"(total {time.time() - t_all:.0f} s)")
    table = render(rows, notes, args.n, x.shape[1])
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    return 0


def structure_check(real_p: np.ndarray, real_q: np.ndarray, mixture: FittedMixture, cache: Path) -> str:
    """Recall@10 of HNSW32 (efSearch 64) and IVF-PQ96 (nprobe 16) on the real vectors and on as many
    synthetic ones, same queries: the fitted model should neither flatter nor punish the ANN types."""
    import faiss
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    synth = mixture.sample(len(real_p))
    out = []
    for name, x in (("real", real_p), ("synthetic", synth)):
        gt = exact_topk(x, real_q)
        rec = {}
        for kind, param in (("hnsw32", {"efSearch": 64}), ("ivfpq96", {"nprobe": 16})):
            path = cache / f"check_{name}_{len(x)}_{kind}.faiss"
            path.unlink(missing_ok=True)
            path.with_suffix(".json").unlink(missing_ok=True)
            build(kind, x, path)
            index = faiss.read_index(str(path))
            if "nprobe" in param:
                faiss.extract_index_ivf(index).nprobe = param["nprobe"]
            else:
                index.hnsw.efSearch = param["efSearch"]
            rows = index.search(real_q, 10)[1]
            rec[kind] = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, gt)])
        out.append(f"{name} {len(x):,}: HNSW32 ef64 {rec['hnsw32']:.3f}, IVF-PQ96 nprobe16 {rec['ivfpq96']:.3f}")
    return "structure check, recall@10 vs Flat at equal size (real vs fitted synthetic): " + "; ".join(out)


def gold_recall(cache: Path, real: str, seed: int, real_p: np.ndarray, real_q: np.ndarray) -> str:
    """Task recall on the real vectors: the share of the 1,000 single-hop questions whose gold passage
    is in the top 10, for Flat and the approximate types, and each type's share of Flat's (the issue's
    target reads: IVF-PQ keeps >= 0.9 of Flat's recall@10)."""
    import faiss

    from bench.retriever_load import load_questions, prepare_world
    from retriever_server.corpus_store import iter_corpus
    world = prepare_world(cache, real, seed)
    row_of = {doc_id: i for i, (doc_id, _) in enumerate(iter_corpus(world / "corpus.jsonl"))}
    gold = [{row_of[g] for g in q.gold if g in row_of} for q in load_questions(world, len(real_q))]
    out = {}
    for kind, param in (("flat", {}), ("hnsw32", {"efSearch": 128}), ("ivfpq96", {"nprobe": 16}),
                        ("ivfpq48", {"nprobe": 16})):
        path = cache / f"gold_{real}_{kind}.faiss"
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)
        build(kind, real_p, path)
        index = faiss.read_index(str(path))
        if "nprobe" in param:
            faiss.extract_index_ivf(index).nprobe = param["nprobe"]
        if "efSearch" in param:
            index.hnsw.efSearch = param["efSearch"]
        rows = index.search(real_q, 10)[1]
        out[kind] = np.mean([bool(g & set(r)) for g, r in zip(gold, rows)])
    return ("gold-passage recall@10 on the real vectors (1,000 single-hop questions; share of Flat's): "
            + ", ".join(f"{k} {v:.3f} ({v / out['flat']:.2f})" for k, v in out.items()))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
