"""Training metrics: one `log(metrics, step)` call fans out to console, JSONL, TensorBoard and wandb.

`metrics.jsonl` is the record of a run: one JSON object per call, `{"step", "time", <metrics>}`,
flushed at once so a crashed run keeps everything it logged. Non-finite values (NaN, inf) are kept
as `null` and named under `"nonfinite"`, so a diverging run is visible instead of crashing the logger.
`plot_training_curves` reads that file back into a PNG grid.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

VALID_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")

# Keys shown on the console line, in this order, when present (short label, metric key).
CONSOLE_KEYS = (
    ("reward", "reward/mean"),
    ("em", "reward/em"),
    ("kl", "actor/kl_loss"),
    ("pg", "actor/pg_loss"),
    ("ent", "actor/entropy"),
    ("gnorm", "actor/grad_norm"),
    ("skip", "actor/skipped_updates"),
    ("resp", "response/length_mean"),
    ("val_em", "val/em"),
    ("t", "timing/step"),
)

# Panels of the training-curve plot: (title, candidate keys, first present wins per group).
# Candidates cover this trainer's names first, then verl's, so a verl-path metrics file plots too.
PLOT_PANELS = (
    ("reward mean", ("reward/mean", "critic/score/mean")),
    ("exact match", ("reward/em", "em")),
    ("KL (K3)", ("actor/kl_loss", "actor/kl")),
    ("policy loss", ("actor/pg_loss",)),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response/length_mean", "response_length/mean")),
    # sampler vs trainer: mean |log p_rollout - log p_old| over generated tokens (0 = on-policy)
    ("rollout vs old |dlogp|", ("training/rollout_log_probs_diff_mean",)),
)


def per_source_training_metrics(sources: Sequence[str], em: Sequence[float], advantages: Sequence[float],
                                scores: Sequence[float], searches: Sequence[float]) -> dict[str, float]:
    """Training-batch statistics split by data source (one entry per trajectory, N of them).

    Returns, for every source s present, with N_s its trajectories:
      reward/<s>/em              = mean EM over the N_s trajectories,
      reward/<s>/mean            = mean training reward,
      adv/<s>/zero_group_share   = share of the N_s trajectories whose GRPO advantage is exactly 0
                                   (their whole group scored alike, so they carry no gradient),
      env/<s>/searches_mean      = mean number of valid searches per trajectory,
    and for every number of searches k that occurs among them, with N_sk those trajectories:
      env/<s>/share_searches<k>  = N_sk / N_s,
      reward/<s>/em_searches<k>  = mean EM over the N_sk,
      adv/<s>/mean_searches<k>   = mean GRPO advantage over the N_sk.
    Why: a batch mixing single-hop and two-hop questions can show a healthy overall zero-advantage
    share while every two-hop group is uniform, and only the split shows which kind is learning. The
    split by searches shows which habit the step rewards: a positive adv/<s>/mean_searches1 pushes the
    policy toward answering after one search on questions of kind s, and the habit is shared across kinds.
    """
    if not (len(sources) == len(em) == len(advantages) == len(scores) == len(searches)):
        raise ValueError(f"per_source_training_metrics: lengths differ (sources {len(sources)}, em {len(em)}, "
                         f"advantages {len(advantages)}, scores {len(scores)}, searches {len(searches)})")

    def mean(values: Sequence[float], rows: list[int]) -> float:
        return sum(float(values[i]) for i in rows) / len(rows)

    zero = [float(a) == 0.0 for a in advantages]
    out: dict[str, float] = {}
    for source in sorted(set(map(str, sources))):
        idx = [i for i, s in enumerate(sources) if str(s) == source]
        out[f"reward/{source}/em"] = mean(em, idx)
        out[f"reward/{source}/mean"] = mean(scores, idx)
        out[f"adv/{source}/zero_group_share"] = mean(zero, idx)
        out[f"env/{source}/searches_mean"] = mean(searches, idx)
        for k in sorted({int(searches[i]) for i in idx}):
            sub = [i for i in idx if int(searches[i]) == k]
            out[f"env/{source}/share_searches{k}"] = len(sub) / len(idx)
            out[f"reward/{source}/em_searches{k}"] = mean(em, sub)
            out[f"adv/{source}/mean_searches{k}"] = mean(advantages, sub)
    return out


def _scalar(value):
    """A float for numbers (bools, ints, numpy and 0-d torch values included); None otherwise."""
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, (int, float)):
        return float(value)
    return None


class MetricsLogger:
    """Fan-out metrics logger.

    Args:
        out_dir: where `metrics.jsonl` and `tensorboard/` go (created).
        loggers: any of "console", "jsonl", "tensorboard", "wandb".
        project, run_name, config: wandb project / run name / run config (config also lands in
            `out_dir/config.json`). `experiment_name` is accepted as verl's name for run_name.
        console_keys: (label, key) pairs for the console line; defaults to CONSOLE_KEYS.
    """

    def __init__(self, out_dir, loggers: Sequence[str] = ("console", "jsonl", "tensorboard"),
                 project: str | None = None, run_name: str | None = None, config: Mapping | None = None,
                 console_keys: Iterable[tuple[str, str]] | None = None, experiment_name: str | None = None):
        run_name = run_name or experiment_name
        if isinstance(loggers, str):
            loggers = [loggers]
        unknown = [name for name in loggers if name not in VALID_LOGGERS]
        if unknown:
            raise ValueError(f"unknown logger(s) {unknown}; valid loggers are {list(VALID_LOGGERS)}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = tuple(dict.fromkeys(loggers))
        self.console_keys = tuple(console_keys) if console_keys is not None else CONSOLE_KEYS
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._jsonl = None
        self._tb = None
        self._wandb_run = None
        self._closed = False
        if config is not None:
            (self.out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        if "jsonl" in self.loggers:
            # Append: a resumed run continues the same record.
            self._jsonl = open(self.jsonl_path, "a", buffering=1)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        if "wandb" in self.loggers:
            self._wandb_run = _start_wandb(project, run_name, config, self.out_dir)

    def log(self, metrics: Mapping, step: int) -> None:
        """Record `metrics` at `step`. Strings and None go to JSONL only; other non-scalars are dropped."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log() after close(); create a new logger to keep logging")
        clean, nonfinite = {}, []
        for key, value in metrics.items():
            number = _scalar(value)
            if number is None:
                if isinstance(value, (str, type(None))):
                    clean[key] = value
                else:
                    logger.warning("metric %r has non-scalar value of type %s; dropped", key, type(value).__name__)
                continue
            if not math.isfinite(number):
                nonfinite.append(key)
                clean[key] = None
            else:
                clean[key] = number
        record = {"step": int(step), "time": time.time(), **clean}
        if nonfinite:
            record["nonfinite"] = nonfinite
            logger.warning("step %d: non-finite metrics %s logged as null", step, nonfinite)
        numbers = {k: v for k, v in clean.items() if isinstance(v, float)}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, global_step=int(step))
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(numbers, step=int(step))
        if "console" in self.loggers:
            self._console(numbers, step, nonfinite)

    def _console(self, numbers: dict, step: int, nonfinite: list) -> None:
        parts, shown = [f"step {step}"], set()
        for label, key in self.console_keys:
            if key in numbers and label not in shown:
                shown.add(label)
                parts.append(f"{label} {numbers[key]:.4g}")
        if nonfinite:
            parts.append(f"nonfinite {','.join(nonfinite)}")
        from tqdm import tqdm

        tqdm.write(" | ".join(parts))  # prints above an active progress bar instead of breaking it

    def close(self) -> None:
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _start_wandb(project, run_name, config, out_dir: Path):
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("the 'wandb' logger needs the wandb package: `pip install wandb` "
                          "(or drop 'wandb' from trainer.loggers)") from exc
    # wandb reads WANDB_MODE itself; passing mode=None keeps "offline" working without a login.
    return wandb.init(project=project or "search-r1", name=run_name, config=dict(config or {}),
                      dir=str(out_dir), mode=os.environ.get("WANDB_MODE") or None, reinit=True)


