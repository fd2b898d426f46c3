"""`serve --ray`: the dense retriever on Ray Serve, sharded and replicated, behind the same HTTP API.

    python -m retriever_server serve --index idx --ray --shards 4 --replicas 2 --host 0.0.0.0 --port 8000

Deployments (one Serve application, `retriever`):

    shard-0 .. shard-{K-1}   one slice of the index each (`build --shards K` slices, or row ranges of
                             one Flat index), R replicas each, placed by Ray by --shard-cpus;
                             `search(q [B, d], k) -> (scores [B, k], global rows [B, k])`
    ingress                  the FastAPI app of app.py (/retrieve, /access, /health, limits, auth) with
                             its cross-request micro-batcher; each batch of queries is encoded once,
                             sent to the K shards at once, and their top-k lists merged exactly
                             (shards.merge_topk): the answer of one unsharded search.

A shard that does not answer within --shard-timeout-s, or whose replica died, is retried
(--shard-retries; Serve routes the retry to a live replica or the one it started in its place).
When a shard still has no answer the request fails with 503 naming the shards that did not answer:
a partial top-k is never returned as if it were complete. /health reports how many shards answer.

HTTP reaches the ingress through Serve's Python proxy (`--serve-proxy python`, the default: it binds
only --host:--port) or HAProxy (`--serve-proxy haproxy`: Serve's HAProxy mode, C code shipped with
ray[serve], much less CPU per request; it also opens a stats page and a Prometheus endpoint on every
interface, so firewall those ports). The mode is the Serve controller's: a `ray start` cluster needs
RAY_SERVE_ENABLE_HA_PROXY=1 in the environment of `ray start` on every node (with --ray-address local
this process sets it).

Ray places each shard replica where its reserved CPUs (--shard-cpus) and memory (its slice's size,
or --shard-memory-gb) fit. Ray Serve's HTTP proxy runs on every node of the cluster on --host/--port.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

APP_NAME = "retriever"
SHARD_NAME = "shard-{}"
# Options of `serve` that the replicas need (the rest configure the CLI process only).
REPLICA_ARGS = ("index", "model", "quantize", "nprobe", "ef_search", "flat_search", "mmap", "max_batch",
                "workers", "torch_threads", "faiss_threads", "processes", "batch_window_ms", "topk",
                "max_topk", "max_queries", "max_query_chars", "max_body_bytes", "max_ids", "api_key",
                "shard_timeout_s", "shard_retries", "shards", "replicas")


class ShardReplica:
    """One replica of one shard: a faiss slice searched with query vectors (no encoder, no torch unless
    the Flat bf16 screen is used)."""

    def __init__(self, index_dir: str, params: dict, shard: int, n_shards: int, cfg: dict):
        import faiss

        from .dense_index import configure_faiss, serve_slice, set_search_params
        from .shards import SliceSearcher

        threads = cfg.get("faiss_threads")
        faiss.omp_set_num_threads(threads if isinstance(threads, int) else 1)
        configure_faiss()
        index, start = serve_slice(Path(index_dir), params, shard, n_shards, mmap=cfg.get("mmap", False))
        set_search_params(index, cfg.get("nprobe", 16), cfg.get("ef_search", 64))
        self.slice = SliceSearcher(index, start, cfg.get("flat_search", "auto"), cfg.get("mmap", False))
        self.shard, self.n_shards = shard, n_shards

    def search(self, q, k: int):
        return self.slice.search(q, k)

    def info(self) -> dict:
        return {"shard": self.shard, "rows": [self.slice.start, self.slice.start + self.slice.n],
                "flat_search": self.slice.flat_search, "pid": os.getpid()}


class ShardedSearcher:
    """The searcher interface of app.py over shard deployments: encode once, fan out, merge."""

    kind = "dense"

    def __init__(self, dense, handles: list, timeout_s: float = 30.0, retries: int = 2,
                 larger_is_better: bool = True, n_docs: int = 0):
        self.dense, self.handles = dense, list(handles)   # dense: DenseSearcher without slices (encoder)
        self.timeout_s, self.retries = timeout_s, retries
        self.larger_is_better, self.n_docs = larger_is_better, n_docs
        self.retried = 0    # shard calls that needed a retry (reported by /health)

    def describe(self) -> dict:
        return {**self.dense.describe(), "slices": len(self.handles)}

    def _call(self, i: int, q, k: int):
        """Shard i's answer, retried on failure; raises the last error when every try failed."""
        error = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(min(0.2 * 2 ** (attempt - 1), 2.0))  # let Serve mark the dead replica
            try:
                return self.handles[i].search.remote(q, k).result(timeout_s=self.timeout_s)
            except Exception as exc:  # dead actor, timeout, replica start-up failure, ...
                error = exc
        raise error

    def search(self, queries: list[str], k: int):
        from concurrent.futures import ThreadPoolExecutor

        from .app import ServiceUnavailable
        from .dense_index import hits_per_query
        from .shards import merge_topk

        q = self.dense.encode(queries)                                        # [B, dim]
        # First the K requests at once (Serve runs them concurrently), then the slow path per shard.
        pending = [h.search.remote(q, k) for h in self.handles]
        parts, failed = [None] * len(pending), []
        for i, response in enumerate(pending):
            try:
                parts[i] = response.result(timeout_s=self.timeout_s)
            except Exception:
                failed.append(i)
        if failed:
            with ThreadPoolExecutor(len(failed)) as pool:
                retried = {i: pool.submit(self._call, i, q, k) for i in failed}
            errors = {}
            for i, fut in retried.items():
                try:
                    parts[i] = fut.result()
                except Exception as exc:
                    errors[i] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if errors:
                raise ServiceUnavailable(
                    f"{len(self.handles) - len(errors)} of {len(self.handles)} shards answered; shard(s) "
                    f"{sorted(errors)} did not ({'; '.join(f'shard {i}: {e}' for i, e in errors.items())}). "
                    "No partial top-k is returned: retry (Serve restarts failed replicas), or check "
                    "`serve status` / the Ray dashboard", retry_after_s=2)
        scores, rows = merge_topk(parts, k, self.larger_is_better)
        return hits_per_query(scores, rows)

    async def probe(self) -> dict:
        """/health: which shards answer now (2 s each)."""
        async def ask(h):
            try:
                return await asyncio.wait_for(h.info.remote(), 2.0)
            except Exception as exc:
                return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        infos = await asyncio.gather(*(ask(h) for h in self.handles))
        up = sum("error" not in i for i in infos)
        return {"status": "ok" if up == len(infos) else "degraded",
                "shards": {"total": len(infos), "answering": up, "retried_calls": self.retried,
                           "detail": infos}}


