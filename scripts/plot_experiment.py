"""The learning experiment's figure: held-out EM and searches per arm and source, and the training curves.

    python scripts/plot_experiment.py outputs/experiment_cpu            # writes .../comparison.png
    python scripts/plot_experiment.py outputs/experiment_cpu --out docs/figures/experiment_cpu.png

Reads what `scripts/experiment_cpu.sh` writes: `comparison.json` (search_r1.evaluation.compare: EM and
searches per arm and data_source, mean over seeds and spread) and `grpo_*/metrics.jsonl` (per-step
training reward, sampled at temperature 1, and the trainer's greedy dev validations).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exp_dir", type=Path, help="the experiment's output directory (EXP_OUT)")
    p.add_argument("--out", type=Path, help="PNG to write (default EXP_DIR/comparison.png)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmp_path = args.exp_dir / "comparison.json"
    runs = sorted(args.exp_dir.glob("grpo_*/metrics.jsonl"))
    if not cmp_path.is_file() or not runs:
        raise SystemExit(f"{args.exp_dir} holds no comparison.json or grpo_*/metrics.jsonl. Fix: pass the "
                         "directory scripts/experiment_cpu.sh wrote (EXP_OUT) after it finished")
    arms = json.loads(cmp_path.read_text())["arms"]
    names = list(arms)
    sources = [s for s in next(iter(arms.values())) if s != "overall"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    width = 0.8 / len(sources)
    for panel, key, title in ((0, "em", "held-out exact match (greedy)"), (1, "searches", "searches per question")):
        for i, source in enumerate(sources):
            stats = [arms[n][source] for n in names]
            xs = [j + i * width for j in range(len(names))]
            bars = axes[panel].bar(xs, [s[key] for s in stats], width, yerr=[s[f"{key}_spread"] / 2 for s in stats],
                                   capsize=3, label=f"{source} (n={stats[0]['n']})")
            axes[panel].bar_label(bars, fmt="%.2f", fontsize=7)
        axes[panel].set_xticks([j + width * (len(sources) - 1) / 2 for j in range(len(names))],
                               [f"{n}\n({arms[n][sources[0]]['runs']} run{'s' if arms[n][sources[0]]['runs'] > 1 else ''})"
                                for n in names])
        axes[panel].set(title=title + ("; bars: ± half the seed spread" if panel == 0 else ""))
    rows_of = {path: [json.loads(line) for line in path.read_text().splitlines()] for path in runs}
    # The script validates the shared warm-start once (the first seed of a dtype, step 0): every
    # seed of that dtype starts from it, so its curve starts there too.
    label_of = {path: path.parent.name.removeprefix("grpo_") for path in runs}  # "<dtype>_seed<k>"
    start_of = {}
    for path, rows in rows_of.items():
        start_of.update({label_of[path].split("_seed")[0]: r for r in rows if "val/em" in r and r["step"] == 0})
    for path, rows in rows_of.items():
        label = label_of[path]
        train = [r for r in rows if "reward/mean" in r]
        val = [r for r in rows if "val/em" in r]
        start = start_of.get(label.split("_seed")[0])
        if start is not None and not any(r["step"] == 0 for r in val):
            val = [start] + val
        axes[2].plot([r["step"] for r in train], [r["reward/mean"] for r in train], marker=".", label=label)
        axes[3].plot([r["step"] for r in val], [r["val/em"] for r in val], marker="o", label=label)
    axes[2].set(title="training reward per step (sampled rollouts)", xlabel="GRPO step")
    axes[3].set(title="dev exact match (greedy, trainer validation)", xlabel="GRPO step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = args.out or args.exp_dir / "comparison.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
