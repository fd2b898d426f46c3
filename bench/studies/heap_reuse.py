"""A GRPO step's phases in a trainer worker that reuses freed memory within a pass
(`trainer.reuse_freed_memory=true`) against glibc's default (a benchmark, not a test).

    python bench/studies/heap_reuse.py                      # the demo's shape, bf16
    python bench/studies/heap_reuse.py --dtype float32 --rounds 3

glibc gives each allocation above 32 MiB its own mmap and unmaps it on free, so every micro-batch's
logits and the tied embedding's gradient arrive as fresh pages the kernel must fault in and zero.
`WorkerSpec.reuse_freed_memory` (`trainer.reuse_freed_memory`) turns that off, so a pass reuses what
its last micro-batch freed; both settings still return freed memory to the OS after each rollout and
update (`release_memory`). glibc's settings cannot be switched back within a process, so each round
runs one child process per setting, alternating (default, reuse, default, reuse, ...): machine drift
hits both.

Each child builds a PolicyWorker (SmolLM2-135M-Instruct, `--threads` torch threads) and times, after
one warm-up step, `--steps` steps of the worker's three phases as the trainer calls them:
    sample   generate_sequences: `--groups` x `--n` rows, random ~`--prompt-len`-token prompts,
             `--max-tokens` new tokens at temperature 1 (fixed seed: both settings sample the same)
    ref      compute_ref_log_prob over a batch of the demo's shape (bench/studies/shared_prompt_forward.py)
    update   update_actor over it (one mini-batch, micro-batch `--micro-batch-size`)
and prints per phase the median wall seconds, system CPU seconds and minor page faults, the default /
reuse ratio of the medians over all rounds, and each process's peak RSS. Samples, reference log-probs
and updated weights must match to the bit in every step and setting (checked and printed; exit 1 if
not). Run it on an idle machine and write the CPU kind beside the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="compute and sampling dtype (default bfloat16, `auto`'s pick on AVX512-BF16/AMX CPUs)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--groups", type=int, default=2, help="prompts per step (default 2, the demo's)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--prompt-len", type=int, default=145, help="prompt tokens (default 145, the demo's)")
    p.add_argument("--response-len", type=int, default=240,
                   help="response tokens of the ref/update batch (default 240, the demo's)")
    p.add_argument("--max-tokens", type=int, default=120,
                   help="tokens sampled per row (default 120: a demo turn is up to 40-120 tokens)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="rows per forward (default 2, the demo's)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per child process (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="pairs of child processes (default 2)")
    p.add_argument("--child", choices=["default", "reuse"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_stime, r.ru_minflt


def child(args) -> dict:
    """One setting in this process: per-phase [wall s, sys s, faults] for each timed step."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rollout_mismatch import local_worker
    from shared_prompt_forward import sample_request, update_batch
    from search_r1.trainer.workers import WorkerSpec

    # reuse_freed_memory: what trainer.reuse_freed_memory=true gives every trainer worker
    w = local_worker(WorkerSpec(model_name=args.model, compute_dtype=args.dtype, rollout_dtype=args.dtype,
                                threads=args.threads, micro_batch_size=args.micro_batch_size,
                                entropy_coef=0.0, gen_batch_size=args.groups * args.n,
                                reuse_freed_memory=args.child == "reuse"))
    gen = sample_request(args.groups, args.n, args.prompt_len, args.max_tokens)
    batch = update_batch(w, args.groups, args.n, args.prompt_len, args.response_len)
    batch.meta_info.update(n_mini_batches=1, old_is_current=True)
    state = {k: v.clone() for k, v in w.model.state_dict().items()}
    opt_state = w.optimizer.state_dict()

    def phases():
        out = {"checksum": []}
        for name, fn in (("sample", lambda: w.generate_sequences(gen)),
                         ("ref", lambda: w.compute_ref_log_prob(batch)),
                         ("update", lambda: w.update_actor(batch))):
            t0, s0, f0 = _usage()
            res = fn()
            t1, s1, f1 = _usage()
            out[name] = [t1 - t0, s1 - s0, f1 - f0]
            if name == "sample":
                out["checksum"].append(sum(sum(ids) for ids in res.non_tensor_batch["token_ids"]))
            if name == "update":
                out["checksum"].append(sum(float(p.double().sum()) for p in w.model.parameters()))
            if name == "ref":
                batch.batch["ref_log_prob"] = res.batch["ref_log_prob"]
                out["checksum"].append(float(res.batch["ref_log_prob"].double().sum()))
        out["checksum"] = tuple(out["checksum"])
        return out

    phases()  # warm-up: first-touch costs, lazily built generator
    steps = []
    for _ in range(args.steps):
        w.model.load_state_dict(state)  # every step updates the same weights: same work, same numbers
        w.optimizer.load_state_dict(opt_state)
        steps.append(phases())
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    return {"steps": steps, "peak_gib": peak_gib}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    import torch
    print(f"[heap_reuse] {args.model} {args.dtype}, {args.threads} threads, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.groups} prompts x {args.n}, prompt {args.prompt_len}, "
          f"sample {args.max_tokens} tokens, ref/update responses ~{args.response_len}, micro-batch "
          f"{args.micro_batch_size}; {args.rounds} rounds x {args.steps} steps", flush=True)
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = {"default": [], "reuse": []}
    peaks = {"default": [], "reuse": []}
    checks = set()
    for r in range(args.rounds):
        for mode in ("default", "reuse"):
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--child", mode], capture_output=True,
                                  text=True, cwd=ROOT)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                return proc.returncode
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode] += res["steps"]
            peaks[mode].append(res["peak_gib"])
            checks |= {tuple(s["checksum"]) for s in res["steps"]}
            for i, s in enumerate(res["steps"]):
                print(f"round {r} {mode:>7} step {i}: " + "  ".join(
                    f"{p} {s[p][0]:.2f} s (sys {s[p][1]:.2f}, {s[p][2] / 1e3:.0f}k faults)" for p in PHASES), flush=True)
    print(f"{'phase':>7} {'default s':>9} {'sys':>6} {'faults':>8} {'reuse s':>8} {'sys':>6} {'faults':>8} {'ratio':>6}")
    for p in PHASES:
        d = [statistics.median(s[p][k] for s in results["default"]) for k in range(3)]
        u = [statistics.median(s[p][k] for s in results["reuse"]) for k in range(3)]
        print(f"{p:>7} {d[0]:>9.2f} {d[1]:>6.2f} {d[2] / 1e3:>7.0f}k {u[0]:>8.2f} {u[1]:>6.2f} {u[2] / 1e3:>7.0f}k "
              f"{d[0] / u[0]:>5.2f}x")
    print(f"peak RSS of the process (GiB): default {', '.join(f'{x:.2f}' for x in peaks['default'])}; "
          f"reuse {', '.join(f'{x:.2f}' for x in peaks['reuse'])}")
    print(f"same samples, reference log-probs and updated weights in every step and setting: {len(checks) == 1}")
    return 0 if len(checks) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
