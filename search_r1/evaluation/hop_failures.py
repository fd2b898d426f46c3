"""Why two-hop answers fail: one cause per wrong two-hop prediction, in the order a two-hop search has
to go right.

    python -m search_r1.evaluation.hop_failures --data dev.parquet RUN_DIR [RUN_DIR...]      # training runs
    python -m search_r1.evaluation.hop_failures --data test.parquet EVAL_DIR [EVAL_DIR...]   # eval outputs

A two-hop question of the synthetic world (`extra_info.hops` 2) asks for an attribute of a bridge
entity (`extra_info.bridge`) that only the subject's passages name. Every two-hop prediction gets the
first cause that applies:

    right             EM 1
    no_answer         the trajectory ended without an <answer> (out of turns or tokens)
    one_search        answered after fewer than two searches
    bridge_not_shown  the first search's passages, as the policy read them (cut to max_obs_length), do
                      not name the bridge: the retriever missed it for that query, or the cut hid it
    other_entity      the bridge was shown, but the second query does not name it
    answer_not_shown  the second query named the bridge, but no later passages show a gold answer
    misread           a gold answer was shown, another one was given

`bridge_not_shown` is what better reading cannot fix: only another first query (or a longer
observation) can. The table gives `reachable`, the questions without that cause, as the two-hop
ceiling of the policy's first query. A training run directory contributes its first and last
validation (its val_predictions.jsonl; `--all-steps` for every one); an eval directory its
predictions.jsonl. Questions are matched to the data file by id, then by question text.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from search_r1.evaluation.compare import Run
from search_r1.protocol import PROTOCOLS, mentions_any, search_rounds

CAUSES = ("right", "no_answer", "one_search", "bridge_not_shown", "other_entity", "answer_not_shown", "misread")


def failure_cause(record: dict, bridge: str, protocol: str = "tags") -> str:
    """The first of CAUSES that applies to one two-hop prediction (a predictions.jsonl record with
    em, prediction, golden_answers and response) whose bridge entity is `bridge`."""
    if record["em"] >= 1:
        return "right"
    if not record.get("prediction"):
        return "no_answer"
    rounds = search_rounds(record["response"], protocol)
    if len(rounds) < 2:
        return "one_search"
    if not mentions_any(rounds[0][1], [bridge]):
        return "bridge_not_shown"
    if not mentions_any(rounds[1][0], [bridge]):
        return "other_entity"
    if not any(mentions_any(obs, record["golden_answers"]) for _, obs in rounds[1:]):
        return "answer_not_shown"
    return "misread"


def load_bridges(data_files) -> tuple[dict[str, str], dict[str, str]]:
    """({id: bridge}, {question: bridge}) of the two-hop rows of Search-R1 parquet files."""
    import pandas as pd

    by_id, by_question = {}, {}
    for path in data_files:
        frame = pd.read_parquet(path)
        if "extra_info" not in frame.columns:
            raise ValueError(f"{path} has no extra_info column: pass the synthetic world's parquet "
                             f"(python -m search_r1.data.synth), whose two-hop rows record their bridge entity")
        for row in frame.to_dict("records"):
            extra = row["extra_info"] if isinstance(row["extra_info"], dict) else {}
            if int(extra.get("hops") or 1) != 2 or not extra.get("bridge"):
                continue
            by_question[str(row["question"])] = str(extra["bridge"])
            # Only a real id column: the eval and the trainer name id-less rows each their own way.
            if row.get("id") is not None:
                by_id[str(row["id"])] = by_question[str(row["question"])]
    if not by_question:
        raise ValueError(f"no two-hop row with extra_info.bridge in {[str(p) for p in data_files]}")
    return by_id, by_question


def count_causes(run: Run, by_id: dict[str, str], by_question: dict[str, str], protocol: str = "tags") -> Counter:
    """Two-hop predictions of `run` per cause; those the data files do not know are `unmatched`."""
    out = Counter()
    for rec in run.records.values():
        bridge = by_id.get(str(rec["id"])) or by_question.get(str(rec.get("question")))
        if bridge is None:
            if rec.get("data_source") == "synth_hotpotqa":
                out["unmatched"] += 1
            continue
        out[failure_cause(rec, bridge, protocol)] += 1
    return out


def runs_of(path, all_steps: bool = False) -> list[tuple[str, Run]]:
    """(label, Run) of an eval output directory, or of a training run's validations (first and last)."""
    path = Path(path)
    if (path / "predictions.jsonl").is_file():
        return [(path.name, Run.load(path))]
    steps = Run.load_validations(path)
    keep = list(steps) if all_steps else sorted({min(steps), max(steps)})
    return [(f"{path.name} step {s}", steps[s]) for s in keep]


def table(rows: list[tuple[str, Counter]]) -> str:
    """Markdown: one row per run, counts per cause, the reachable ceiling."""
    lines = ["| run | two-hop | " + " | ".join(c.replace("_", " ") for c in CAUSES) + " | reachable |",
             "|---" * (len(CAUSES) + 3) + "|"]
    for label, c in rows:
        n = sum(v for k, v in c.items() if k != "unmatched")
        lines.append(f"| {label} | {n} | " + " | ".join(str(c[k]) for k in CAUSES) + f" | {n - c['bridge_not_shown']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("runs", nargs="+", metavar="DIR",
                   help="eval output directories (predictions.jsonl) or training run directories (val_predictions.jsonl)")
    p.add_argument("--data", action="append", required=True, metavar="PARQUET",
                   help="the data file(s) the predictions were made on (their extra_info names each bridge); repeatable")
    p.add_argument("--protocol", default="tags", choices=PROTOCOLS, help="the action protocol of the responses")
    p.add_argument("--all-steps", action="store_true", help="every validated step of a training run, not the first and last")
    args = p.parse_args(argv)
    try:
        by_id, by_question = load_bridges(args.data)
        rows = [(label, count_causes(run, by_id, by_question, args.protocol))
                for path in args.runs for label, run in runs_of(path, args.all_steps)]
    except (ValueError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(rows), end="")
    unmatched = sum(c["unmatched"] for _, c in rows)
    if unmatched:
        print(f"\n{unmatched} two-hop predictions were not found in --data (by id or question): is it the file "
              f"they were made on?", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
