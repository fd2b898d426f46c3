"""Warnings that a GRPO run is degrading, printed while it still runs (and logged as `alarm/*` metrics).

Why: a small policy trained with a high learning rate on small groups can drift away from the
warm-started model and collapse into a format-only answer (measured on the old single-hop demo
recipe at lr 3e-5, fp32: K3 KL 0 -> 0.14 by step 13 while the sampled EM fell from 0.6 to 0; the
greedy validation EM ended at 0.16 against 0.58 before training). Each signal alone is noisy on
8-16 samples per step, so each alarm looks at a window of steps:

    drift:       K3 KL to the reference, averaged over the last `window` steps, above `kl`
    reward fall: sampled EM, averaged over the last `window` steps, below half its average over the
                 first `window` steps (and the first window's average above 0.1)
    validation:  a validation EM more than two binomial standard errors below the first one, overall
                 and per data source (`val/<source>/em`): a recipe can trade one kind of question for
                 another with the overall EM inside its error bar (measured: single-hop dev EM
                 0.938 -> 0.531 while the overall drop, 0.156, stayed inside 0.166)

An alarm prints once when it starts and again when it clears. By default (trainer.on_alarm=warn) it
never stops the run (the next validation and the checkpoints are the user's to judge); with
`stop` the fit loop saves a checkpoint and raises `AlarmStop` when an alarm starts, with `rollback` it
restores the last checkpoint saved before the alarm's window and goes on with a lower learning rate
and a higher KL coefficient (search_r1/trainer/ray_trainer.py, `RayGRPOTrainer._on_alarm`).

The validation alarm needs a first validation to compare with. A resumed run replays its own
metrics.jsonl (`replay`), so it still compares with the validation before training rather than with
its first one after the resume; a run that does not validate before training (e.g. the later seeds of
`scripts/experiment_cpu.sh`, which share the first seed's) takes another run's (`set_baseline`,
`trainer.val_baseline`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from search_r1.trainer.metrics import read_metrics


class AlarmStop(RuntimeError):
    """An alarm stopped the run (trainer.on_alarm=stop, or rollback with no rollback left): the
    message names the alarm, the step and the checkpoint saved; the CLI exits with `exit_code`."""

    exit_code = 3


@dataclass
class RunAlarms:
    """Feed every logged metrics dict to `check`; it returns the messages to print now."""

    kl: float = 0.1
    window: int = 5
    _train: list[dict] = field(default_factory=list)
    _first_val: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric prefix -> (EM, n)
    _active: set[str] = field(default_factory=set)
    # the alarms that started in the last `check` (the fit loop acts on them: trainer.on_alarm)
    fired: list[str] = field(default_factory=list)

    def check(self, metrics: dict) -> list[str]:
        self.fired = []
        messages: list[str] = []
        if "reward/em" in metrics:
            self._train.append(metrics)
            recent = self._train[-self.window:]
            # a step whose update was skipped (algorithm.skip_zero_advantage) has no KL measurement
            kls = [m["actor/kl_loss"] for m in self._train if "actor/kl_loss" in m][-self.window:]
            kl = sum(kls) / len(kls) if kls else 0.0
            messages += self._toggle(
                "drift", self.kl > 0 and len(kls) == self.window and kl > self.kl, metrics,
                f"the policy drifts from the reference: K3 KL averaged {kl:.3f} over the last {self.window} steps "
                f"(alarm above trainer.kl_alarm={self.kl}). On small models this has preceded collapse into "
                f"answers that only satisfy the format; lower optim.lr, raise algorithm.kl_coef, or watch the "
                f"next validation")
            if len(self._train) >= 2 * self.window:
                start = sum(m["reward/em"] for m in self._train[:self.window]) / self.window
                now = sum(m["reward/em"] for m in recent) / len(recent)
                messages += self._toggle(
                    "reward_fall", start > 0.1 and now < start / 2, metrics,
                    f"the sampled exact match fell from {start:.3f} (first {self.window} steps) to {now:.3f} "
                    f"(last {self.window}): the policy is getting worse at answering")
        # overall first ("val"), then each data source that reports its own count ("val/<source>")
        prefixes = ["val"] + sorted(k[:-len("/em")] for k in metrics
                                    if k.startswith("val/") and k.endswith("/em") and k.count("/") == 2)
        for prefix in prefixes:
            if f"{prefix}/em" in metrics and f"{prefix}/n" in metrics:
                messages += self._check_validation(prefix, float(metrics[f"{prefix}/em"]),
                                                   float(metrics[f"{prefix}/n"]), metrics)
        return messages

    def set_baseline(self, record: dict) -> None:
        """Compare every later validation with `record` (a logged validation: `val/em`, `val/n`, and
        per source `val/<source>/em`, `val/<source>/n`) instead of with this run's first one."""
        for key, value in record.items():
            if key.startswith("val/") and key.endswith("/em") and f"{key[:-len('/em')]}/n" in record:
                prefix = key[:-len("/em")]
                self._first_val[prefix] = (float(value), float(record[f"{prefix}/n"]))

    def replay(self, records) -> None:
        """Feed logged records of this run again (after a resume) to restore the windows, the first
        validation and which alarms are active, without printing anything."""
        for record in records:
            self.check(dict(record))

    def _check_validation(self, prefix: str, em: float, n: float, metrics: dict) -> list[str]:
        """Compare a validation EM with the first one of the same prefix (two binomial standard errors)."""
        if prefix not in self._first_val:
            self._first_val[prefix] = (em, n)
            return []
        em0, n0 = self._first_val[prefix]
        se = math.sqrt(max(em0 * (1 - em0), 1e-6) / max(n0, 1) + max(em * (1 - em), 1e-6) / max(n, 1))
        source = prefix[len("val/"):]
        name, what = ("validation", "validation EM") if prefix == "val" else (
            f"validation/{source}", f"validation EM on {source} (n={n:.0f})")
        return self._toggle(
            name, em < em0 - 2 * se, metrics,
            f"{what} {em:.3f} is below the first validation's {em0:.3f} by more than two standard "
            f"errors ({2 * se:.3f}): training has made the model worse on held-out questions")

    def _toggle(self, name: str, on: bool, metrics: dict, text: str) -> list[str]:
        metrics[f"alarm/{name}"] = float(on)
        if on and name not in self._active:
            self._active.add(name)
            self.fired.append(name)
            return [f"ALARM ({name}): {text}"]
        if not on and name in self._active:
            self._active.discard(name)
            return [f"alarm cleared ({name})"]
        return []