class IngressReplica:
    """The HTTP API (app.py) over a ShardedSearcher; Serve runs its ASGI app (late-bound below)."""

    def __init__(self, shard_handles: list, cfg: dict):
        import argparse

        from .app import Limits
        from .corpus_store import open_store
        from .cpu import resolve_auto, set_threads
        from .dense_index import DenseSearcher
        from .manifest import STORE_SUBDIR, read_manifest

        args = argparse.Namespace(**cfg)
        resolve_auto(args, ["dense"])
        set_threads(args.torch_threads, args.faiss_threads)
        index_dir = Path(args.index[0])
        manifest = read_manifest(index_dir)
        dense = DenseSearcher(index_dir, manifest.params, model=args.model, quantize=args.quantize,
                              encode_batch_size=args.max_batch, load_index=False)
        self.searcher = ShardedSearcher(dense, shard_handles, args.shard_timeout_s, args.shard_retries,
                                        manifest.params.get("metric", "inner_product") == "inner_product",
                                        manifest.corpus_size)
        self.store = open_store(index_dir / STORE_SUBDIR)
        self.limits = Limits(max_queries=args.max_queries, max_query_chars=args.max_query_chars,
                             max_topk=args.max_topk, default_topk=args.topk, max_body_bytes=args.max_body_bytes,
                             max_ids=args.max_ids)
        self.args = args
        self.info = {"indexes": [{"dir": str(index_dir), "kind": "dense", "params": manifest.params,
                                  "built_at": manifest.built_at, **self.searcher.describe()}],
                     "threads": {"workers": args.workers, "torch": args.torch_threads, "faiss": args.faiss_threads},
                     "max_batch": args.max_batch, "pid": os.getpid(),
                     "ray_serve": {"shards": len(shard_handles), "replicas_per_shard": args.replicas}}

    def __serve_build_asgi_app__(self):
        from .app import create_app
        a = self.args
        api_key = a.api_key or os.environ.get("RETRIEVER_API_KEY") or None
        return create_app(self.searcher, self.store, self.limits, api_key=api_key, window_ms=a.batch_window_ms,
                          max_batch=a.max_batch, workers=a.workers, info=self.info, probe=self.searcher.probe)


def build_application(args):
    """The Serve application for parsed `serve --ray` flags (not yet running).

    Raises:
        ValueError: for anything but one dense index, or shards that do not fit its slices.
    """
    from ray import serve

    from .indexes import check_indexes
    from .shards import slices_of

    if len(args.index) != 1:
        raise ValueError("serve --ray serves one dense index (hybrid BM25 + dense fusion runs on the "
                         "standalone server); give a single --index")
    index_dir = Path(args.index[0])
    manifest = check_indexes([index_dir])[0]
    if manifest.kind != "dense":
        raise ValueError(f"serve --ray shards dense indexes; {index_dir} is {manifest.kind!r} (serve BM25 "
                         "with the standalone server, or several of them behind a URL list)")
    if args.faiss_gpu:
        raise ValueError("--faiss-gpu with --ray is not supported: a shard replica searches on CPU; run one "
                         "standalone `serve --faiss-gpu` per GPU node instead")
    refs = slices_of(manifest.params)
    n_shards = args.shards or len(refs)
    # Ray places a replica where its reservation fits: reserve the memory its slice takes (a
    # memory-mapped slice lives in the page cache, which Ray does not account for).
    index_bytes = sum(r.resolve(index_dir).stat().st_size for r in refs if r.resolve(index_dir).exists())
    memory = (0 if args.mmap else index_bytes / n_shards) if args.shard_memory_gb is None \
        else args.shard_memory_gb * 2**30
    cfg = {k: getattr(args, k) for k in REPLICA_ARGS}
    cfg["index"] = [str(index_dir.resolve())]
    cfg["shards"] = n_shards
    # No per-request access log lines: at hundreds of requests/s they cost a core's share.
    quiet = {"enable_access_log": False, "log_level": "WARNING"}
    shard_cls = serve.deployment(ShardReplica)
    shards = [shard_cls.options(name=SHARD_NAME.format(k), num_replicas=args.replicas,
                                ray_actor_options={"num_cpus": args.shard_cpus, "memory": int(memory)},
                                max_ongoing_requests=64, logging_config=quiet)
              .bind(cfg["index"][0], manifest.params, k, n_shards, cfg) for k in range(n_shards)]
    ingress_cls = serve.deployment(serve.ingress()(IngressReplica))
    return ingress_cls.options(name="ingress", num_replicas=args.ingress_replicas,
                               ray_actor_options={"num_cpus": args.ingress_cpus},
                               max_ongoing_requests=1024, logging_config=quiet).bind(shards, cfg)


