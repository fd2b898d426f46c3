"""Retriever load benchmark: the real server under C concurrent clients sending batches of B queries.

    python bench/retriever_load.py                       # full run: BM25 100k + 1M, dense fp32 + int8 at 100k
    python bench/retriever_load.py --sizes 100k --kinds bm25 --duration 10
    python bench/retriever_load.py --dense-sizes 10k --faiss-probe-size 100k   # quicker: no 100k dense build

For each configuration it starts `python -m retriever_server serve` on a free loopback port and drives
it with C threads (persistent HTTP/1.1 connections, request bodies prepared in advance, responses
parsed only after each timed window, so the load generator costs little of the cores it shares with
the server). It reports queries/s, per-request p50/p95/p99 latency, errors, recall@3 against the gold
passages of single-hop questions, the server's CPU use and RSS. The ceiling beside each served figure
is the server's own search code run in this process without HTTP: for dense, the query encoder alone
(same model and quantization), in the better of two layouts measured side by side: one batch of all
B*C queries on every core's thread, or one single-threaded batch per core running at once (the
target's ceiling); for BM25, BM25Searcher.search. The opt-in int8 encoder (`serve --quantize int8`) is compared with fp32 in
throughput and recall@3.

On a machine shared with other work the available CPU changes from second to second, so each
server's load is measured in --rounds segments interleaved with its ceiling slices (and the fp32 and
int8 servers run side by side, idle when not loaded): every number sees the same contention. The
table also gives queries per server CPU-second, which other processes' load does not change.

Data: synthetic worlds from `python -m search_r1.data.synth`, one per size, and their indexes are built
once under `--cache-dir` (default `$SEARCH_R1_HOME/bench/retriever`) and reused by later runs.
The markdown table is printed and written to bench/results/retriever_load.md.

Targets (2-core machine, B=16, C=8, zero errors): BM25 >= 1,500 q/s at 100k passages and >= 300 q/s
at 1M; dense (MiniLM, Flat) >= 80% of the raw encoder ceiling; the int8 query encoder >= 1.8x the
fp32 encoder's throughput with served recall@3 within 1 point (the served int8 / fp32 ratio, which
also carries the Flat search and HTTP, is printed beside it).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from retriever_server.cpu import set_threads  # noqa: E402
from retriever_server.launcher import ServerProcess, ServerStartError  # noqa: E402
from search_r1.procmem import tree_memory  # noqa: E402

SIZES = {"10k": 10_000, "100k": 100_000, "1m": 1_000_000}
KINDS = ("bm25", "dense")
# Dense indexes are built by encoding every passage with MiniLM: ~1M passages would take hours on
# 2 CPU cores, so dense runs only at sizes up to this many passages unless --dense-max-size says more.
DENSE_MAX_DEFAULT = "100k"


# --- data and indexes ---------------------------------------------------------------------------

def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def passages_per_entity(cache_dir: Path, seed: int) -> float:
    """Calibrate the generator once: corpus lines per entity of a small world."""
    probe = cache_dir / "probe"
    n = 500
    if not (probe / "corpus.jsonl").exists():
        _run([sys.executable, "-m", "search_r1.data.synth", "--out", str(probe), "--seed", str(seed),
              "--n-entities", str(n)], "calibrating synth generator")
    return _count_lines(probe / "corpus.jsonl") / n


def prepare_world(cache_dir: Path, size: str, seed: int) -> Path:
    """A synth world with about SIZES[size] passages, generated once."""
    out = cache_dir / f"world_{size}"
    if (out / ".bench_done").exists():
        return out
    n_entities = max(50, round(SIZES[size] / passages_per_entity(cache_dir, seed)))
    _run([sys.executable, "-m", "search_r1.data.synth", "--out", str(out), "--seed", str(seed),
          "--n-entities", str(n_entities)], f"generating world {size} ({n_entities} entities)")
    (out / ".bench_done").write_text(str(_count_lines(out / "corpus.jsonl")))
    return out


def prepare_index(cache_dir: Path, world: Path, size: str, kind: str, build_args: list[str],
                  rebuild: bool = False) -> Path:
    """The `kind` index over `world`, built once; rebuilt when asked or when its format is stale."""
    from retriever_server.manifest import FORMAT_VERSION

    out = cache_dir / f"index_{kind}_{size}"
    manifest = out / "manifest.json"
    if (out / ".bench_done").exists() and manifest.exists() and not rebuild:
        if json.loads(manifest.read_text()).get("format_version") == FORMAT_VERSION:
            return out
    build_args = [*build_args, "--force"]
    t0 = time.time()
    _run([sys.executable, "-m", "retriever_server", "build", "--corpus", str(world / "corpus.jsonl"),
          "--kind", kind, "--out", str(out), *build_args], f"building {kind} index over {size}")
    (out / ".bench_done").write_text(f"{time.time() - t0:.0f}")
    return out


def _run(cmd: list[str], what: str) -> None:
    print(f"[bench] {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


@dataclass
class Question:
    text: str
    gold: frozenset


def load_questions(world: Path, limit: int) -> list[Question]:
    """Single-hop (synth_nq) questions of test then train, with their gold passage ids."""
    out: list[Question] = []
    for split in ("test", "train"):
        path = world / f"{split}.jsonl"
        if not path.exists():
            continue
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row.get("data_source") == "synth_nq" and row.get("gold_doc_ids"):
                    out.append(Question(row["question"], frozenset(map(str, row["gold_doc_ids"]))))
                    if len(out) >= limit:
                        return out
    if not out:
        raise SystemExit(f"no single-hop questions with gold_doc_ids in {world}/{{test,train}}.jsonl")
    return out


# --- server -------------------------------------------------------------------------------------

class Server:
    """A served index for the benchmark: the shared launcher (retriever_server.launcher) plus RSS."""

    def __init__(self, index_dirs: list[Path], extra: list[str], log_path: Path, startup_timeout: float):
        self.process = ServerProcess(index_dirs, log_path, flags=extra, cwd=REPO)
        log_path.write_text("")  # one run per log file
        print(f"[bench] starting server: {' '.join(self.process.command)}", file=sys.stderr, flush=True)
        try:
            self.process.start(timeout=startup_timeout)
        except ServerStartError as exc:
            raise SystemExit(str(exc)) from None
        self.port, self.proc = self.process.port, self.process.proc

    def health(self) -> dict:
        return self.process.health()

    def rss_mb(self) -> float:
        """Resident memory of the server process and its children (worker processes)."""
        return tree_memory(self.proc.pid, "rss") / 2**20

    def stop(self) -> None:
        self.process.stop()


# --- load generator -----------------------------------------------------------------------------

@dataclass
class LoadResult:
    """Load measured against one server, summed over the interleaved segments of a run."""

    queries: int = 0          # answered queries inside the timed windows
    elapsed: float = 0.0      # seconds of timed windows
    requests: int = 0
    errors: int = 0
    hits: int = 0             # questions with a gold passage in the top 3
    judged: int = 0
    warm_queries: int = 0     # answered during warm-ups (for CPU efficiency)
    server_cpu_s: float = 0.0  # server CPU seconds over whole segments (warm-up included)
    loadgen_cpu_s: float = 0.0
    wall_s: float = 0.0
    first_error: str = ""
    latencies: list = field(default_factory=list, repr=False)  # seconds per successful request

    def add(self, other: "LoadResult") -> None:
        for name in ("queries", "elapsed", "requests", "errors", "hits", "judged", "warm_queries",
                     "server_cpu_s", "loadgen_cpu_s", "wall_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.latencies += other.latencies
        self.first_error = self.first_error or other.first_error

    @property
    def queries_per_s(self) -> float:
        return self.queries / max(self.elapsed, 1e-9)

    def latency_ms(self, q: float) -> float:
        return _percentile(sorted(self.latencies), q) * 1e3

    @property
    def recall3(self) -> float:
        return self.hits / max(1, self.judged)

    @property
    def cpu(self) -> dict:
        """% of one core used by server and load generator, and queries per server CPU-second."""
        wall = max(self.wall_s, 1e-9)
        return {"server": 100 * self.server_cpu_s / wall, "loadgen": 100 * self.loadgen_cpu_s / wall,
                "server_q_per_cpu_s": (self.queries + self.warm_queries) / max(self.server_cpu_s, 1e-9)}


def _percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    k = min(len(sorted_vals) - 1, max(0, round(q / 100 * (len(sorted_vals) - 1))))
    return sorted_vals[k]


def run_load(port: int, questions: list[Question], batch: int, clients: int, duration: float,
             warmup: float, offset: int = 0, topk: int = 3, api_key: str | None = None) -> LoadResult:
    """C threads, each a keep-alive connection sending batches of B questions for `duration` s.

    Thread t sends the batches offset+t, offset+t+C, ... of the question pool (cycling), so all clients
    ask different questions. Only latencies and raw bodies are recorded in the timed window.
    """
    n_batches = max(1, len(questions) // batch)
    bodies = [json.dumps({"queries": [q.text for q in questions[i * batch:(i + 1) * batch]],
                          "topk": topk, "return_scores": True}).encode() for i in range(n_batches)]
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    start_evt = threading.Event()
    t_start = t_measure = t_stop = 0.0
    records: list[list] = [[] for _ in range(clients)]  # (batch index, latency s, status, body, end)
    warm = [0] * clients  # queries answered during the warm-up
    errors: list[str] = []

    def worker(tid: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        rec = records[tid]
        i = offset + tid
        start_evt.wait()
        while True:
            t0 = time.perf_counter()
            if t0 >= t_stop:
                break
            b = i % n_batches
            try:
                conn.request("POST", "/retrieve", bodies[b], headers)
                resp = conn.getresponse()
                data = resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                status, data = -1, b""
            t1 = time.perf_counter()
            if t0 >= t_measure:
                rec.append((b, t1 - t0, status, data, t1))
            elif status == 200:
                warm[tid] += batch
            i += clients
        conn.close()

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(clients)]
    for t in threads:
        t.start()
    t_start = time.perf_counter()
    t_measure, t_stop = t_start + warmup, t_start + warmup + duration
    start_evt.set()
    for t in threads:
        t.join()
    # Requests started inside the window count whole; the window ends when the last of them ends.
    flat = [r for rec in records for r in rec]
    elapsed = max([duration] + [r[4] - t_measure for r in flat])

    # Parse outside the timed window: errors and recall@3 (a question counts as recalled when any of
    # its gold passages is among the top 3 hits).
    n_err, hit, total, n_queries, first_error = 0, 0, 0, 0, errors[0] if errors else ""
    ok_lat: list[float] = []
    for b, lat, status, data, _ in flat:
        if status != 200:
            n_err += 1
            if not first_error:
                first_error = f"HTTP {status}: {data[:200]!r}"
            continue
        try:
            result = json.loads(data)["result"]
            qs = questions[b * batch:(b + 1) * batch]
            if len(result) != len(qs):
                raise ValueError(f"{len(result)} results for {len(qs)} queries")
        except (ValueError, KeyError) as exc:
            n_err += 1
            first_error = first_error or f"bad body: {exc}"
            continue
        ok_lat.append(lat)
        n_queries += len(qs)
        for q, hits in zip(qs, result):
            ids = {str((h.get("document") or h).get("id")) for h in hits[:3]}
            hit += bool(ids & q.gold)
            total += 1
    return LoadResult(queries=n_queries, elapsed=elapsed, requests=len(flat), errors=n_err + len(errors),
                      hits=hit, judged=total, warm_queries=sum(warm), first_error=first_error,
                      latencies=ok_lat)


# --- ceilings: the server's own search code in this process, no HTTP -------------------------------

class Ceiling:
    """Throughput of `step(batch_texts)` measured in slices that interleave with the served load, so
    that both see the same contention from other processes on a shared machine. `streams` threads
    call `step` at once (each on its own batches), with `threads` torch/faiss threads each."""

    def __init__(self, step, questions: list[Question], batch_size: int, streams: int = 1,
                 threads: int | None = None):
        self.step, self.batch_size, self.streams, self.threads = step, batch_size, streams, threads
        self.texts = [q.text for q in questions]
        self.done, self.wall, self.cpu, self._i = 0, 0.0, 0.0, 0
        self._lock = threading.Lock()
        if threads:
            set_threads(threads, threads)
        self.last = step(self.texts[:batch_size])  # warm-up: first call allocates and picks kernels

    @property
    def layout(self) -> str:
        return f"{self.streams} x {self.threads or 1} thread(s), batch {self.batch_size}"

    def _next_chunk(self) -> list[str]:
        with self._lock:
            i, self._i = self._i, self._i + self.batch_size
        return [self.texts[(i + j) % len(self.texts)] for j in range(self.batch_size)]

    def measure(self, seconds: float) -> None:
        if self.threads:
            set_threads(self.threads, self.threads)
        t0, c0 = time.perf_counter(), time.process_time()

        def stream() -> None:
            while time.perf_counter() - t0 < seconds:
                self.last = self.step(self._next_chunk())
                with self._lock:
                    self.done += self.batch_size

        if self.streams == 1:
            stream()
        else:
            pool = [threading.Thread(target=stream) for _ in range(self.streams)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0

    @property
    def qps(self) -> float:
        return self.done / max(self.wall, 1e-9)

    @property
    def q_per_cpu_s(self) -> float:
        return self.done / max(self.cpu, 1e-9)


def encoder_ceilings(index_dir: Path, questions: list[Question], batch_size: int,
                     quantize: str) -> list[Ceiling]:
    """The server's QueryEncoder (same model, max length, quantization) encoding bench questions, no
    HTTP, no faiss, in two layouts: one stream of `batch_size`-query batches on all cores' threads,
    and one single-threaded stream per core with batches of batch_size / cores (what each of the
    server's per-core search threads gets when every client waits). The better one is the ceiling."""
    from retriever_server.dense_index import QueryEncoder, resolve_model

    params = json.loads((index_dir / "manifest.json").read_text()).get("params", {})
    enc = QueryEncoder(resolve_model(params.get("model_path")), quantize=quantize,
                       max_seq_length=params.get("max_seq_length"))
    cpus = os.cpu_count() or 1
    step = lambda texts: enc.encode(texts, len(texts))  # noqa: E731
    layouts = [(1, cpus, batch_size)] + ([(cpus, 1, max(1, batch_size // cpus))] if cpus > 1 else [])
    return [Ceiling(step, questions, b, streams=n, threads=t) for n, t, b in layouts]


def bm25_ceiling(index_dir: Path, questions: list[Question], batch_size: int) -> Ceiling:
    """The server's BM25Searcher.search on batches of `batch_size` bench questions, one thread."""
    from retriever_server.bm25_index import BM25Searcher

    params = json.loads((index_dir / "manifest.json").read_text()).get("params", {})
    searcher = BM25Searcher(index_dir, params)
    return Ceiling(lambda texts: searcher.search(texts, 3), questions, batch_size)


def faiss_costs(index_dir: Path, queries_emb, probe_size: int = 0) -> dict:
    """ms per batch of the real index's search, faiss fp32 and (on CPUs with native bf16) the server's
    bf16-screened exact search, and the same over `probe_size` random unit vectors: what a corpus of
    that size would add when no such index was built."""
    import faiss
    import numpy as np

    from retriever_server.dense_index import FAISS_FILE, configure_faiss
    from retriever_server.cpu import has_native_bf16
    from retriever_server.flat_bf16 import Bf16FlatScreen

    configure_faiss()  # the server's faiss settings (BLAS path for batched Flat search)

    def timings(index) -> dict:
        out = {"faiss": _time_ms(lambda: index.search(queries_emb, 3))}
        if has_native_bf16() and isinstance(index, faiss.IndexFlat):
            xb = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d)
            screen = Bf16FlatScreen(np.asarray(xb).reshape(index.ntotal, index.d))
            out["bf16"] = _time_ms(lambda: screen.search(queries_emb, 3))
        return out

    out = {"index": timings(faiss.read_index(str(index_dir / FAISS_FILE)))}
    if probe_size:
        rng = np.random.default_rng(0)
        probe = faiss.IndexFlatIP(queries_emb.shape[1])
        for start in range(0, probe_size, 100_000):  # add in slices: bounded temporary memory
            x = rng.standard_normal((min(100_000, probe_size - start), queries_emb.shape[1]), dtype=np.float32)
            probe.add(x / np.linalg.norm(x, axis=1, keepdims=True))
        out["probe"] = timings(probe)
    return out


def _time_ms(fn, repeat: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1e3 * (time.perf_counter() - t0) / repeat


# --- report ---------------------------------------------------------------------------------------

@dataclass
class Row:
    index: str
    passages: int
    encoder: str
    load: LoadResult
    rss_mb: float
    ceiling: Ceiling | None = None
    target: str = ""
    met: bool | None = None
    batching: dict = field(default_factory=dict)  # the server's /health batching stats after the run


def render_table(rows: list[Row], args, notes: list[str]) -> str:
    head = ("| index | passages | encoder | q/s | p50 ms | p95 ms | p99 ms | requests | errors | recall@3 "
            "| server batch (mean) | CPU % server / load gen | q per server CPU-s | server RSS MB | ceiling q/s "
            "| % of ceiling: wall / CPU | target | met |")
    lines = [f"Retriever load, B={args.batch_size} queries/request, C={args.concurrency} clients, "
             f"{args.duration:g} s of measured load per server in {args.rounds} segments (each after "
             f"{args.warmup:g} s of warm-up), server threads (dense) {args.server_threads_seen}, "
             f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} (inherited by the server), "
             f"{os.cpu_count()} CPU cores shared by server and load generator (1-min load average "
             f"{args.load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after: other work on the machine "
             "competes for the same cores).", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ld, cpu = r.load, r.load.cpu
        ceil = pct = ""
        if r.ceiling:
            ceil = f"{r.ceiling.qps:,.0f}"
            pct = (f"{100 * ld.queries_per_s / r.ceiling.qps:.0f}% / "
                   f"{100 * cpu['server_q_per_cpu_s'] / r.ceiling.q_per_cpu_s:.0f}%")
        met = "" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.index} | {r.passages:,} | {r.encoder} | {ld.queries_per_s:,.0f} | {ld.latency_ms(50):.1f} "
                     f"| {ld.latency_ms(95):.1f} | {ld.latency_ms(99):.1f} | {ld.requests:,} | {ld.errors} "
                     f"| {ld.recall3:.3f} | {r.batching.get('mean_batch_queries', '')} "
                     f"| {cpu['server']:.0f} / {cpu['loadgen']:.0f} | {cpu['server_q_per_cpu_s']:,.0f} "
                     f"| {r.rss_mb:,.0f} | {ceil} | {pct} | {r.target} | {met} |")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    from search_r1.paths import home

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="100k,1m",
                   help=f"comma-separated corpus sizes in passages, from {sorted(SIZES)}")
    p.add_argument("--kinds", default="bm25,dense", help=f"comma-separated index kinds, from {list(KINDS)}")
    p.add_argument("--dense-max-size", default=DENSE_MAX_DEFAULT,
                   help="largest of --sizes that also gets a dense run (encoding the corpus is the slow part)")
    p.add_argument("--dense-sizes", default=None,
                   help="explicit comma-separated sizes for the dense runs, replacing --sizes/--dense-max-size "
                        "for dense (e.g. 10k when a 100k dense build is too slow on a busy machine)")
    p.add_argument("--batch-size", "-B", type=int, default=16, help="queries per request (B)")
    p.add_argument("--concurrency", "-C", type=int, default=8,
                   help="concurrent clients, one connection each (C)")
    p.add_argument("--duration", type=float, default=20.0,
                   help="measured seconds of load per server, split over --rounds")
    p.add_argument("--rounds", type=int, default=3,
                   help="load segments per server, interleaved with the ceiling measurements (and fp32 with "
                        "int8) so that all of them see the same contention from other work on the machine")
    p.add_argument("--warmup", type=float, default=2.0,
                   help="unmeasured seconds of load before each measured segment")
    p.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the dense index with the int8-quantized query encoder "
                        "(`serve --quantize int8`)")
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the raw throughput without the server: the query encoder for dense runs, "
                        "BM25Searcher.search (one thread, the server's mean batch size) for BM25 runs")
    p.add_argument("--rebuild", default="",
                   help="comma-separated index kinds to rebuild even if cached (bm25, dense, all)")
    p.add_argument("--encoder-batch", type=int, default=None,
                   help="queries per batch of the raw encoder measurement in its one-stream layout; the "
                        "one-stream-per-core layout uses this / cores (default: B*C, every query in flight "
                        "in one batch: the raw encoder's best case, independent of the server's max_batch)")
    p.add_argument("--faiss-probe-size", default="",
                   help="also time an exact faiss search over this many random vectors (a size from the "
                        "--sizes list, e.g. 100k) to estimate a bigger dense corpus without building it")
    p.add_argument("--questions", type=int, default=20_000, help="most single-hop questions in the query pool")
    p.add_argument("--serve-args", default="",
                   help="extra arguments for every `retriever_server serve` (e.g. \"--batch-window-ms 5\")")
    p.add_argument("--cache-dir", type=Path, default=home() / "bench" / "retriever",
                   help="where generated worlds and built indexes are kept between runs")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic worlds")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "retriever_load.md",
                   help="where the markdown table is written")
    args = p.parse_args(argv)
    args.sizes = [x.strip().lower() for x in args.sizes.split(",") if x.strip()]
    args.kinds = [x.strip().lower() for x in args.kinds.split(",") if x.strip()]
    args.rebuild = [x.strip().lower() for x in args.rebuild.split(",") if x.strip()]
    for k in args.rebuild:
        if k not in (*KINDS, "all"):
            p.error(f"--rebuild {k!r} unknown; allowed values are {[*KINDS, 'all']}")
    if args.dense_sizes is None:
        cap = SIZES.get(args.dense_max_size, 0)
        args.dense_sizes = [x for x in args.sizes if x in SIZES and SIZES[x] <= cap]
    else:
        args.dense_sizes = [x.strip().lower() for x in args.dense_sizes.split(",") if x.strip()]
    probe = [args.faiss_probe_size] if args.faiss_probe_size else []
    for s in [*args.sizes, *args.dense_sizes, args.dense_max_size, *probe]:
        if s not in SIZES:
            p.error(f"size {s!r} unknown; allowed sizes are {sorted(SIZES)}")
    for k in args.kinds:
        if k not in KINDS:
            p.error(f"--kinds {k!r} unknown; allowed kinds are {list(KINDS)}")
    for name in ("batch_size", "concurrency", "encoder_batch", "questions", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be > 0 and --warmup >= 0")
    return args


def _tree_cpu_s(proc) -> float:
    """User + system CPU seconds of a process and its live children (`serve --processes N` workers)."""
    import psutil

    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


class ServedIndex:
    """One running server and the load measured against it, segment by segment."""

    def __init__(self, args, label: str, index_dir: Path, extra: list[str]):
        self.args, self.label = args, label
        self.server = Server([index_dir], extra + args.serve_args.split(),
                             args.cache_dir / f"server_{label}.log", args.startup_timeout)
        self.load = LoadResult()
        self.rss_mb, self.batching = 0.0, {}
        health = self.server.health()
        self.threads = health.get("threads", {})  # workers, torch, faiss as resolved
        self.flat_search = (health.get("indexes") or [{}])[0].get("flat_search", "faiss")

    def segment(self, questions: list[Question], seconds: float, offset: int) -> None:
        """C clients for warm-up + `seconds`, accounting server and load-generator CPU time."""
        import psutil

        a = self.args
        proc = psutil.Process(self.server.proc.pid)
        cpu0, srv0, t0 = time.process_time(), _tree_cpu_s(proc), time.perf_counter()
        seg = run_load(self.server.port, questions, a.batch_size, a.concurrency, seconds, a.warmup, offset)
        seg.wall_s = time.perf_counter() - t0
        seg.server_cpu_s = _tree_cpu_s(proc) - srv0
        seg.loadgen_cpu_s = time.process_time() - cpu0
        self.load.add(seg)

    def finish(self) -> None:
        try:
            self.rss_mb = self.server.rss_mb()
            self.batching = self.server.health().get("batching", {})
        finally:
            self.server.stop()
        ld, cpu = self.load, self.load.cpu
        print(f"[bench] {self.label}: {ld.queries_per_s:,.0f} q/s, p50 {ld.latency_ms(50):.1f} ms, "
              f"p99 {ld.latency_ms(99):.1f} ms, errors {ld.errors}, recall@3 {ld.recall3:.3f}, CPU server "
              f"{cpu['server']:.0f}% load generator {cpu['loadgen']:.0f}%, mean server batch "
              f"{self.batching.get('mean_batch_queries')}"
              + (f" (first error: {ld.first_error})" if ld.first_error else ""), file=sys.stderr, flush=True)

    def row(self, index: str, passages: int, encoder: str) -> Row:
        return Row(index, passages, encoder, self.load, self.rss_mb, batching=self.batching)


def run_bm25(args, size: str, index_dir: Path, passages: int, questions: list[Question]) -> Row:
    """Load segments on the server, alternating with slices of the in-process BM25 ceiling."""
    served = ServedIndex(args, f"bm25_{size}", index_dir, [])
    ceiling = None
    seg = args.duration / args.rounds
    try:
        for rnd in range(args.rounds):
            served.segment(questions, seg, offset=rnd * 7919)
            if args.ceiling:
                if ceiling is None:  # batch like the server's: its mean coalesced batch so far
                    mean = served.server.health()["batching"].get("mean_batch_queries") or args.batch_size
                    ceiling = bm25_ceiling(index_dir, questions, max(1, round(mean)))
                ceiling.measure(seg / 2)
    finally:
        served.finish()
    row = served.row("bm25", passages, "")
    row.ceiling = ceiling
    need = 1500 if SIZES[size] <= 100_000 else 300
    row.target = f">= {need:,} q/s, 0 errors"
    row.met = row.load.queries_per_s >= need and not row.load.errors
    return row


def run_dense(args, size: str, index_dir: Path, passages: int, questions: list[Question],
              notes: list[str]) -> list[Row]:
    """fp32 and (opt-in) int8 servers running side by side, idle when not loaded; each round loads
    one, measures its encoder ceilings, then the other, so all the numbers share the same contention."""
    variants = [("fp32", "none", [])] + ([("int8", "int8", ["--quantize", "int8"])] if args.int8 else [])
    served: dict[str, ServedIndex] = {}
    layouts: dict[str, list[Ceiling]] = {}
    seg = args.duration / args.rounds
    try:
        for name, _, extra in variants:
            served[name] = ServedIndex(args, f"dense_{size}_{name}", index_dir, extra)
        t = served["fp32"].threads
        args.server_threads_seen = (f"{t.get('workers')} search thread(s) x {t.get('torch')} torch thread(s)"
                                    if t else "unknown")
        # Every query in flight in one batch (or one batch per core): the raw encoder's best case.
        enc_batch = args.encoder_batch or args.batch_size * args.concurrency
        if args.ceiling:
            for name, quantize, _ in variants:
                layouts[name] = encoder_ceilings(index_dir, questions, enc_batch, quantize)
        for rnd in range(args.rounds):
            for name, _, _ in variants:
                served[name].segment(questions, seg, offset=rnd * 7919)
                for ceiling in layouts.get(name, []):
                    ceiling.measure(seg / 2 / len(layouts[name]))
    finally:
        for s in served.values():
            s.finish()
    best = {name: max(cs, key=lambda c: c.qps) for name, cs in layouts.items()}
    rows = []
    for name, _, _ in variants:
        row = served[name].row("dense", passages, f"MiniLM {name}")
        row.ceiling = best.get(name)
        rows.append(row)
        if name in layouts:
            notes.append(f"dense {size} {name} raw encoder (the ceiling is the better layout): " + "; ".join(
                f"{c.layout}: {c.qps:,.0f} q/s" for c in layouts[name]))
    fp32 = rows[0]
    if args.ceiling:
        fp32.target = ">= 80% of ceiling, 0 errors"
        fp32.met = fp32.load.queries_per_s >= 0.8 * fp32.ceiling.qps and not fp32.load.errors
        probe = SIZES[args.faiss_probe_size] if args.faiss_probe_size else 0
        one = layouts["fp32"][0]  # the single-stream layout: one batch of enc_batch queries, all cores
        set_threads(one.threads or 1, one.threads or 1)
        cost = faiss_costs(index_dir, one.last, probe)
        fmt = lambda c: " / ".join(f"{name} {ms:.1f} ms" for name, ms in c.items())  # noqa: E731
        note = (f"dense {size} fp32 without the server, per batch of {enc_batch} queries on {one.threads} "
                f"thread(s): encode {1e3 * enc_batch / one.qps:.0f} ms; Flat search over {passages:,} "
                f"passages: {fmt(cost['index'])}")
        if probe:
            note += (f"; over {probe:,} random vectors (what a {args.faiss_probe_size} corpus would cost): "
                     f"{fmt(cost['probe'])}")
        note += f" (the server searches with {served['fp32'].flat_search})"
        notes.append(note)
    if args.int8:
        q8 = rows[1]
        speedup = q8.load.queries_per_s / max(fp32.load.queries_per_s, 1e-9)
        drecall = 100 * (q8.load.recall3 - fp32.load.recall3)
        # The target is the query encoder's ("an int8-quantized query encoder at least 1.8x the fp32
        # throughput"): the raw encoders, best layout each, measured interleaved in this run; recall is
        # the served one. The served ratio (which also carries the Flat search and HTTP) is reported.
        raw = best["int8"].qps / best["fp32"].qps if args.ceiling else speedup
        q8.target = (">= 1.8x fp32 encoder q/s, recall@3 within 1 pt" if args.ceiling
                     else ">= 1.8x fp32 q/s, recall@3 within 1 pt")
        q8.met = raw >= 1.8 and abs(drecall) <= 1.0 and not q8.load.errors
        note = (f"dense {size}: int8 / fp32 served throughput {speedup:.2f}x (per server CPU-s "
                f"{q8.load.cpu['server_q_per_cpu_s'] / max(fp32.load.cpu['server_q_per_cpu_s'], 1e-9):.2f}x), "
                f"recall@3 difference {drecall:+.1f} points")
        if args.ceiling:
            note += f"; raw encoder (best layouts) int8 / fp32 {raw:.2f}x (the target's measure)"
        notes.append(note)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    args.load_before = os.getloadavg()[0]
    args.server_threads_seen = "default"
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows: list[Row] = []
    notes: list[str] = []
    t_all = time.time()
    for size in sorted(set(args.sizes) | set(args.dense_sizes), key=SIZES.get):
        kinds = [k for k in args.kinds if size in (args.sizes if k == "bm25" else args.dense_sizes)]
        if not kinds:
            continue
        world = prepare_world(args.cache_dir, size, args.seed)
        passages = int((world / ".bench_done").read_text())
        questions = load_questions(world, args.questions)
        for kind in kinds:
            index_dir = prepare_index(args.cache_dir, world, size, kind, [],
                                      rebuild=kind in args.rebuild or "all" in args.rebuild)
            if kind == "bm25":
                rows.append(run_bm25(args, size, index_dir, passages, questions))
            else:
                rows.extend(run_dense(args, size, index_dir, passages, questions, notes))
    if args.ceiling and any(r.ceiling and r.index == "bm25" for r in rows):
        notes.append("BM25 ceiling: the server's BM25Searcher.search in the benchmark process, no HTTP, one "
                     "thread, batches of the server's mean batch size")
    notes.append("CPU %: share of one core over the run (100% = one core busy); q per server CPU-s: answered "
                 "queries per second of server CPU time, a throughput figure that does not depend on how much "
                 "of the machine other processes took; % of ceiling: served q/s over ceiling q/s (wall clock, "
                 "the target's measure) / served queries per server CPU-s over ceiling queries per CPU-s (the "
                 "serving overhead with contention from other processes factored out)")
    notes.append("recall@3: share of single-hop (synth_nq) questions with a gold passage among the top 3 hits; "
                 "latency is per request of B queries")
    env = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY",) if k in os.environ]
    command = " ".join([*env, "python bench/retriever_load.py", *(sys.argv[1:] if argv is None else argv)])
    notes.append(f"command: {command} (total {time.time() - t_all:.0f} s)")
    order = {k: i for i, k in enumerate(KINDS)}
    rows.sort(key=lambda r: (order[r.index], r.passages))
    table = render_table(rows, args, notes)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(f"[bench] table written to {args.out}", file=sys.stderr)
    return 0 if all(r.met is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