def read_history(path, upto_step: int | None = None) -> list[dict]:
    """The records of a metrics.jsonl as the latest attempt of the run left them.

    metrics.jsonl is appended to: a run restarted from a checkpoint (or from scratch, trainer.resume=none,
    in the same output_dir) logs its steps again. A record whose step is not after the previous one
    starts a new attempt from that step, so the records of earlier attempts from that step on are dropped.
    Records after `upto_step` are left out (a resume from an earlier checkpoint redoes them).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics log at {path}: give the metrics.jsonl of a run (or its output_dir)")
    history: list[dict] = []
    # read_metrics skips a torn line (a crash mid-write), which is exactly the log a resume finds
    for number, record in enumerate(read_metrics(path), 1):
        try:
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: record {number} is not a metrics record with a step ({err}); "
                             f"is this a trainer's metrics.jsonl?") from None
        if history and step <= history[-1]["step"] and not _same_step_next_record(history, record):
            history = [r for r in history if r["step"] < step]
        history.append(record)
    return [r for r in history if upto_step is None or r["step"] <= upto_step]


def _same_step_next_record(history: list[dict], record: dict) -> bool:
    """The last step of a run logs its training record and then the final validation under one step
    number: a record with `val/em` after one without, at the same step, continues the attempt."""
    last = history[-1]
    return record["step"] == last["step"] and "val/em" in record and "val/em" not in last


def first_validation(path) -> dict:
    """The first validation record (the one with `val/em`) in a run's metrics.jsonl, for `set_baseline`."""
    for record in read_history(path):
        if "val/em" in record:
            return record
    raise ValueError(f"{path} holds no validation record (val/em): the run never validated; give a run "
                     f"that validated before training (trainer.val_before_train=true)")
