"""What a training run changed, in words a newcomer reads: the before/after table of its first and last
greedy validation, how large a change chance alone makes on that many questions, and a few questions
whose answer changed, with each trajectory's searches before and after.

    python -m search_r1.evaluation.before_after outputs/demo            # what `make demo` prints last
    python -m search_r1.evaluation.before_after outputs/demo --examples 5

Reads the run's val_predictions.jsonl (one record per question and validated step; the trainer writes
it, `Run.load_validations` reads it).

Noise: the two validations ask the same questions, so what counts is the questions that changed.
With g questions gained and l lost, the sign test's normal approximation says chance alone (each
change equally likely either way) gives |g - l| within 2 sqrt(g + l) about 95% of the time; the
binomial standard error of an EM p over n questions, sqrt(p (1 - p) / n), is printed too, because it
is the noise between two *different* question sets of that size.
"""
from __future__ import annotations

import argparse
import math
import re
import sys

from search_r1.evaluation.compare import SINGLE_HOP, TWO_HOP, Run, changed, count_flips, run_stats
from search_r1.protocol import invalid_action_observation

_INFO_RE = re.compile(r"<information>.*?</information>", re.DOTALL)
_SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

ROWS = (("em", None, "EM (exact match)"), ("em", SINGLE_HOP, "EM, single-hop questions"),
        ("em", TWO_HOP, "EM, two-hop questions"), ("f1", None, "F1 (word overlap)"),
        ("format_valid", None, "well-formed responses"), ("searches", None, "searches per question"))


def trajectory(record: dict) -> tuple[list[str], str | None]:
    """(search queries in order, final answer) of a validation record's response text; retrieved
    passages and the environment's invalid-action reminder (which quotes "<search> and </search>")
    are skipped, so only the model's own actions count."""
    policy = _INFO_RE.sub(" ", record.get("response", "")).replace(invalid_action_observation("tags").strip(), " ")
    answers = _ANSWER_RE.findall(policy)
    return [q.strip() for q in _SEARCH_RE.findall(policy)], (answers[-1].strip() if answers else None)


def change_is_beyond_noise(gained: int, lost: int) -> bool:
    """Sign test, normal approximation: |gained - lost| > 2 sqrt(gained + lost)."""
    return abs(gained - lost) > 2 * math.sqrt(gained + lost)


def _describe(record: dict) -> str:
    queries, answer = trajectory(record)
    searched = "; ".join(f"searched {q!r}" for q in queries) or "no search"
    verdict = "right" if record["em"] > 0 else "wrong"
    return f"{searched} -> answered {answer!r} ({verdict})" if answer is not None else f"{searched} -> no answer (wrong)"


def report(run_dir, examples: int = 3) -> list[str]:
    """The lines `make demo` ends with (see the module docstring)."""
    vals = Run.load_validations(run_dir)
    if len(vals) < 2:
        return [f"{run_dir} has {len(vals)} validation(s); a before/after comparison needs two "
                "(trainer.val_before_train=true and a validation after the last step)"]
    (s0, before), (s1, after) = list(vals.items())[0], list(vals.items())[-1]
    n = len(before.records)
    lines = [f"Greedy validation on the same {n} dev questions, before training (step {s0}) and after (step {s1}):",
             "", f"  {'':<32}{'before':>8}{'after':>8}{'change':>9}"]
    for key, source, label in ROWS:
        b, a = run_stats(before, source), run_stats(after, source)
        if b["n"] == 0 or a["n"] == 0:
            continue  # a source this run did not validate on
        label = f"{label} ({b['n']})" if source else label
        lines.append(f"  {label:<32}{b[key]:>8.3f}{a[key]:>8.3f}{a[key] - b[key]:>+9.3f}")
    flips = changed(before, after)
    gained, lost = count_flips(flips)
    em = run_stats(before, None)["em"]
    se = math.sqrt(em * (1 - em) / n) if n else float("nan")
    verdict = ("beyond what chance alone would give" if change_is_beyond_noise(gained, lost)
               else "within what chance alone could give")
    lines += ["", f"Question by question: {gained} went wrong -> right and {lost} right -> wrong, a net "
                  f"{gained - lost:+d} of {n} ({(gained - lost) / n:+.3f} EM). That is {verdict} (sign test: "
                  f"|gained - lost| against 2 x sqrt(gained + lost) = {2 * math.sqrt(gained + lost):.1f}). For "
                  f"scale, EM on {n} other questions would vary by about {se:.3f} (one binomial standard error)."]
    if flips:
        # gains first; within each, the questions where the model searched differently first (what a
        # run learned about searching shows there, not only in the answer)
        ordered = sorted(flips, key=lambda p: (p[1]["em"] < p[0]["em"], p[1]["searches"] == p[0]["searches"]))
        lines += ["", "Examples of questions whose answer changed:"]
        for b, a in ordered[:examples]:
            lines += [f"  {'+' if a['em'] > b['em'] else '-'} {a['question']!r} (gold {a['golden_answers'][0]!r})",
                      f"      before: {_describe(b)}", f"      after:  {_describe(a)}"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("run_dir", help="a training run's output directory (trainer.output_dir), with val_predictions.jsonl")
    p.add_argument("--examples", type=int, default=3,
                   help="changed questions to show, gains first, those searched differently first (default 3)")
    args = p.parse_args(argv)
    try:
        lines = report(args.run_dir, args.examples)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
