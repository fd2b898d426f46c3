"""Compare evaluated arms of an experiment: EM per arm and source with the spread over seeds, search
behaviour, per-question changes, and the verdicts of the learning experiment.

    python -m search_r1.evaluation.compare --arm no-search=eval/no-search --arm rag=eval/rag \\
        --arm warm-start=eval/ws --arm grpo=eval/grpo-s0,eval/grpo-s1,eval/grpo-s2 \\
        --before warm-start --after grpo --baseline rag --out comparison.md --json comparison.json

Each `--arm NAME=DIR[,DIR...]` names `python -m search_r1.evaluation` output directories (results.json +
predictions.jsonl); several directories are seeds of one arm, reported as mean and spread (max - min).
The verdicts compare `--after` (the trained arm) with `--before` (its starting point) and `--baseline`:

    gain:      after's two-hop EM - before's, for every seed, > 2 x after's spread over seeds
    baseline:  every after seed's two-hop EM > the baseline's
    no loss:   after's mean single-hop EM >= before's
    format:    every arm's format validity >= 0.9

"Answered after >= 2 searches" is the share of questions whose trajectory ended in an answer after two
or more searches (the paper's "the model learns to search more"). Transitions count questions that went
wrong -> right and right -> wrong (EM) from `--before` to each `--after` seed, by how many searches the
after-run made on them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

SINGLE_HOP, TWO_HOP = "synth_nq", "synth_hotpotqa"
FORMAT_TARGET = 0.9


@dataclass
class Run:
    """One evaluated model: its predictions (one record per question, keyed by id)."""

    path: Path
    records: dict[str, dict]

    @classmethod
    def load(cls, path) -> "Run":
        path = Path(path)
        preds = path / "predictions.jsonl"
        if not preds.is_file():
            raise ValueError(f"{path} has no predictions.jsonl: pass an output directory of "
                             "python -m search_r1.evaluation")
        records = {}
        for line in preds.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                records[rec["id"]] = rec
        return cls(path, records)

    @classmethod
    def load_validations(cls, run_dir) -> dict[int, "Run"]:
        """The trainer's greedy validations of a training run directory (its val_predictions.jsonl),
        one Run per validated step, in step order; a step validated twice (a resumed run) keeps the last."""
        path = Path(run_dir) / "val_predictions.jsonl"
        if not path.is_file():
            raise ValueError(f"{run_dir} has no val_predictions.jsonl: pass the output directory of a "
                             f"training run (trainer.output_dir) that validated")
        steps: dict[int, dict[str, dict]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                steps.setdefault(int(rec["step"]), {})[rec["id"]] = rec
        return {step: cls(path, records) for step, records in sorted(steps.items())}

    def select(self, source: str | None) -> list[dict]:
        return [r for r in self.records.values() if source in (None, r["data_source"])]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def run_stats(run: Run, source: str | None) -> dict:
    """EM, F1, format validity, searches per question and the share answered after >= 2 searches."""
    rs = run.select(source)
    return {"n": len(rs), "em": _mean(r["em"] for r in rs), "f1": _mean(r["f1"] for r in rs),
            "format_valid": _mean(r["format_valid"] for r in rs), "searches": _mean(r["searches"] for r in rs),
            "answered_after_2": _mean(float(r.get("answered", 1.0) > 0 and r["searches"] >= 2) for r in rs)}


def arm_stats(runs: list[Run], source: str | None) -> dict:
    """Per metric: mean over the arm's runs, and the spread (max - min) and per-run values."""
    per_run = [run_stats(r, source) for r in runs]
    out = {"n": per_run[0]["n"], "runs": len(runs)}
    for key in ("em", "f1", "format_valid", "searches", "answered_after_2"):
        values = [s[key] for s in per_run]
        out[key] = statistics.fmean(values)
        out[f"{key}_spread"] = max(values) - min(values)
        out[f"{key}_values"] = values
    return out


def transitions(before: Run, after: Run, source: str | None) -> dict[int, dict[str, int]]:
    """{searches made by `after`: {"wrong_to_right": n, "right_to_wrong": n}} over shared questions."""
    out: dict[int, dict[str, int]] = {}
    for qid, a in after.records.items():
        b = before.records.get(qid)
        if b is None or (source is not None and a["data_source"] != source):
            continue
        bucket = out.setdefault(int(a["searches"]), {"wrong_to_right": 0, "right_to_wrong": 0})
        if a["em"] > b["em"]:
            bucket["wrong_to_right"] += 1
        elif a["em"] < b["em"]:
            bucket["right_to_wrong"] += 1
    return dict(sorted(out.items()))


def changed(before: Run, after: Run) -> list[tuple[dict, dict]]:
    """(before's record, after's record) of each shared question whose EM differs, in after's order."""
    return [(before.records[qid], a) for qid, a in after.records.items()
            if qid in before.records and a["em"] != before.records[qid]["em"]]


def count_flips(flips: list[tuple[dict, dict]], source: str | None = None) -> tuple[int, int]:
    """(wrong -> right, right -> wrong) among `changed`'s pairs, of one data source or of all."""
    pairs = [(b, a) for b, a in flips if source is None or a["data_source"] == source]
    gained = sum(a["em"] > b["em"] for b, a in pairs)
    return gained, len(pairs) - gained


