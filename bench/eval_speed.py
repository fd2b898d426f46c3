"""Why does evaluating one model take longer per question than another? Separate the arithmetic from the
behaviour.

    python bench/eval_speed.py --models WARMSTART_DIR GRPO_RUN_DIR [--eval-dirs EVAL_A EVAL_B]

1. Arithmetic: every model decodes the SAME token stream (a batch of prompts, then a fixed sequence of
   forced tokens through the KV cache, as HFGenerator does), interleaved over several repeats, so
   machine load hits both alike. Equal ms per step means the weights are not slower to compute with
   (no denormals, no layout or dtype difference).
2. Behaviour (with --eval-dirs, the `python -m search_r1.evaluation` output directories of the same models on
   the same questions): HFGenerator's batch runs each generation round until its LONGEST row stops,
   so a round costs (its longest row's new tokens) decode steps, whatever the mean. From the recorded
   responses this reports, per model, the mean new tokens per policy turn and the decode steps the
   batches paid (sum over batches and rounds of the longest row), next to the measured seconds per
   question from results.json.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def forced_decode_ms(model, prompts, forced: list[int], pad_id: int) -> float:
    """ms per decode step of `model` on `prompts` (left-padded) followed by `forced` tokens for every row."""
    import torch
    from transformers import DynamicCache

    n, width = len(prompts), max(map(len, prompts))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        nxt = pos[:, -1] + 1
        t0 = time.perf_counter()
        for tok in forced:
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
            model(input_ids=torch.full((n, 1), tok), attention_mask=mask, position_ids=nxt[:, None],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = nxt + 1
        return (time.perf_counter() - t0) / len(forced) * 1e3


def policy_turn_lengths(tokenizer, response: str) -> list[int]:
    """Token counts of the policy's turns in a recorded response (observations removed)."""
    turns = [t for t in re.split(r"<information>.*?</information>|<tool_response>.*?</tool_response>", response,
                                 flags=re.DOTALL) if t.strip()]
    return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in turns]


def paid_steps(tokenizer, eval_dir: Path, batch_size: int) -> dict:
    """Decode steps the eval's batches paid vs the tokens they kept, from predictions.jsonl."""
    rows = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines() if line.strip()]
    lengths = [policy_turn_lengths(tokenizer, r["response"]) for r in rows]
    paid = kept = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start:start + batch_size]
        for rnd in range(max(map(len, batch))):
            per_row = [b[rnd] for b in batch if len(b) > rnd]
            paid += max(per_row)
            kept += sum(per_row)
    results = json.loads((eval_dir / "results.json").read_text())
    n = len(rows)
    return {"questions": n, "tokens_per_turn": statistics.fmean(x for b in lengths for x in b),
            "turns_per_question": statistics.fmean(map(len, lengths)), "kept_tokens_per_question": kept / n,
            "paid_steps_per_batch_question": paid / n, "seconds_per_question": results["timing"]["seconds"] / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", nargs="+", required=True, help="models (alias, HF dir, checkpoint or run dir)")
    p.add_argument("--eval-dirs", nargs="*", default=[], help="eval output dirs of the same models, same order")
    p.add_argument("--batch", type=int, default=32, help="rows per decode batch (default 32, the eval's)")
    p.add_argument("--steps", type=int, default=40, help="forced decode steps (default 40, one turn's cap)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats per model (default 5)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (default auto)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args()
    import torch

    from search_r1.dtypes import resolve_dtype
    from search_r1.evaluation.runner import resolve_model_dir
    from search_r1.models import load_model_and_tokenizer
    from search_r1.prompts import apply_chat_template, make_messages

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if resolve_dtype(args.dtype, "rollout", "--dtype") == "bfloat16" else torch.float32
    models = [load_model_and_tokenizer(resolve_model_dir(m), dtype=dtype) for m in args.models]
    tok = models[0][1]
    prompts = [apply_chat_template(tok, make_messages(f"Who founded company number {i} of the list?"))
               for i in range(args.batch)]
    forced = tok("<think> Look up the company. </think>\n<search> who founded it and when </search>",
                 add_special_tokens=False)["input_ids"] * 4
    forced = forced[:args.steps]
    times: list[list[float]] = [[] for _ in models]
    for _ in range(args.repeats):
        for i, (model, _) in enumerate(models):
            model.eval()
            times[i].append(forced_decode_ms(model, prompts, forced, tok.pad_token_id))
    print(f"## Same tokens, same batch ({args.batch} rows, {len(forced)} forced steps, {dtype}, "
          f"{args.threads} threads; median of {args.repeats} interleaved repeats)\n")
    print("| model | ms per decode step (median) | min | max |\n|---|---|---|---|")
    for name, ts in zip(args.models, times):
        print(f"| {name} | {statistics.median(ts):.1f} | {min(ts):.1f} | {max(ts):.1f} |")
    if args.eval_dirs:
        print("\n## What the eval batches paid (from predictions.jsonl; a round lasts as long as its longest row)\n")
        print("| eval | questions | turns / question | tokens / turn | kept tokens / q | paid decode steps / q | "
              "seconds / q |\n|---|---|---|---|---|---|---|")
        for d in args.eval_dirs:
            s = paid_steps(tok, Path(d), args.batch)
            print(f"| {d} | {s['questions']} | {s['turns_per_question']:.2f} | {s['tokens_per_turn']:.1f} | "
                  f"{s['kept_tokens_per_question']:.1f} | {s['paid_steps_per_batch_question']:.2f} | "
                  f"{s['seconds_per_question']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
