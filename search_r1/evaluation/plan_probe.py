"""Does a model plan one search or two for the right kind of question? A probe of the first thought.

The search warm-start's demonstrations open with a plan: "<think> Look up {subject}. </think>" on
single-hop questions and "<think> Two steps: first look up {subject}. </think>" on two-hop ones
(search_r1.trainer.warmstart). Greedy decoding commits to a plan at the first token where the two
differ, so for each question with `extra_info.hops` and `extra_info.subject` (the synthetic world's
rows) the probe reads one forward pass:

    log_odds = log p(two-hop plan's token | prompt, shared prefix) - log p(single-hop plan's token | ...)

and reports, per kind, the mean log odds and the share of questions whose greedy plan is two steps,
plus the AUC: the probability that a random two-hop question gets higher log odds than a random
single-hop one (0.5: the model does not tell the kinds apart, whatever its bias; 1.0: a threshold
separates them). A warm-start with a high AUC but a bias gives GRPO something to sharpen; one with
AUC near 0.5 leaves GRPO to move a single shared habit.

    python -m search_r1.evaluation.plan_probe --model DIR --data dev.parquet [--limit N] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first position where token lists `a` and `b` differ (they must differ before
    either ends)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    raise ValueError("one plan's tokens are a prefix of the other's: no single token decides between them")


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a random positive scores above a random negative), ties counting one half (the Mann-Whitney
    U statistic over len(positive) * len(negative)); nan when either list is empty."""
    if not positive or not negative:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def summarize(log_odds: dict[int, list[float]]) -> dict:
    """{"single_hop"/"two_hop": {n, mean_log_odds, share_two_step_plan}, "auc"} from log odds per hops."""
    out = {}
    for hops, name in ((1, "single_hop"), (2, "two_hop")):
        v = log_odds.get(hops, [])
        out[name] = {"n": len(v), "mean_log_odds": sum(v) / len(v) if v else float("nan"),
                     "share_two_step_plan": sum(x > 0 for x in v) / len(v) if v else float("nan")}
    out["auc"] = auc(log_odds.get(2, []), log_odds.get(1, []))
    return out


def probe(model, tokenizer, rows: list[dict]) -> dict[int, list[float]]:
    """Log odds (two-step plan vs one) per question, grouped by hops; rows: {"messages", "subject", "hops"}."""
    import torch

    from search_r1.prompts import apply_chat_template
    from search_r1.trainer.warmstart import THINK_FIRST, THINK_FIRST_TWO_HOP

    out: dict[int, list[float]] = {1: [], 2: []}
    for row in rows:
        one = tokenizer(THINK_FIRST.format(subject=row["subject"]), add_special_tokens=False)["input_ids"]
        two = tokenizer(THINK_FIRST_TWO_HOP.format(subject=row["subject"]), add_special_tokens=False)["input_ids"]
        k = first_divergence(one, two)
        ids = torch.tensor([apply_chat_template(tokenizer, row["messages"]) + one[:k]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
        out[row["hops"]].append(float(logp[two[k]] - logp[one[k]]))
    return out


def read_rows(path: str, limit: int = 0) -> list[dict]:
    """Rows of a parquet file that say their hops (1 or 2) and subject; a clear error when none do."""
    import pandas as pd

    rows = []
    for rec in pd.read_parquet(path).to_dict("records"):
        extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
        if extra.get("hops") in (1, 2) and extra.get("subject"):
            rows.append({"messages": [dict(m) for m in rec["prompt"]], "subject": str(extra["subject"]),
                         "hops": int(extra["hops"])})
    if not rows:
        raise SystemExit(f"{path}: no row has extra_info.hops (1 or 2) and extra_info.subject; the probe needs the "
                         f"synthetic world's questions (python -m search_r1.data.synth) or a split of them")
    return rows[:limit] if limit else rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m search_r1.evaluation.plan_probe",
        description="Measure whether a model's first thought plans one search on single-hop questions and "
                    "two on two-hop ones (log odds at the deciding token; AUC between the kinds).")
    parser.add_argument("--model", required=True, help="HF model directory or a registered name (e.g. a "
                        "warm-start under $SEARCH_R1_HOME/warmstart, or a checkpoint's model directory, "
                        "RUN_DIR/checkpoints/global_step_N/model)")
    parser.add_argument("--data", required=True, help="parquet with extra_info.hops and extra_info.subject "
                        "(the synthetic world's dev or test split)")
    parser.add_argument("--limit", type=int, default=0, help="probe only the first N usable rows (0 = all)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (keep processes x threads <= cores)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args(argv)

    import torch

    from search_r1.models import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    rows = read_rows(args.data, args.limit)
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.float32)
    model.eval()
    result = summarize(probe(model, tokenizer, rows))
    if args.json:
        print(json.dumps(result))
        return 0
    for name in ("single_hop", "two_hop"):
        r = result[name]
        print(f"{name:10s} n={r['n']:4d}  mean log odds (two-step vs one) {r['mean_log_odds']:+.2f}  "
              f"greedy two-step plan {r['share_two_step_plan']:.2f}")
    print(f"AUC (two-hop above single-hop) {result['auc']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