def verdicts(arms: dict[str, list[Run]], before: str, after: str, baseline: str) -> list[tuple[str, bool, str]]:
    """(name, met, evidence) of each claim in the module docstring."""
    two_after = arm_stats(arms[after], TWO_HOP)
    two_before = arm_stats(arms[before], TWO_HOP)["em"]
    two_base = arm_stats(arms[baseline], TWO_HOP)["em"]
    gains = [v - two_before for v in two_after["em_values"]]
    spread = two_after["em_spread"]
    single_after, single_before = arm_stats(arms[after], SINGLE_HOP)["em"], arm_stats(arms[before], SINGLE_HOP)["em"]
    formats = {name: arm_stats(runs, None)["format_valid"] for name, runs in arms.items()}
    return [
        ("two-hop EM gain over the spread",
         bool(gains) and min(gains) > 2 * spread,
         f"{after} - {before} two-hop EM per seed {', '.join(f'{g:+.3f}' for g in gains)}; "
         f"2 x spread {2 * spread:.3f} over {len(gains)} seed(s)"),
        ("two-hop EM above the baseline",
         all(v > two_base for v in two_after["em_values"]),
         f"{after} two-hop EM {', '.join(f'{v:.3f}' for v in two_after['em_values'])} vs {baseline} {two_base:.3f}"),
        ("single-hop EM does not fall",
         single_after >= single_before,
         f"{after} mean single-hop EM {single_after:.3f} vs {before} {single_before:.3f}"),
        (f"every arm answers in format (>= {FORMAT_TARGET})",
         all(v >= FORMAT_TARGET for v in formats.values()),
         ", ".join(f"{k} {v:.3f}" for k, v in formats.items())),
    ]


def _cell(stats: dict, key: str) -> str:
    if stats["runs"] > 1:
        return f"{stats[key]:.3f} ± {stats[f'{key}_spread'] / 2:.3f}"
    return f"{stats[key]:.3f}"


def report(arms: dict[str, list[Run]], before: str, after: str, baseline: str) -> tuple[str, dict]:
    """The markdown comparison and its figures as a dict (for plots and JSON)."""
    sources = sorted({r["data_source"] for runs in arms.values() for run in runs for r in run.records.values()})
    figures: dict = {"arms": {}, "verdicts": [], "transitions": {}}
    lines = ["### EM (F1) per arm and data source", "",
             "Mean over seeds ± half the spread (max - min) where an arm has several runs.", "",
             "| data_source | " + " | ".join(f"{a} ({len(r)} run{'s' if len(r) > 1 else ''})" for a, r in arms.items())
             + " |", "|---" * (len(arms) + 1) + "|"]
    for source in sources + [None]:
        cells = []
        for name, runs in arms.items():
            s = arm_stats(runs, source)
            figures["arms"].setdefault(name, {})[source or "overall"] = s
            cells.append(f"{_cell(s, 'em')} ({s['f1']:.3f})")
        label = f"`{source}` (n={arm_stats(next(iter(arms.values())), source)['n']})" if source else "**overall**"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "### Format validity and search behaviour", "",
              "| arm | data_source | format valid | searches / question | answered after >= 2 searches |",
              "|---|---|---|---|---|"]
    for name, runs in arms.items():
        for source in sources:
            s = figures["arms"][name][source]
            lines.append(f"| {name} | `{source}` | {_cell(s, 'format_valid')} | {_cell(s, 'searches')} | "
                         f"{_cell(s, 'answered_after_2')} |")
    lines += ["", f"### Per question, {before} -> {after} (EM), by the number of searches {after} made", "",
              "| seed run | data_source | searches | wrong -> right | right -> wrong |", "|---|---|---|---|---|"]
    for run in arms[after]:
        for source in sources:
            t = transitions(arms[before][0], run, source)
            figures["transitions"].setdefault(str(run.path), {})[source] = t
            for k, v in t.items():
                if v["wrong_to_right"] or v["right_to_wrong"]:
                    lines.append(f"| {run.path.name} | `{source}` | {k} | {v['wrong_to_right']} | {v['right_to_wrong']} |")
    lines += ["", "### Verdicts", ""]
    for name, met, evidence in verdicts(arms, before, after, baseline):
        figures["verdicts"].append({"claim": name, "met": met, "evidence": evidence})
        lines.append(f"- {name}: **{'met' if met else 'not met'}** ({evidence})")
    return "\n".join(lines) + "\n", figures


def _parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, dirs = text.partition("=")
    if not sep or not name or not dirs:
        raise ValueError(f"--arm {text!r}: expected NAME=DIR[,DIR...]")
    return name, [d for d in dirs.split(",") if d]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--arm", action="append", required=True, metavar="NAME=DIR[,DIR...]",
                   help="an arm and its eval output directories (several = seeds); repeat per arm, in table order")
    p.add_argument("--before", required=True, help="the arm the trained arm started from")
    p.add_argument("--after", required=True, help="the trained arm")
    p.add_argument("--baseline", required=True, help="the arm the trained arm must beat on two-hop questions")
    p.add_argument("--out", help="write the markdown here too")
    p.add_argument("--json", help="write the figures as JSON here")
    args = p.parse_args(argv)
    try:
        arms = {}
        for text in args.arm:
            name, dirs = _parse_arm(text)
            arms[name] = [Run.load(d) for d in dirs]
        missing = [a for a in (args.before, args.after, args.baseline) if a not in arms]
        if missing:
            raise ValueError(f"--before/--after/--baseline name {missing}, not among the arms {list(arms)}")
        text, figures = report(arms, args.before, args.after, args.baseline)
    except (ValueError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