def read_metrics(metrics_jsonl) -> list[dict]:
    """The records of a metrics.jsonl file; a torn last line (crash mid-write) is skipped."""
    records = []
    with open(metrics_jsonl) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("skipping unreadable line in %s", metrics_jsonl)
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r["step"])
            values.append(v)
    return steps, values


def plot_training_curves(metrics_jsonl, png_path, keys: Sequence[str] | None = None) -> Path:
    """A grid of line plots, one panel per metric, written to `png_path`.

    Default panels: reward mean, EM, KL, policy loss, entropy, response length, rollout-vs-old log-prob gap (first matching
    key of each), then every `val/...` key. Panels whose keys never occur are left out; with no
    plottable key at all a single panel says so. `keys` picks the panels explicitly.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_jsonl)
    present = {k for r in records for k in r}
    if keys is not None:
        panels = [(k, k) for k in keys if k in present]
    else:
        panels = []
        for title, candidates in PLOT_PANELS:
            key = next((c for c in candidates if c in present), None)
            if key is not None:
                panels.append((title, key))
        # Overall validation metrics (val/em, val/f1, ...); per-source ones (val/<source>/em) only
        # when asked for by `keys`, or the grid grows with the number of datasets.
        panels += [(k, k) for k in sorted(present) if k.startswith("val/") and k.count("/") == 1 and k != "val/n"]
    panels = [(t, k) for t, k in panels if _series(records, k)[0]]
    n = max(len(panels), 1)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    if not panels:
        axes[0][0].text(0.5, 0.5, "no metrics to plot", ha="center", va="center")
        axes[0][0].axis("off")
    for ax, (title, key) in zip(axes.flat, panels):
        steps, values = _series(records, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(title if title == key else f"{title}\n({key})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
