"""The results figure (README, docs/results/): held-out test EM per arm for the shipped recipe on the synthetic world.

    python scripts/plot_results_summary.py        # writes docs/figures/results_shipped_recipe.png

The figures are copied from docs/results/experiment_cpu_default_e2e.md (`bash scripts/experiment_cpu.sh`,
2026-12-06, 2-core Intel Xeon with AMX, bf16; 100 test questions per kind, GRPO = 3 seeds, the bar the
mean and the whisker half the spread max - min). Change them here when that page is replaced.
"""
from pathlib import Path

ARMS = ["no-search", "RAG", "warm-start\n(search)", "warm-start + GRPO\n(3 seeds)"]
EM = {  # (mean, half spread)
    "two-hop (synth_hotpotqa)": [(0.000, 0), (0.020, 0), (0.550, 0), (0.687, 0.005)],
    "single-hop (synth_nq)": [(0.000, 0), (0.850, 0), (0.800, 0), (0.807, 0.040)],
}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=120)
    width = 0.38
    for k, (kind, vals) in enumerate(EM.items()):
        xs = [i + (k - 0.5) * width for i in range(len(ARMS))]
        ax.bar(xs, [m for m, _ in vals], width, yerr=[s or float("nan") for _, s in vals], capsize=3, label=kind)
        for x, (m, s) in zip(xs, vals):
            ax.text(x, m + s + 0.02, f"{m:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(ARMS)), ARMS, fontsize=9)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out test EM")
    ax.set_title("SmolLM2-135M on the synthetic world, 100 test questions per kind (2026-12-06, Xeon with AMX, bf16)",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(__file__).resolve().parents[1] / "docs" / "figures" / "results_shipped_recipe.png"
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main()
