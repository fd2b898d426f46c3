"""Retriever load benchmark: the real server under C concurrent clients sending batches of B queries.

    python bench/retriever_load.py                       # full run: BM25 100k + 1M, dense fp32 + int8 at 100k
    python bench/retriever_load.py --sizes 100k --kinds bm25 --duration 10

For each configuration it starts `python -m retriever_server serve` on a free loopback port, drives it
for `--duration` seconds with C threads (persistent HTTP/1.1 connections, request bodies prepared in
advance, responses parsed only after the timed window, so the load generator costs little of the 2
cores it shares with the server), and reports queries/s, per-request p50/p95/p99 latency, errors,
recall@3 against the gold passages of single-hop questions and the server's RSS. For the dense index it
also measures the raw query encoder (same model code as the server, no HTTP) at the batch size and
thread count the server uses; that is the ceiling the server's throughput is compared with. The
opt-in int8 encoder (`serve --quantize int8`) is compared with fp32 in throughput and recall@3.

Data: synthetic worlds from `python -m search_r1.data.synth`, one per size, and their indexes are built
once under `--cache-dir` (default `$SEARCH_R1_HOME/bench/retriever`) and reused by later runs.
The markdown table is printed and written to bench/results/retriever_load.md.

Targets (2-core machine, B=16, C=8, zero errors): BM25 >= 1,500 q/s at 100k passages and >= 300 q/s
at 1M; dense (MiniLM, Flat) >= 80% of the raw encoder ceiling; int8 >= 1.8x fp32 throughput with
recall@3 within 1 point.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

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

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m retriever_server serve` in a subprocess on a free loopback port."""

    def __init__(self, index_dirs: list[Path], extra: list[str], log_path: Path, startup_timeout: float):
        self.port = free_port()
        cmd = [sys.executable, "-m", "retriever_server", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        for d in index_dirs:
            cmd += ["--index", str(d)]
        cmd += extra
        self.log_path = log_path
        self._log = open(log_path, "w")
        print(f"[bench] starting server: {' '.join(cmd)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait(startup_timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; log: {self.log_path}\n"
                                 + self.log_path.read_text()[-3000:])
            try:
                self.health()
                return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise SystemExit(f"server not healthy after {timeout:.0f}s; log: {self.log_path}")

    def health(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"/health returned {resp.status}")
            return json.loads(body)
        finally:
            conn.close()

    def rss_mb(self) -> float:
        """Resident memory of the server process and its children (worker processes)."""
        import psutil

        p = psutil.Process(self.proc.pid)
        procs = [p] + p.children(recursive=True)
        return sum(q.memory_info().rss for q in procs if q.is_running()) / 2**20

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# --- load generator -----------------------------------------------------------------------------

@dataclass
class LoadResult:
    queries_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    requests: int
    errors: int
    recall3: float
    first_error: str = ""
    latencies: list = field(default_factory=list, repr=False)


def _percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    k = min(len(sorted_vals) - 1, max(0, round(q / 100 * (len(sorted_vals) - 1))))
    return sorted_vals[k]


def run_load(port: int, questions: list[Question], batch: int, clients: int, duration: float,
             warmup: float, topk: int = 3, api_key: str | None = None) -> LoadResult:
    """C threads, each a keep-alive connection sending batches of B questions for `duration` s.

    Thread t sends the batches t, t+C, t+2C, ... of the question pool (cycling), so all clients ask
    different questions. Only latencies and raw bodies are recorded in the timed window.
    """
    n_batches = max(1, len(questions) // batch)
    bodies = [json.dumps({"queries": [q.text for q in questions[i * batch:(i + 1) * batch]],
                          "topk": topk, "return_scores": True}).encode() for i in range(n_batches)]
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    start_evt = threading.Event()
    t_start = t_measure = t_stop = 0.0
    records: list[list] = [[] for _ in range(clients)]  # (batch index, latency s, status, body)
    errors: list[str] = []

    def worker(tid: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        rec = records[tid]
        i = tid
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
    ok_lat.sort()
    return LoadResult(queries_per_s=n_queries / elapsed, p50_ms=_percentile(ok_lat, 50) * 1e3,
                      p95_ms=_percentile(ok_lat, 95) * 1e3, p99_ms=_percentile(ok_lat, 99) * 1e3,
                      requests=len(flat), errors=n_err + len(errors), recall3=hit / max(1, total),
                      first_error=first_error)


# --- raw encoder ceiling --------------------------------------------------------------------------

def encoder_ceiling(index_dir: Path, questions: list[Question], batch_size: int, threads: int,
                    quantize: str, duration: float, faiss_probe: int = 0) -> tuple[float, dict]:
    """Queries/s of the server's own QueryEncoder, no HTTP, no faiss: encode the bench questions in
    batches of `batch_size` with `threads` torch threads, for about `duration` seconds.

    Also returns the faiss side per batch: the real index's search time and, when `faiss_probe` > 0,
    the time of an exact (Flat) search over that many random unit vectors, an estimate of what a
    corpus of that size adds per batch when no index of that size was built.
    """
    import faiss
    import numpy as np
    import torch

    from retriever_server.dense_index import FAISS_FILE, QueryEncoder, resolve_model

    params = json.loads((index_dir / "manifest.json").read_text()).get("params", {})
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    enc = QueryEncoder(resolve_model(params.get("model_path")), quantize=quantize,
                       max_seq_length=params.get("max_seq_length"))
    texts = [q.text for q in questions]
    enc.encode(texts[:batch_size], batch_size)  # warm-up: first call allocates and picks kernels
    done, i, t0, last = 0, 0, time.perf_counter(), None
    while time.perf_counter() - t0 < duration:
        chunk = [texts[(i + j) % len(texts)] for j in range(batch_size)]
        last = enc.encode(chunk, batch_size)
        done += len(chunk)
        i += batch_size
    qps = done / (time.perf_counter() - t0)
    extra = {"encode_ms_per_batch": 1e3 * batch_size / qps}
    index = faiss.read_index(str(index_dir / FAISS_FILE))
    extra["faiss_ms_per_batch"] = _time_ms(lambda: index.search(last, 3))
    if faiss_probe:
        rng = np.random.default_rng(0)
        probe = faiss.IndexFlatIP(last.shape[1])
        for start in range(0, faiss_probe, 100_000):  # add in slices: bounded temporary memory
            x = rng.standard_normal((min(100_000, faiss_probe - start), last.shape[1]), dtype=np.float32)
            probe.add(x / np.linalg.norm(x, axis=1, keepdims=True))
        extra["probe_faiss_ms_per_batch"] = _time_ms(lambda: probe.search(last, 3))
    return qps, extra


def _time_ms(fn, repeat: int = 5) -> float:
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
    ceiling: float | None = None
    target: str = ""
    met: bool | None = None
    batching: dict = field(default_factory=dict)  # the server's /health batching stats after the run
    cpu: dict = field(default_factory=dict)       # % of one core used by "server" and "loadgen"


def render_table(rows: list[Row], args, notes: list[str]) -> str:
    head = ("| index | passages | encoder | q/s | p50 ms | p95 ms | p99 ms | requests | errors | recall@3 "
            "| server batch (mean) | CPU % server / load gen | server RSS MB | ceiling q/s | % of ceiling | target | met |")
    lines = [f"Retriever load, B={args.batch_size} queries/request, C={args.concurrency} clients, "
             f"{args.duration:g} s per configuration after {args.warmup:g} s warm-up, "
             f"{os.cpu_count()} CPU cores shared by server and load generator (1-min load average "
             f"{args.load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after: other work on the machine "
             "competes for the same cores).", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ld = r.load
        ceil = f"{r.ceiling:,.0f}" if r.ceiling else ""
        pct = f"{100 * ld.queries_per_s / r.ceiling:.0f}%" if r.ceiling else ""
        met = "" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.index} | {r.passages:,} | {r.encoder} | {ld.queries_per_s:,.0f} | {ld.p50_ms:.1f} "
                     f"| {ld.p95_ms:.1f} | {ld.p99_ms:.1f} | {ld.requests:,} | {ld.errors} | {ld.recall3:.3f} "
                     f"| {r.batching.get('mean_batch_queries', '')} | {r.cpu.get('server', 0):.0f} / {r.cpu.get('loadgen', 0):.0f} "
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
    p.add_argument("--concurrency", "-C", type=int, default=8, help="concurrent clients, one connection each (C)")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per configuration")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds of load before measuring")
    p.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the dense index with the int8-quantized query encoder (`serve --quantize int8`)")
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the raw throughput without the server: the query encoder for dense runs, "
                        "BM25Searcher.search (one thread, the server's mean batch size) for BM25 runs")
    p.add_argument("--rebuild", default="",
                   help="comma-separated index kinds to rebuild even if cached (bm25, dense, all)")
    p.add_argument("--encoder-batch", type=int, default=None,
                   help="batch size of the raw encoder measurement (default: B*C capped at the server's "
                        "max_batch from /health: the batch the server encodes when all clients wait)")
    p.add_argument("--faiss-probe-size", default="",
                   help="also time an exact faiss search over this many random vectors (a size from the "
                        "--sizes list, e.g. 100k) to estimate a bigger dense corpus without building it")
    p.add_argument("--encoder-threads", type=int, default=os.cpu_count(),
                   help="torch threads of the raw encoder measurement; the server's torch thread count")
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
        args.dense_sizes = [x for x in args.sizes if x in SIZES and SIZES[x] <= SIZES.get(args.dense_max_size, 0)]
    else:
        args.dense_sizes = [x.strip().lower() for x in args.dense_sizes.split(",") if x.strip()]
    for s in args.sizes + args.dense_sizes + [args.dense_max_size] + ([args.faiss_probe_size] if args.faiss_probe_size else []):
        if s not in SIZES:
            p.error(f"size {s!r} unknown; allowed sizes are {sorted(SIZES)}")
    for k in args.kinds:
        if k not in KINDS:
            p.error(f"--kinds {k!r} unknown; allowed kinds are {list(KINDS)}")
    for name in ("batch_size", "concurrency", "encoder_batch", "encoder_threads", "questions"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be > 0 and --warmup >= 0")
    return args


def bench_server(args, label: str, index_dir: Path, passages: int, questions: list[Question],
                 encoder: str, extra: list[str]) -> Row:
    import psutil

    server = Server([index_dir], extra + args.serve_args.split(), args.cache_dir / f"server_{label}.log",
                    args.startup_timeout)
    try:
        srv_proc = psutil.Process(server.proc.pid)
        cpu0, srv0, t0 = time.process_time(), sum(srv_proc.cpu_times()[:2]), time.perf_counter()
        load = run_load(server.port, questions, args.batch_size, args.concurrency, args.duration, args.warmup)
        wall = time.perf_counter() - t0
        # CPU share of one core over the whole run (warm-up included): where the 2 cores went.
        cpu = {"loadgen": 100 * (time.process_time() - cpu0) / wall,
               "server": 100 * (sum(srv_proc.cpu_times()[:2]) - srv0) / wall}
        rss = server.rss_mb()
        batching = server.health().get("batching", {})
    finally:
        server.stop()
    print(f"[bench] {label}: {load.queries_per_s:,.0f} q/s, p50 {load.p50_ms:.1f} ms, p99 {load.p99_ms:.1f} ms, "
          f"errors {load.errors}, recall@3 {load.recall3:.3f}, CPU server {cpu['server']:.0f}% "
          f"load generator {cpu['loadgen']:.0f}%, mean server batch {batching.get('mean_batch_queries')}"
          + (f" (first error: {load.first_error})" if load.first_error else ""), file=sys.stderr, flush=True)
    return Row(label.split("_")[0], passages, encoder, load, rss, batching=batching, cpu=cpu)


def bm25_ceiling(index_dir: Path, questions: list[Question], batch_size: int, duration: float) -> float:
    """Queries/s of the server's BM25Searcher.search in this process (no HTTP), batches of `batch_size`."""
    from retriever_server.bm25_index import BM25Searcher

    params = json.loads((index_dir / "manifest.json").read_text()).get("params", {})
    searcher = BM25Searcher(index_dir, params)
    texts = [q.text for q in questions]
    searcher.search(texts[:batch_size], 3)
    done, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < duration:
        searcher.search([texts[(i + j) % len(texts)] for j in range(batch_size)], 3)
        done += batch_size
        i += batch_size
    return done / (time.perf_counter() - t0)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.load_before = os.getloadavg()[0]
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows: list[Row] = []
    notes: list[str] = []
    enc_batch = None
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
                row = bench_server(args, f"bm25_{size}", index_dir, passages, questions, "", [])
                if args.ceiling:
                    mean_batch = max(1, round(row.batching.get("mean_batch_queries") or args.batch_size))
                    row.ceiling = bm25_ceiling(index_dir, questions, mean_batch, min(args.duration, 10))
                need = 1500 if SIZES[size] <= 100_000 else 300
                row.target, row.met = f">= {need:,} q/s, 0 errors", row.load.queries_per_s >= need and not row.load.errors
                rows.append(row)
                continue
            fp32 = bench_server(args, f"dense_{size}_fp32", index_dir, passages, questions, "MiniLM fp32", [])
            rows.append(fp32)
            enc_batch = args.encoder_batch or min(args.batch_size * args.concurrency,
                                                  fp32.batching.get("max_batch", 256))
            if args.ceiling:
                probe = SIZES[args.faiss_probe_size] if args.faiss_probe_size else 0
                fp32.ceiling, cost = encoder_ceiling(index_dir, questions, enc_batch, args.encoder_threads,
                                                     "none", min(args.duration, 15), probe)
                notes.append(f"dense {size} fp32, per batch of {enc_batch} queries without the server: "
                             f"encode {cost['encode_ms_per_batch']:.0f} ms, faiss Flat search over "
                             f"{passages:,} passages {cost['faiss_ms_per_batch']:.1f} ms"
                             + (f"; Flat search over {probe:,} random vectors (the cost a {args.faiss_probe_size} "
                                f"corpus would add) {cost['probe_faiss_ms_per_batch']:.1f} ms" if probe else ""))
                fp32.target = ">= 80% of ceiling, 0 errors"
                fp32.met = fp32.load.queries_per_s >= 0.8 * fp32.ceiling and not fp32.load.errors
            if args.int8:
                q8 = bench_server(args, f"dense_{size}_int8", index_dir, passages, questions, "MiniLM int8",
                                  ["--quantize", "int8"])
                rows.append(q8)
                if args.ceiling:
                    q8.ceiling, _ = encoder_ceiling(index_dir, questions, enc_batch, args.encoder_threads,
                                                    "int8", min(args.duration, 15))
                speedup = q8.load.queries_per_s / fp32.load.queries_per_s
                drecall = 100 * (q8.load.recall3 - fp32.load.recall3)
                q8.target = ">= 1.8x fp32 q/s, recall@3 within 1 pt"
                q8.met = speedup >= 1.8 and abs(drecall) <= 1.0 and not q8.load.errors
                notes.append(f"dense {size}: int8 / fp32 server throughput = {speedup:.2f}x, recall@3 "
                             f"difference {drecall:+.1f} points"
                             + (f"; raw encoder int8 / fp32 = {q8.ceiling / fp32.ceiling:.2f}x" if args.ceiling else ""))
    if args.ceiling and any(r.ceiling and r.index == "bm25" for r in rows):
        notes.append("BM25 ceiling: the server's BM25Searcher.search in the benchmark process, no HTTP, one "
                     "thread, batches of the server's mean batch size")
    if args.ceiling and any(r.ceiling and r.index == "dense" for r in rows):
        notes.append(f"encoder ceiling: the server's QueryEncoder without HTTP or faiss, batch {enc_batch}, "
                     f"{args.encoder_threads} torch threads, same questions")
    notes.append("recall@3: share of single-hop (synth_nq) questions with a gold passage among the top 3 hits; "
                 "latency is per request of B queries")
    notes.append(f"command: python bench/retriever_load.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
                 + f" (total {time.time() - t_all:.0f} s)")
    table = render_table(rows, args, notes)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(f"[bench] table written to {args.out}", file=sys.stderr)
    return 0 if all(r.met is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
