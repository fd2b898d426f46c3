"""The worker's log-prob and update passes with `algos.token_log_probs` (a fused log-prob backward and
an entropy report that reuses its logsumexp) against the autograd graph it replaced (a benchmark, not
a test).

    python bench/studies/token_log_probs.py                      # the demo's shape, bf16
    python bench/studies/token_log_probs.py --dtype float32 --repeats 5

Before: logp = z.gather(target) - logsumexp(z), differentiated by autograd, whose backward builds five
(m, r, V) temporaries (z - lse, its exp, the product with the gradient, the gather's zero-filled scatter,
their sum); and an entropy report (entropy_coef 0) that computed a softmax and a logsumexp of its own
per row. After: one in-place (m, r, V) tensor in the backward, and the report reuses the forward's
logsumexp. V is 49,152 for SmolLM2, so these are the largest tensors of a pass.

One PolicyWorker (SmolLM2-135M-Instruct, in this process, `--threads` torch threads) and one batch of
the demo's shape (bench/studies/shared_prompt_forward.py's `update_batch`); each repeat times, for the old path
(patched back into the worker module) and the new one, alternating:
    ref     compute_ref_log_prob over the batch (no grad: the forward's logsumexp only)
    update  update_actor over it (one mini-batch; the optimizer's state and the weights are restored
            before every update, so each does the same work)
and prints the medians and old / new ratios, then checks that the two paths give the same reference
log-probs and the same updated weights to the bit (exit 1 if not) and prints the largest difference of
the reported entropy (a metric: both forms round differently). Run it on an idle machine and write
the CPU kind beside the figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "studies"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="compute dtype of the passes (default bfloat16, `auto`'s pick on AVX512-BF16/AMX CPUs)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--groups", type=int, default=2, help="prompts in the batch (default 2, the demo's)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--prompt-len", type=int, default=145, help="prompt tokens (default 145, the demo's)")
    p.add_argument("--response-len", type=int, default=240, help="response tokens (default 240, the demo's)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="rows per forward (default 2, the demo's)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path, median reported (default 3)")
    return p.parse_args(argv)


def old_token_log_probs(logits, targets):
    """The worker's log-prob before `algos.token_log_probs`: autograd through gather - logsumexp."""
    import torch

    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse.detach()


def old_entropy(logits, lse=None):
    """The entropy report before: softmax and logsumexp computed again (`lse` ignored)."""
    from search_r1.algos import entropy_from_logits

    return entropy_from_logits(logits)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import search_r1.trainer.workers as W
    from rollout_mismatch import local_worker
    from shared_prompt_forward import update_batch

    paths = {"old": (old_token_log_probs, old_entropy), "new": (W.token_log_probs, W.entropy_from_logits)}
    print(f"[token_log_probs] {args.model} {args.dtype}, {args.threads} threads, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.groups} prompts x {args.n}, prompt {args.prompt_len}, "
          f"responses ~{args.response_len}, micro-batch {args.micro_batch_size}; {args.repeats} repeats", flush=True)
    w = local_worker(W.WorkerSpec(model_name=args.model, compute_dtype=args.dtype, rollout_dtype=args.dtype,
                                  threads=args.threads, micro_batch_size=args.micro_batch_size, entropy_coef=0.0))
    batch = update_batch(w, args.groups, args.n, args.prompt_len, args.response_len)
    batch.meta_info.update(n_mini_batches=1, old_is_current=True)
    state = {k: v.clone() for k, v in w.model.state_dict().items()}
    opt_state = w.optimizer.state_dict()

    times = {p: {"ref": [], "update": []} for p in paths}
    results = {}
    for rep in range(args.repeats + 1):  # repeat 0 warms up (first-touch costs), not timed
        for name, (logp_fn, ent_fn) in paths.items():
            W.token_log_probs, W.entropy_from_logits = logp_fn, ent_fn
            t0 = time.perf_counter()
            ref = w.compute_ref_log_prob(batch).batch["ref_log_prob"]
            t1 = time.perf_counter()
            w.model.load_state_dict(state)
            w.optimizer.load_state_dict(opt_state)
            t2 = time.perf_counter()
            metrics = w.update_actor(batch)
            t3 = time.perf_counter()
            if rep:
                times[name]["ref"].append(t1 - t0)
                times[name]["update"].append(t3 - t2)
                print(f"repeat {rep} {name}: ref {t1 - t0:.2f} s  update {t3 - t2:.2f} s", flush=True)
            results[name] = (ref, {k: v.clone() for k, v in w.model.state_dict().items()}, metrics["actor/entropy"])
    W.token_log_probs, W.entropy_from_logits = paths["new"]

    print(f"{'phase':>7} {'old s':>7} {'new s':>7} {'old/new':>8}")
    for phase in ("ref", "update"):
        o, n = statistics.median(times["old"][phase]), statistics.median(times["new"][phase])
        print(f"{phase:>7} {o:>7.2f} {n:>7.2f} {o / n:>7.2f}x")
    (ref_o, w_o, ent_o), (ref_n, w_n, ent_n) = results["old"], results["new"]
    same = torch.equal(ref_o, ref_n) and all(torch.equal(w_o[k], w_n[k]) for k in w_o)
    print(f"same reference log-probs and updated weights to the bit: {same}")
    print(f"reported entropy: old {ent_o:.6f}, new {ent_n:.6f} (difference {abs(ent_o - ent_n):.2e})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
