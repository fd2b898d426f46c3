"""The worker's log-prob and update passes with each GRPO group's prompt run once, against one full
forward per row (a benchmark, not a test).

    python bench/studies/shared_prompt_forward.py                          # the demo's shape, fp32
    python bench/studies/shared_prompt_forward.py --dtype bfloat16 --micro-batch-sizes 2 4 8
    python bench/studies/shared_prompt_forward.py --groups 8 --prompt-len 210 --response-len 420   # the experiment's

A PolicyWorker (SmolLM2-135M-Instruct, in this process, `--threads` torch threads) scores a batch
shaped like a GRPO step: `--groups` prompts x `--n` samples, rows of one group sharing a left-padded
prompt of about `--prompt-len` tokens, responses of about `--response-len` tokens (right-padded,
lengths spread +-15%). Token ids are random: the cost of a forward does not depend on them.

For each micro-batch size it times, shared (the default path) and unshared (every row its own
prompt, as before), the median of `--repeats` runs of:
    ref     compute_ref_log_prob over the batch (no grad)
    update  accumulate_grads over the batch (forward + backward; no optimizer step), in one autocast
            context as update_actor runs it
    /call   (bf16 only) the same two with an autocast context per micro-batch, as before 2026-12-03:
            autocast caches a weight's bf16 cast only inside one open context, and never for frozen
            weights, so the policy's were cast again for every micro-batch and the reference's at
            every forward call
and prints seconds, the ratios unshared / shared (and /call over the default), and the largest log-prob
difference between the two paths (float rounding only). Run it on an idle machine and write the CPU kind beside the figures.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--groups", type=int, default=2, help="distinct prompts in the batch (default 2, the demo's)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--prompt-len", type=int, default=200,
                   help="prompt tokens (default 200; the demo's Search-R1 prompts are 140-146)")
    p.add_argument("--response-len", type=int, default=230,
                   help="mean response tokens incl. observations (default 230, the demo's)")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[2, 4],
                   help="rows per forward/backward (default 2 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting, median reported (default 3)")
    return p.parse_args(argv)


def make_batch(groups: int, n: int, prompt_len: int, response_len: int, seed: int = 0):
    import torch
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    p_lens = [prompt_len + int(d) for d in torch.randint(-8, 9, (groups,), generator=g)]
    r_lens = [max(8, int(response_len * (0.85 + 0.3 * float(u)))) for u in torch.rand(groups * n, generator=g)]
    P, R = max(p_lens), max(r_lens)
    ids = torch.zeros(groups * n, P + R, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for k in range(groups):
        prompt = torch.randint(3, 40000, (p_lens[k],), generator=g)
        for j in range(n):
            row = k * n + j  # interleaved as repeat_interleave lays out a GRPO batch
            ids[row, P - p_lens[k]:P] = prompt
            ids[row, P:P + r_lens[row]] = torch.randint(3, 40000, (r_lens[row],), generator=g)
            attn[row, P - p_lens[k]:P + r_lens[row]] = 1
    pos = torch.clip(attn.cumsum(-1) - 1, min=0)
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": pos,
                                 "responses": ids[:, P:], "response_mask": attn[:, P:].clone()})
    return batch


def sample_request(groups: int, n: int, prompt_len: int, max_tokens: int, seed: int = 1):
    """A generate_sequences request shaped like a GRPO step's: `groups` random prompts of `prompt_len`
    tokens, the list repeated `n` times, sampled at temperature 1 with a fixed sampling seed."""
    import numpy as np
    import torch
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    prompts = np.empty(groups * n, dtype=object)  # an object array of lists, not a 2-D int array
    prompts[:] = [torch.randint(3, 40000, (prompt_len,), generator=g).tolist() for _ in range(groups)] * n
    return DataProto.from_dict(non_tensors={"prompt_ids": prompts}, meta_info={"sampling": {
        "max_tokens": max_tokens, "temperature": 1.0, "seed": 7}})


def update_batch(w, groups: int, n: int, prompt_len: int, response_len: int):
    """`make_batch` with what update_actor reads: old, reference and rollout log-probs (all the worker's
    current log-probs) and advantages of alternating sign."""
    import torch

    batch = make_batch(groups, n, prompt_len, response_len)
    batch.batch["old_log_probs"] = w.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["ref_log_prob"] = batch.batch["old_log_probs"].clone()
    batch.batch["rollout_log_probs"] = batch.batch["old_log_probs"].clone()
    adv = torch.tensor([(-1.0) ** i for i in range(len(batch))])
    batch.batch["advantages"] = adv[:, None] * batch.batch["response_mask"]
    return batch


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", WG_BACKEND="ray")
    from retriever_server.launcher import free_port
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import dataclasses

    import torch

    from search_r1.trainer import workers
    from search_r1.trainer.workers import PolicyWorker, WorkerSpec

    spec = WorkerSpec(model_name=args.model, compute_dtype=args.dtype, threads=args.threads)
    w = PolicyWorker(spec)
    w.init_model()
    batch = update_batch(w, args.groups, args.n, args.prompt_len, args.response_len)
    norm = float(batch.batch["response_mask"].sum())
    real_shared = workers.shared_prompt_rows

    def unshared(ids, attn, pos):
        return torch.arange(len(ids)), torch.arange(len(ids))  # every row its own prompt

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def cast_per_call(fn):
        def run():
            w._weights_cast_once = lambda model: contextlib.nullcontext()  # an instance attribute hides the method
            try:
                fn()
            finally:
                del w._weights_cast_once
        return run

    bf16 = args.dtype == "bfloat16"

    def update():
        w.optimizer.zero_grad(set_to_none=False)
        with w._weights_cast_once(w.model):
            w.accumulate_grads(batch, norm)

    def ref():
        w.compute_ref_log_prob(batch)

    print(f"[shared_prompt_forward] {args.model} {args.dtype}, {args.threads} threads, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; batch {args.groups} prompts x {args.n}, "
          f"prompt ~{args.prompt_len} tokens, response ~{args.response_len}; median of {args.repeats}")
    print(f"{'micro':>5} {'path':>9} {'ref s':>7} {'/call':>6} {'update s':>9} {'/call':>6}")
    for micro in args.micro_batch_sizes:
        w.spec = dataclasses.replace(spec, micro_batch_size=micro)
        results = {}
        for name, fn in (("shared", real_shared), ("unshared", unshared)):
            workers.shared_prompt_rows = fn
            try:
                logp = w.compute_ref_log_prob(batch).batch["ref_log_prob"]
                results[name] = (timed(ref), timed(update), logp)
                ref_call = timed(cast_per_call(ref)) if bf16 else float("nan")
                update_call = timed(cast_per_call(update)) if bf16 else float("nan")
            finally:
                workers.shared_prompt_rows = real_shared
            ref_s, update_s, _ = results[name]
            print(f"{micro:>5} {name:>9} {ref_s:>7.2f} {ref_call / ref_s:>5.2f}x {update_s:>9.2f} "
                  f"{update_call / update_s:>5.2f}x", flush=True)
        (rs, us, ls), (ru, uu, lu) = results["shared"], results["unshared"]
        print(f"{micro:>5} {'ratio':>9} {ru / rs:>6.2f}x {'':>6} {uu / us:>8.2f}x {'':>6}   unshared/shared; "
              f"max |logp diff| {float((ls - lu).abs().max()):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
