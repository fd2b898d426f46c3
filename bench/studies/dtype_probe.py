"""Is bf16 faster than fp32 on this CPU, per role? What `auto` measures, repeated, beside a real decode
(a benchmark, not a test).

    python bench/studies/dtype_probe.py                  # 4 repeats of each timing `auto` could use
    python bench/studies/dtype_probe.py --decode         # also a real SmolLM2 greedy decode in both dtypes

Per repeat, the bf16 speed-up (fp32 time / bf16 time, best of the timing's own repeats, the dtypes
alternating) of:
  single layer   Linear(576 -> 1536) on 8 rows, the rollout shape `auto` timed before cache version 2:
                 it stays in cache, so it measures arithmetic only
  150 layers     what `auto` times for the rollout role now (search_r1.dtypes.SHAPES["rollout"]):
                 135M distinct weights on 8 rows, read from memory as one decoding step reads them
  training       Linear(576 -> 1536) on 512 rows, the compute role
--decode: SmolLM2-135M, batch 8, 300-token random prompts, 64 new tokens, greedy, best of 3.
A decision that flips between repeats is one two fresh homes on this machine can disagree on.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=4, help="how many times to repeat each timing")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--decode", action="store_true", help="also time a real SmolLM2 decode in both dtypes")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from search_r1 import dtypes

    torch.set_num_threads(args.threads)
    print(f"machine: {dtypes.machine_description()}; {args.threads} threads; margin {dtypes.BF16_MARGIN}x")
    rows, layers = dtypes.SHAPES["rollout"]
    for i in range(args.repeats):
        single = dtypes._time_linear(rows, 1, repeats=20)
        stack = dtypes._time_linear(rows, layers)
        train = dtypes._time_linear(*dtypes.SHAPES["compute"])
        print(f"repeat {i}: bf16 speed-up  single layer {single['fp32'] / single['bf16']:.2f}x | "
              f"{layers} layers {stack['fp32'] / stack['bf16']:.2f}x ({stack['fp32'] * 1e3:.1f} ms fp32, "
              f"{stack['bf16'] * 1e3:.1f} ms bf16) | training {train['fp32'] / train['bf16']:.2f}x", flush=True)
    if args.decode:
        from search_r1.models import load_model_and_tokenizer

        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            model, _ = load_model_and_tokenizer("smollm2-135m-instruct", dtype=dtype)
            ids = torch.randint(100, 1000, (8, 300), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
                    best = min(best, time.perf_counter() - t0)
            seconds[dtype] = best
            print(f"decode {dtype}: batch 8, 300-token prompts, 64 new tokens: {best:.2f} s", flush=True)
        print(f"decode bf16 speed-up: {seconds[torch.float32] / seconds[torch.bfloat16]:.2f}x")


if __name__ == "__main__":
    main()
