"""How a trainer worker's idle OpenMP threads wait (`trainer.omp_spincount`), on an idle machine and
beside one busy process (a benchmark, not a test).

    python bench/studies/omp_wait.py                                  # the demo's shape, bf16
    python bench/studies/omp_wait.py --spincounts 1000 10000 --repeats 1

Between two parallel regions (thousands per forward pass) torch's OpenMP threads (GNU libgomp) spin
or sleep. libgomp reads its settings once, at start, so each setting runs in its own child process,
with the environment `search_r1.trainer.workers.worker_env` gives a worker actor:
    passive     OMP_WAIT_POLICY=PASSIVE (trainer.omp_spincount=0): sleep at once
    spin        neither variable: libgomp's default spinning
    spin=N      GOMP_SPINCOUNT=N (trainer.omp_spincount=N; 10000 is the default): spin N times, then sleep
Each child builds a PolicyWorker (SmolLM2-135M-Instruct, `--threads` torch threads, bf16) and times,
after a warm-up, the best of `--repeats` runs of: sample (generate_sequences, `--groups` x `--n` rows,
~145-token prompts, `--max-tokens` tokens), ref (compute_ref_log_prob) and update (update_actor) on a
demo-shaped batch (bench/studies/shared_prompt_forward.py's `update_batch`). Each setting runs idle, then with
one busy Python process (`while True: pass`) beside it, the machine shared as when other work runs.
Prints seconds per phase and each setting's time over passive's. Run it on an otherwise idle machine
and write the CPU kind beside the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "studies"))
PHASES = ("sample", "ref", "update")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="compute and sampling dtype")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--groups", type=int, default=2, help="prompts (default 2, the demo's)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--max-tokens", type=int, default=60, help="tokens sampled per row (default 60)")
    p.add_argument("--spincounts", type=int, nargs="*", default=[10000],
                   help="GOMP_SPINCOUNT values to run besides passive and spin (default 10000)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per phase, best reported (default 2)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rollout_mismatch import local_worker
    from shared_prompt_forward import sample_request, update_batch
    from search_r1.trainer.workers import WorkerSpec

    w = local_worker(WorkerSpec(model_name=args.model, compute_dtype=args.dtype, rollout_dtype=args.dtype,
                                threads=args.threads, micro_batch_size=2, entropy_coef=0.0,
                                gen_batch_size=args.groups * args.n))
    gen = sample_request(args.groups, args.n, 145, args.max_tokens)
    batch = update_batch(w, args.groups, args.n, 145, 240)
    batch.meta_info.update(n_mini_batches=1, old_is_current=True)
    fns = {"sample": lambda: w.generate_sequences(gen), "ref": lambda: w.compute_ref_log_prob(batch),
           "update": lambda: w.update_actor(batch)}
    fns["sample"]()  # warm-up: first-touch costs, the lazily built generator
    out = {}
    for name in PHASES:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fns[name]()
            times.append(time.perf_counter() - t0)
        out[name] = min(times)
    return out


def settings(spincounts: list[int]) -> dict[str, dict[str, str]]:
    """name -> the wait variables of a child; the others are removed from its environment."""
    from search_r1.trainer.workers import WorkerSpec, worker_env

    waits = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    out = {"passive": {k: v for k, v in worker_env(WorkerSpec(model_name="", omp_spincount=0)).items()
                       if k in waits},
           "spin": {}}
    for n in spincounts:
        out[f"spin={n}"] = {k: v for k, v in worker_env(WorkerSpec(model_name="", omp_spincount=n)).items()
                            if k in waits}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    import torch
    print(f"[omp_wait] {args.model} {args.dtype}, {args.threads} threads, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs; {args.groups} prompts x {args.n}, "
          f"{args.max_tokens} sampled tokens, ref/update on ~240-token responses; best of {args.repeats}", flush=True)
    passthrough = list(argv if argv is not None else sys.argv[1:])
    results: dict[tuple[str, str], dict] = {}
    for load in ("idle", "busy"):
        busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None)
        try:
            for name, wait_env in settings(args.spincounts).items():
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                env.update(wait_env, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
                proc = subprocess.run([sys.executable, __file__, *passthrough, "--child"], capture_output=True,
                                      text=True, cwd=ROOT, env=env)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr[-4000:])
                    return proc.returncode
                results[(load, name)] = json.loads(proc.stdout.strip().splitlines()[-1])
                r = results[(load, name)]
                print(f"{load:>5} {name:>12}: " + "  ".join(f"{p} {r[p]:.2f} s" for p in PHASES), flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    print(f"{'load':>5} {'setting':>12} " + " ".join(f"{p + ' / passive':>18}" for p in PHASES))
    for (load, name), r in results.items():
        base = results[(load, "passive")]
        print(f"{load:>5} {name:>12} " + " ".join(f"{r[p] / base[p]:>17.2f}x" for p in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
