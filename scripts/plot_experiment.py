"""The learning experiment's figure: training curves of every GRPO seed beside the held-out EM.

    python scripts/plot_experiment.py outputs/experiment_cpu            # writes .../comparison.png
    python scripts/plot_experiment.py outputs/experiment_cpu --out docs/figures/experiment_cpu.png

Reads what `scripts/experiment_cpu.sh` writes: `grpo_seed*/metrics.jsonl` (per-step training reward
and exact match, sampled at temperature 1) and `eval/*/results.json` (greedy EM per data_source).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ORDER = ("no-search", "rag", "before-grpo")  # then the after-grpo-s* runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exp_dir", type=Path, help="the experiment's output directory (EXP_OUT)")
    p.add_argument("--out", type=Path, help="PNG to write (default EXP_DIR/comparison.png)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(args.exp_dir.glob("grpo_seed*/metrics.jsonl"))
    evals = {d.name: json.loads((d / "results.json").read_text())["metrics"]
             for d in sorted((args.exp_dir / "eval").glob("*")) if (d / "results.json").exists()}
    if not runs or not evals:
        raise SystemExit(f"{args.exp_dir} holds no grpo_seed*/metrics.jsonl or eval/*/results.json. "
                         "Fix: pass the directory scripts/experiment_cpu.sh wrote (EXP_OUT)")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for path in runs:
        rows = [json.loads(line) for line in path.read_text().splitlines() if '"reward/mean"' in line]
        steps = [r["step"] for r in rows]
        seed = path.parent.name.removeprefix("grpo_")
        axes[0].plot(steps, [r["reward/mean"] for r in rows], marker=".", label=seed)
        axes[1].plot(steps, [r["reward/em"] for r in rows], marker=".", label=seed)
    axes[0].set(title="training reward per step (sampled, T=1)", xlabel="GRPO step")
    axes[1].set(title="training exact match per step (sampled, T=1)", xlabel="GRPO step")
    names = [n for n in ORDER if n in evals] + sorted(n for n in evals if n not in ORDER)
    sources = sorted({s for m in evals.values() for s in m["per_source"]})
    width = 0.8 / len(sources)
    counts = next(iter(evals.values()))["per_source"]
    for i, source in enumerate(sources):
        values = [evals[n]["per_source"].get(source, {}).get("em", 0.0) for n in names]
        bars = axes[2].bar([j + i * width for j in range(len(names))], values, width,
                           label=f"{source} (n={counts.get(source, {}).get('n', '?')})")
        axes[2].bar_label(bars, fmt="%.3f", fontsize=7)
    axes[2].set_xticks([j + width * (len(sources) - 1) / 2 for j in range(len(names))], names, rotation=20)
    axes[2].set(title="held-out exact match, greedy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or args.exp_dir / "comparison.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
