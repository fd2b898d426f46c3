"""What LLDS adds to a policy update: the trainer's own update with and without the LLDS term, timed in one
process on batches of the same shape (issue 69's target: under 5% of a step's update).

    python bench/llds_cost.py                                  # SmolLM2, float32, 8 x 384 tokens
    python bench/llds_cost.py --compute-dtype bfloat16 --repeats 6

Runs the trainer's `PolicyWorker` in-process (rank 0 of 1, `--threads` torch threads) on a batch shaped
like the stress recipe's (`--rows` trajectories of `--prompt` prompt and `--response` response tokens,
a quarter of the response masked as retrieved passages, advantages of both signs), with two
mini-batches per update so that pi_theta has moved from pi_old in the second (where LLDS's gate can
open). The `update_actor` calls alternate between llds_coef 0 and `--llds-coef` (so a slow spell of the
machine hits both arms alike); each arm's median is reported, with the ratio, and the share of tokens
and responses the gate opened on. The update (forward, backward and AdamW over the mini-batches) is
the phase LLDS changes; rollout, old and reference log-probs are untouched by it. Each update gets a
new batch (built untimed, its old log-probs from the current policy), as training brings.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF directory (default SmolLM2)")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the update's precision (model.compute_dtype; default float32, the stress recipe's)")
    p.add_argument("--rows", type=int, default=8, help="trajectories in the batch (default 8)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per trajectory (default 128)")
    p.add_argument("--response", type=int, default=384, help="response tokens per trajectory (default 384, "
                   "the stress recipe's rollout.max_response_length)")
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per update (default 2)")
    p.add_argument("--micro-batch", type=int, default=4, help="trajectories per forward/backward (default 4)")
    p.add_argument("--llds-coef", type=float, default=0.1, help="the LLDS arm's algorithm.llds_coef (default 0.1)")
    p.add_argument("--gate", default="action", choices=["action", "response"], help="algorithm.llds_gate")
    p.add_argument("--repeats", type=int, default=6, help="updates per arm, alternating (default 6; the first "
                   "pair is a warm-up and not counted)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch (default 0)")
    return p.parse_args(argv)


def synthetic_batch(worker, rows: int, prompt: int, response: int, vocab: int, seed: int):
    """A batch in update_actor's layout: random tokens, a response mask with a retrieved-passage span
    in the middle of each response (mask 0, as `info_mask` leaves it), old and reference log-probs from
    the worker itself, advantages +1 for half the rows and -1 for the rest."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab, (rows, prompt + response), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.ones(rows, response, dtype=torch.long)
    mask[:, response // 3: response // 3 + response // 4] = 0  # an observation: never trained on
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": attn, "responses": ids[:, prompt:],
                                 "position_ids": torch.arange(prompt + response).expand(rows, -1).clone(),
                                 "response_mask": mask})
    old = worker.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["old_log_probs"] = old
    batch.batch["rollout_log_probs"] = old.clone()
    batch.batch["ref_log_prob"] = old.clone()
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)])
    batch.batch["advantages"] = sign[:, None] * mask.float()
    return batch


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from search_r1.dtypes import machine_description
    from search_r1.trainer.workers import WorkerSpec, in_process_worker

    spec = WorkerSpec(model_name=args.model, compute_dtype=args.compute_dtype, threads=args.threads,
                      micro_batch_size=args.micro_batch, lr=1e-5, llds_gate=args.gate)
    worker = in_process_worker(spec)
    vocab = worker.model.config.vocab_size
    seconds: dict[float, list[float]] = {0.0: [], args.llds_coef: []}
    gate, calls = {}, 0
    for r in range(args.repeats):
        for coef in (0.0, args.llds_coef) if r % 2 == 0 else (args.llds_coef, 0.0):
            worker.spec = dataclasses.replace(worker.spec, llds_coef=coef)  # the spec is frozen
            # A new batch per update, as training brings (untimed): updates repeated on one batch keep
            # raising its advantage >= 0 rows' likelihood (AdamW's momentum), and the gate stays shut.
            batch = synthetic_batch(worker, args.rows, args.prompt, args.response, vocab, args.seed + calls)
            batch.meta_info["n_mini_batches"] = args.mini_batches
            calls += 1
            t0 = time.perf_counter()
            metrics = worker.update_actor(batch)
            if r > 0:
                seconds[coef].append(time.perf_counter() - t0)
            if coef > 0:
                gate = {k: metrics[k] for k in metrics if k.startswith("actor/llds_")}
    base, llds = statistics.median(seconds[0.0]), statistics.median(seconds[args.llds_coef])
    tokens = int(batch.batch["response_mask"].sum())
    print(f"machine: {machine_description()}; {args.model}, {args.compute_dtype}, {args.threads} threads")
    print(f"batch: {args.rows} x ({args.prompt} prompt + {args.response} response) tokens, {tokens} trained, "
          f"{args.mini_batches} mini-batches of micro-batch {args.micro_batch}; {args.repeats - 1} timed updates per arm")
    print(f"update without LLDS: median {base:.2f} s  ({', '.join(f'{s:.2f}' for s in seconds[0.0])})")
    print(f"update with LLDS (coef {args.llds_coef}, {args.gate} gate): median {llds:.2f} s  "
          f"({', '.join(f'{s:.2f}' for s in seconds[args.llds_coef])})")
    print(f"LLDS cost: {100 * (llds / base - 1):+.1f}% of the update; gate: "
          + ", ".join(f"{k.split('/')[-1]} {float(v):.3g}" for k, v in gate.items()))


if __name__ == "__main__":
    main()
