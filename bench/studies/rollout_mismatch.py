"""How far the sampler's log-probs are from the trainer's, with the bf16 rollout copy built two ways.

The trainer samples with a bf16 copy of the policy (`model.rollout_dtype=bfloat16`) and trains on
fp32 log-probs of the same tokens. This script runs the trainer's own worker (`PolicyWorker`,
in-process) on the demo's prompts (the default synthetic world's test split, Search-R1 template),
samples `--n` rollouts of `--tokens` tokens at temperature 1, recomputes the old log-probs, and
prints the metrics `update_actor` logs every step (`training/rollout_log_probs_diff_*`,
`rollout_corr/rollout_is_seq_*`) for

  - now:    parameters cast to bf16, buffers (rotary inv_freq) kept fp32 (`workers.rollout_copy`)
  - before: `copy.deepcopy(model).to(torch.bfloat16)`, which also cast inv_freq
  - fp32:   the policy itself samples (the floor: KV-cache vs full-sequence kernels)

    python bench/studies/rollout_mismatch.py                       # SmolLM2, 16 rollouts x 64 tokens
    python bench/studies/rollout_mismatch.py --compute-dtype bfloat16   # as the demo (bf16 autocast log-probs)
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from verl import DataProto  # noqa: E402

from search_r1.algos import rollout_mismatch_sums  # noqa: E402


def rollout_batch(w, prompts: list[list[int]], tokens: int, seed: int) -> DataProto:
    arr = np.empty(len(prompts), dtype=object)
    arr[:] = [list(p) for p in prompts]
    req = DataProto.from_dict(non_tensors={"prompt_ids": arr}, meta_info={"sampling": dict(
        max_tokens=tokens, temperature=1.0, top_p=1.0, top_k=-1, stop=(), seed=seed)})
    out = w.generate_sequences(req).non_tensor_batch
    P, R, n = max(map(len, prompts)), max(len(t) for t in out["token_ids"]), len(prompts)
    ids = torch.zeros(n, P + R, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    rollout = torch.zeros(n, R)
    for i, (p, t, lp) in enumerate(zip(prompts, out["token_ids"], out["logprobs"])):
        ids[i, P - len(p):P], ids[i, P:P + len(t)] = torch.tensor(p), torch.tensor(t)
        attn[i, P - len(p):P + len(t)] = 1
        rollout[i, :len(lp)] = torch.tensor(lp)
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": attn, "responses": ids[:, P:],
                                 "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
                                 "response_mask": attn[:, P:].clone(), "rollout_log_probs": rollout})
    batch.batch["old_log_probs"] = w.compute_log_prob(batch).batch["old_log_probs"]
    return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF directory")
    p.add_argument("--n", type=int, default=16, help="rollouts (default 16)")
    p.add_argument("--tokens", type=int, default=64, help="sampled tokens per rollout (default 64)")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="precision of the old log-prob pass (default float32; the demo uses bfloat16)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from search_r1.data.dataset import PromptDataset
    from search_r1.data.synth import ensure_world
    from search_r1.models import load_tokenizer
    from search_r1.paths import default_synth_dir
    from search_r1.trainer.workers import WorkerSpec, in_process_worker, rollout_copy

    world = ensure_world(default_synth_dir(), progress=False)
    ds = PromptDataset([Path(world) / "test.parquet"], load_tokenizer(args.model), max_prompt_length=4096)
    prompts = [list(r.input_ids) for r in ds.records[:args.n]]
    w = in_process_worker(WorkerSpec(model_name=args.model, compute_dtype=args.compute_dtype, rollout_dtype="bfloat16",
                                          threads=args.threads, micro_batch_size=4, use_ref=False, kl_coef=0.0))
    variants = {"now (params bf16, rotary fp32)": rollout_copy(w.model, torch.bfloat16),
                "before (.to(bfloat16), rotary bf16)": copy.deepcopy(w.model).to(torch.bfloat16).requires_grad_(False),
                "fp32 sampler (floor)": w.model}
    print(f"{args.model}: {len(prompts)} rollouts x {args.tokens} tokens, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, old log-probs in {args.compute_dtype}")
    print(f"{'sampler':<38} {'|dlogp| mean':>12} {'|dlogp| max':>12} {'seq ratio mean':>15} {'seq ratio max':>14}")
    for name, model in variants.items():
        w.rollout_model, w.generator = model, None  # the worker rebuilds its generator on the new copy
        batch = rollout_batch(w, prompts, args.tokens, args.seed)
        s = rollout_mismatch_sums(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
                                  batch.batch["response_mask"])
        print(f"{name:<38} {s['logp_diff_sum'] / s['tokens']:>12.4f} {s['logp_diff_max']:>12.4f} "
              f"{s['seq_ratio_sum'] / s['sequences']:>15.3f} {s['seq_ratio_max']:>14.3f}", flush=True)


if __name__ == "__main__":
    main()