def deploy(args, name: str = APP_NAME) -> str:
    """Start Serve's HTTP proxy on --host/--port (if Serve is not running yet) and run the application;
    returns the /retrieve URL. Blocks until every replica is up (loading the index and the encoder)."""
    from ray import serve

    app = build_application(args)
    for attempt in range(3):
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            break
        except Exception as exc:  # noqa: BLE001 - the proxy actor missed Serve's start-up deadline
            if attempt == 2:
                raise
            # On a loaded machine the proxy (HAProxy manager) may not be ready within Serve's fixed
            # 60 s, and Serve kills it; a second start usually finds the worker processes warm.
            print(f"[retriever] Serve's HTTP proxy did not start ({type(exc).__name__}); retrying",
                  file=sys.stderr, flush=True)
            serve.shutdown()
    serve.run(app, name=name, route_prefix="/", blocking=False)
    return f"http://{args.host}:{args.port}/retrieve"


HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def _init_ray(args) -> None:
    import ray

    if args.serve_proxy == "haproxy":
        # Serve reads this in its controller: HAProxy (C, shipped with ray[serve]) forwards HTTP straight
        # to the ingress replicas instead of Serve's Python proxy (measured on 2 shared cores with 50
        # single-query clients: 0.90x the standalone q/s instead of 0.52x; bench/retriever_ray.py).
        os.environ[HAPROXY_ENV] = "1"
        if args.ray_address == "local":
            # HAProxy also serves its stats page and Prometheus metrics, on fixed ports (8404, 9101) of
            # every interface; free ports keep a second local deployment on this machine from failing.
            from .launcher import free_port
            for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
                os.environ.setdefault(name, str(free_port()))
        os.environ.setdefault("RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S", "120")   # Serve's 30 s: too short on 2 busy cores
    env = {"env_vars": {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                    "TOKENIZERS_PARALLELISM", "OMP_WAIT_POLICY",
                                                    "PYTHONPATH", "SEARCH_R1_HOME", HAPROXY_ENV,
                                                    "RAY_SERVE_HAPROXY_STATS_PORT",
                                                    "RAY_SERVE_HAPROXY_METRICS_PORT",
                                                    "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S")
                        if k in os.environ}}
    if args.ray_address == "local":
        # Ray places replicas by reserved CPUs; a local cluster gets enough logical CPUs for them all.
        shards = args.shards or 1
        need = shards * args.replicas * args.shard_cpus + args.ingress_replicas * args.ingress_cpus
        ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False,
                 runtime_env=env, log_to_driver=False)
        return
    try:
        ray.init(address=args.ray_address, runtime_env=env, log_to_driver=False)
    except ConnectionError as exc:
        raise ValueError(f"--ray-address {args.ray_address}: no Ray cluster to join ({exc}); start one with "
                         "`ray start --head` (and `ray start --address HEAD:6379` on the other nodes), or pass "
                         "--ray-address local to run a single-machine cluster inside this process") from None


def cmd_serve_ray(args) -> None:
    """`serve --ray`: deploy, print the URL, and keep the application until SIGINT/SIGTERM."""
    from ray import serve

    _init_ray(args)
    t0 = time.time()
    url = deploy(args)
    print(f"[retriever] Ray Serve application '{APP_NAME}' up in {time.time() - t0:.0f}s: "
          f"{args.shards or 'all'} shard(s) x {args.replicas} replica(s) on {url}", file=sys.stderr, flush=True)
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop["now"]:
        time.sleep(0.5)
    if args.ray_address == "local":
        serve.shutdown()   # stops the HAProxy process too, which killing the cluster would orphan
        print("[retriever] Ray Serve shut down", file=sys.stderr, flush=True)
    else:
        serve.delete(APP_NAME)
        print(f"[retriever] Ray Serve application '{APP_NAME}' deleted", file=sys.stderr, flush=True)
