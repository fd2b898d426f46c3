"""Ray Serve sharded retriever vs the standalone server, on one machine, single-query clients.

    python bench/retriever_ray.py                       # dense MiniLM Flat at 10k, 2 shards, C = 8 and 50
    python bench/retriever_ray.py --clients 50 --shards 4 --duration 30

Both servers serve the same dense index (`bench/retriever_load.py`'s cached synthetic world and
MiniLM Flat index) and run side by side, idle when not loaded; each round loads one with C
concurrent clients that each send one query per request (B=1, the agent-loop pattern before
coalescing), then the other, so both see the same contention from other work on the machine.

- standalone: `python -m retriever_server serve --index IDX` (auto threads: one single-threaded
  encoder batch per core)
- Ray Serve: `python -m retriever_server serve --index IDX --ray --ray-address local --shards K
  --serve-proxy haproxy`: a local Ray cluster in the server process with HAProxy in front, the ingress (HTTP API, batcher,
  query encoder) and K shard deployments of one replica each. The server RSS column is the whole
  Ray process tree (GCS, raylet, controller, proxy, replicas).

Target (issue 18): the Ray Serve path keeps >= 0.8x the standalone q/s at 50 concurrent clients with
0 errors.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.retriever_load import (LoadResult, Server, _tree_cpu_s, load_questions,  # noqa: E402
                                  prepare_index, prepare_world, run_load)


def run_comparison(args) -> tuple[list[dict], list[str]]:
    import psutil

    world = prepare_world(args.cache_dir, args.size, args.seed)
    index = prepare_index(args.cache_dir, world, args.size, "dense", [])
    questions = load_questions(world, 5000)
    passages = int((world / ".bench_done").read_text())
    servers = {}
    try:
        servers["standalone"] = Server([index], [], args.cache_dir / "server_ray_bench_standalone.log",
                                       args.startup_timeout)
        servers["ray"] = Server([index], ["--ray", "--ray-address", "local", "--shards", str(args.shards),
                                          "--shard-cpus", "0.5", "--ingress-cpus", "1",
                                          "--serve-proxy", args.serve_proxy],
                                args.cache_dir / "server_ray_bench_serve.log", args.startup_timeout)
    except BaseException:  # a server that started must not outlive a failed start of the other
        for s in servers.values():
            s.process.stop(timeout=120)
        raise
    results = {(name, c): LoadResult() for name in servers for c in args.clients}
    idle_cpu = {name: 0.0 for name in servers}
    try:
        seg = args.duration / args.rounds
        for rnd in range(args.rounds):
            for c in args.clients:
                for name, server in servers.items():
                    others = {n: psutil.Process(s.proc.pid) for n, s in servers.items() if n != name}
                    other0 = {n: _tree_cpu_s(p) for n, p in others.items()}
                    me = psutil.Process(server.proc.pid)
                    cpu0 = _tree_cpu_s(me)
                    r = run_load(server.port, questions, 1, c, seg, args.warmup, offset=rnd * 7919)
                    r.server_cpu_s = _tree_cpu_s(me) - cpu0   # warm-up included, as r.warm_queries
                    results[(name, c)].add(r)
                    for n, p in others.items():   # what the idle server burns while the other is loaded
                        idle_cpu[n] += _tree_cpu_s(p) - other0[n]
                    print(f"[bench] round {rnd} {name} C={c}: {r.queries_per_s:,.0f} q/s, errors {r.errors}",
                          file=sys.stderr, flush=True)
        rss = {name: s.rss_mb() for name, s in servers.items()}
        health = {name: s.health() for name, s in servers.items()}
    finally:
        for s in servers.values():   # Ray: serve.shutdown and the local cluster take a while on 2 cores
            s.process.stop(timeout=120)
    rows = []
    for c in args.clients:
        base = results[("standalone", c)].queries_per_s
        for name in servers:
            ld = results[(name, c)]
            rows.append({"server": name, "clients": c, "qps": ld.queries_per_s, "p50": ld.latency_ms(50),
                         "p99": ld.latency_ms(99), "errors": ld.errors, "ratio": ld.queries_per_s / max(base, 1e-9),
                         "rss": rss[name], "first_error": ld.first_error,
                         "mean_batch": health[name].get("batching", {}).get("mean_batch_queries"),
                         "cpu_ms": 1e3 * ld.server_cpu_s / max(1, ld.queries + ld.warm_queries)})
    wall = args.duration * len(args.clients) + args.warmup * args.rounds * len(args.clients)
    notes = [f"dense MiniLM fp32 Flat over {passages:,} synthetic passages; B=1 query per request; "
             f"{args.duration:g} s measured per server and C in {args.rounds} interleaved rounds (+{args.warmup:g} s "
             "warm-up each); both servers up for the whole run",
             f"Ray Serve: {args.shards} shard deployment(s) x 1 replica, 1 ingress replica, "
             f"--serve-proxy {args.serve_proxy}; server CPU ms per query: CPU time of the whole server process "
             "tree (for Ray: GCS, raylet, controller, proxy, replicas) per answered query, which other work on "
             "the machine changes less than q/s; idle CPU of the "
             f"other server while one was loaded: standalone {100 * idle_cpu['standalone'] / wall:.0f}% of a core, "
             f"Ray {100 * idle_cpu['ray'] / wall:.0f}% of a core"]
    return rows, notes


def render(rows: list[dict], notes: list[str], args) -> str:
    head = ("| server | clients (B=1) | q/s | x standalone | p50 ms | p99 ms | errors | server CPU ms per query "
            "| mean server batch | RSS MB | target |")
    lines = [f"Retriever on Ray Serve vs standalone, {os.cpu_count()} CPU cores shared by servers and load "
             f"generator (1-min load average {os.getloadavg()[0]:.1f} at the end).", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        target = ""
        if r["server"] == "ray" and r["clients"] == max(args.clients):
            met = r["ratio"] >= 0.8 and r["errors"] == 0
            target = f">= 0.8x standalone, 0 errors: {'met' if met else 'not met'}"
        lines.append(f"| {'Ray Serve, %d shards' % args.shards if r['server'] == 'ray' else 'standalone'} "
                     f"| {r['clients']} | {r['qps']:,.0f} | {r['ratio']:.2f} | {r['p50']:.1f} | {r['p99']:.1f} "
                     f"| {r['errors']} | {r['cpu_ms']:.1f} | {r['mean_batch']} | {r['rss']:,.0f} | {target} |")
    errors = [f"{r['server']} C={r['clients']}: {r['first_error']}" for r in rows if r["first_error"]]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes + errors]) + "\n"


def parse_args(argv=None):
    from search_r1.paths import home
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="10k", choices=["10k", "100k"], help="corpus size of the dense index")
    p.add_argument("--clients", default="8,50", help="comma-separated concurrent single-query clients")
    p.add_argument("--shards", type=int, default=2, help="shard deployments of the Ray Serve server")
    p.add_argument("--serve-proxy", default="haproxy", choices=["haproxy", "python"],
                   help="`serve --serve-proxy` of the Ray Serve server")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per server and client count")
    p.add_argument("--rounds", type=int, default=3, help="interleaved segments per server and client count")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each segment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--cache-dir", type=Path, default=home() / "bench" / "retriever")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "retriever_ray.md")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows, notes = run_comparison(args)
    notes.append(f"command: python bench/retriever_ray.py {' '.join(sys.argv[1:] if argv is None else argv)} "
                 f"(total {time.time() - t0:.0f} s)")
    table = render(rows, notes, args)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
