"""Table and figure of scripts/stress_collapse_cpu.sh's runs (GRPO collapse stress test, issue 69).

    python scripts/stress_collapse_report.py --out outputs/stress_collapse --arms plain llds safeguards --seeds 0 1 2
    python scripts/stress_collapse_report.py --finished outputs/stress_collapse/seed0/plain --steps 16   # exit 0 if done

Per run (one arm, one seed), from its metrics.jsonl:
  start / end EM   greedy dev EM before training (the seed's first arm's validation: every arm of a
                   seed starts from the same warm-start with the same greedy sampler) and after
  collapsed        end EM more than two binomial standard errors below start: z = (start - end) /
                   sqrt(start (1 - start) / n) > 2, the project's validation alarm (trainer/alarms.py)
  first alarm      first step with any alarm/* flag up (drift: K3 KL over the window; reward_fall;
                   validation), and rollbacks taken (safeguards arm)
  likelihood       mean log pi_old per generated token of correct responses over the first and the last
                   3 steps that had a correct response (the paper's curve: its fall precedes the collapse), and the mean share of
                   responses with advantage >= 0 whose likelihood fell during the update
  update s/ktok    the policy update's worker time per 1,000 generated tokens, median over steps: the
                   cost of LLDS is this arm's figure over plain's, within the same seeds
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ALARMS = ("alarm/drift", "alarm/reward_fall", "alarm/validation")


def rows_of(run: Path) -> list[dict]:
    """metrics.jsonl rows in file order (a rolled-back run logs the replayed steps again)."""
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def validations(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "val/em" in r and "val/n" in r]


def is_finished(run: Path, steps: int) -> bool:
    """The run validated after its last step (the trainer's final validation)."""
    return any(int(r.get("step", -1)) >= steps for r in validations(rows_of(run)))


def collapse_z(start: float, end: float, n: int) -> float:
    """(start - end) / binomial standard error of the start; inf when the start is 0 or 1 and EM fell."""
    se = math.sqrt(max(start * (1 - start), 0.0) / n)
    if se == 0:
        return math.inf if end < start else 0.0
    return (start - end) / se


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def summarize(run: Path, baseline: dict | None) -> dict | None:
    """One run's row of the table; `baseline` is the seed's validation before training."""
    rows = rows_of(run)
    vals = validations(rows)
    steps = [r for r in rows if "timing/step" in r]
    if not vals or baseline is None:
        return None
    end = vals[-1]
    start_em, end_em, n = float(baseline["val/em"]), float(end["val/em"]), int(baseline["val/n"])
    alarm_steps = [int(r["step"]) for r in rows if any(r.get(k) == 1 for k in ALARMS)]
    correct = [r["likelihood/correct_logp_old"] for r in steps if r.get("likelihood/correct_logp_old") is not None]
    per_ktok = [1000 * r["timing/update_actor_worker"] / (r["response/generated_tokens_mean"] * r["train/trajectories_updated"])
                for r in steps if r.get("timing/update_actor_worker") and r.get("response/generated_tokens_mean")
                and r.get("train/trajectories_updated")]
    return {
        "start": start_em, "end": end_em, "n": n, "end_step": int(end["step"]),
        "z": collapse_z(start_em, end_em, n),
        "first_alarm": min(alarm_steps) if alarm_steps else None,
        "rollbacks": int(max((r.get("alarm/rollbacks", 0) for r in rows), default=0)),
        "kl_max": max((r.get("actor/kl_loss", 0.0) for r in steps), default=math.nan),
        "logp_first": _mean(correct[:3]), "logp_last": _mean(correct[-3:]),
        "fell": _mean(r.get("likelihood/preserved_fell_frac") for r in steps),
        "update_s_per_ktok": statistics.median(per_ktok) if per_ktok else math.nan,
        "step_s": statistics.median(r["timing/step"] for r in steps) if steps else math.nan,
        "steps": steps,
    }


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(results: dict, arms: list[str], seeds: list[str]) -> list[str]:
    lines = ["| arm | seed | dev EM start -> end (n) | collapsed (z > 2) | first alarm (step) | rollbacks | "
             "max K3 KL | log p correct, first 3 -> last 3 steps | preserving set fell | update s / 1k tok | step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        for seed in seeds:
            r = results.get((arm, seed))
            if r is None:
                lines.append(f"| {arm} | {seed} | not run | | | | | | | | |")
                continue
            lines.append(
                f"| {arm} | {seed} | {r['start']:.3f} -> {r['end']:.3f} ({r['n']}) | "
                f"{'yes' if r['z'] > 2 else 'no'} (z {r['z']:+.1f}) | {_fmt(r['first_alarm'], 'd')} | {r['rollbacks']} | "
                f"{_fmt(r['kl_max'])} | {_fmt(r['logp_first'])} -> {_fmt(r['logp_last'])} | {_fmt(r['fell'], '.2f')} | "
                f"{_fmt(r['update_s_per_ktok'], '.2f')} | {_fmt(r['step_s'], '.0f')} |")
    return lines


def verdicts(results: dict, arms: list[str], seeds: list[str]) -> list[str]:
    lines = []
    for arm in arms:
        done = [results[(arm, s)] for s in seeds if (arm, s) in results]
        if done:
            collapsed = sum(r["z"] > 2 for r in done)
            held = sum(r["end"] >= r["start"] for r in done)
            lines.append(f"- {arm}: collapsed in {collapsed} of {len(done)} seeds; ended at or above its start in "
                         f"{held} of {len(done)}.")
    costs = [(results[("llds", s)]["update_s_per_ktok"], results[("plain", s)]["update_s_per_ktok"])
             for s in seeds if ("llds", s) in results and ("plain", s) in results]
    costs = [(a, b) for a, b in costs if not (math.isnan(a) or math.isnan(b))]
    if costs:
        ratio = statistics.fmean(a for a, _ in costs) / statistics.fmean(b for _, b in costs)
        lines.append(f"- LLDS update time per generated token over plain's: {ratio:.3f} "
                     f"(update phase only; medians over steps, mean over {len(costs)} seeds; separate runs, "
                     f"so other work on the machine enters it: `python bench/llds_cost.py` times the two "
                     f"alternating in one process).")
    return lines


def figure(results: dict, arms: list[str], seeds: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward/em", "sampled EM"), ("likelihood/correct_logp_old", "log p of correct responses (per token)"),
              ("actor/kl_loss", "K3 KL to the reference"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    colors = dict(zip(arms, ("tab:red", "tab:blue", "tab:green", "tab:purple")))
    styles = ("-", "--", ":", "-.")
    for (key, label), ax in zip(panels, axes):
        for arm in arms:
            for i, seed in enumerate(seeds):
                r = results.get((arm, seed))
                if r is None:
                    continue
                pts = [(int(s["step"]), s[key]) for s in r["steps"] if s.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), color=colors.get(arm), linestyle=styles[i % len(styles)], linewidth=1.2,
                            label=f"{arm} seed {seed}")
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, help="the stress test's output directory (seed<k>/<arm>/ runs)")
    p.add_argument("--arms", nargs="+", default=["plain", "llds", "safeguards"], help="arms, in table order")
    p.add_argument("--seeds", nargs="+", default=["0", "1", "2"], help="seeds, in table order")
    p.add_argument("--command", help="the command that produced the runs (written into stress.md)")
    p.add_argument("--finished", type=Path, help="only check: exit 0 if this run validated after --steps")
    p.add_argument("--steps", type=int, default=0, help="the runs' trainer.total_steps (with --finished)")
    args = p.parse_args(argv)
    if args.finished is not None:
        return 0 if is_finished(args.finished, args.steps) else 1
    if args.out is None:
        p.error("--out is required (or --finished RUN)")

    results = {}
    for seed in args.seeds:
        runs = [(arm, args.out / f"seed{seed}" / arm) for arm in args.arms]
        before = [v for _, run in runs for v in validations(rows_of(run)) if int(v.get("step", -1)) == 0][:1]
        for arm, run in runs:
            r = summarize(run, before[0] if before else None)
            if r is not None:
                results[(arm, seed)] = r
    if not results:
        print(f"[stress] no finished run under {args.out}", file=sys.stderr)
        return 1
    lines = ["# GRPO collapse stress test", "", f"Command: `{args.command}`" if args.command else "", "",
             *table(results, args.arms, args.seeds), "", *verdicts(results, args.arms, args.seeds)]
    (args.out / "stress.md").write_text("\n".join(lines) + "\n")
    figure(results, args.arms, args.seeds, args.out / "stress.png")
    print("\n".join(lines))
    print(f"[stress] table: {args.out / 'stress.md'}, figure: {args.out / 'stress.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
