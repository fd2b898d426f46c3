"""MetricsLogger (jsonl / TensorBoard / console / wandb offline) and plot_training_curves."""
from __future__ import annotations

import importlib.util
import json
import math
import os

import numpy as np
import pytest
import torch

from search_r1.trainer.metrics import (MetricsLogger, per_source_training_metrics, plot_training_curves,
                                      read_metrics)


def _fake_run(n=6):
    """Metrics shaped like the trainer's, with a rising reward and validation every 3 steps."""
    out = []
    for step in range(1, n + 1):
        m = {"reward/mean": 0.1 * step, "reward/em": 0.05 * step, "actor/kl_loss": 0.001 * step,
             "actor/pg_loss": -0.01 * step, "actor/entropy": 2.0 - 0.1 * step, "response/length_mean": 40 + step,
             "timing/step": 1.5}
        if step % 3 == 0:
            m.update({"val/em": 0.2, "val/f1": 0.3, "val/nq/em": 0.2, "val/n": 8.0})
        out.append((step, m))
    return out


def test_jsonl_records_each_call_flushed(tmp_path):
    log = MetricsLogger(tmp_path, loggers=["jsonl"], config={"lr": 1e-6})
    log.log({"reward/mean": 0.5, "count": 3, "ok": True, "t": torch.tensor(2.5), "n": np.float32(1.5)}, step=1)
    # Readable before close: flushed per call, so a crash keeps what was logged.
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["reward/mean"] == 0.5 and first["count"] == 3.0
    assert first["ok"] == 1.0 and first["t"] == 2.5 and first["n"] == 1.5
    assert isinstance(first["time"], float)
    log.log({"reward/mean": 0.7}, step=2)
    log.close()
    with pytest.raises(RuntimeError, match="after close"):
        log.log({"reward/mean": 0.8}, step=3)
    log.close()  # idempotent
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-6}
    # A resumed run appends to the same record.
    with MetricsLogger(tmp_path, loggers=["jsonl"]) as log2:
        log2.log({"reward/mean": 0.9}, step=3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_nonfinite_values_become_null_with_warning_key(tmp_path, caplog):
    with MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard", "console"]) as log:
        log.log({"actor/pg_loss": float("nan"), "actor/grad_norm": float("inf"), "reward/mean": 1.0}, step=4)
    rec = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert rec["actor/pg_loss"] is None and rec["actor/grad_norm"] is None
    assert rec["nonfinite"] == ["actor/pg_loss", "actor/grad_norm"]
    assert rec["reward/mean"] == 1.0
    assert "non-finite" in caplog.text
    # The file stays strict JSON (no NaN tokens).
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "rew')
    assert read_metrics(p) == [{"step": 1, "reward/mean": 0.1}]


def test_tensorboard_event_file_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, loggers=["tensorboard"]) as log:
        for step, m in _fake_run():
            log.log(m, step)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"]
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [round(e.value, 5) for e in events] == [round(0.1 * s, 5) for s in range(1, 7)]
    assert [e.step for e in acc.Scalars("val/em")] == [3, 6]


def test_console_line_uses_tqdm_write(tmp_path, capsys):
    with MetricsLogger(tmp_path, loggers=["console"]) as log:
        log.log({"reward/mean": 0.25, "actor/kl_loss": 0.0012, "other": 5.0}, step=7)
    out = capsys.readouterr().out
    assert out.strip() == "step 7 | reward 0.25 | kl 0.0012"
    assert not (tmp_path / "metrics.jsonl").exists()  # only the loggers asked for


def test_unknown_logger_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown logger.*'mlflow'.*'console', 'jsonl', 'tensorboard', 'wandb'"):
        MetricsLogger(tmp_path, loggers=["jsonl", "mlflow"])


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, loggers=["wandb"])


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with MetricsLogger(tmp_path, loggers=["wandb", "jsonl"], project="test", run_name="offline-run",
                       config={"seed": 1}) as log:
        for step, m in _fake_run(3):
            log.log(m, step)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, f"no offline run dir in {list((tmp_path / 'wandb').iterdir())}"
    assert any(p.suffix == ".wandb" and p.stat().st_size > 0 for p in runs[0].iterdir())


def test_plot_training_curves(tmp_path):
    with MetricsLogger(tmp_path, loggers=["jsonl"]) as log:
        for step, m in _fake_run():
            log.log(m, step)
        log.log({"reward/mean": float("nan")}, step=7)  # nulls are skipped, not plotted
    png = plot_training_curves(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image as mpimg

    img = mpimg.imread(png)
    # 6 train panels + val/em + val/f1 = 8 panels -> a 3x3 grid (one empty): 300 px per row at dpi 100.
    assert img.shape[0] == 900 and img.shape[1] == 1260
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_plot_handles_missing_keys_and_explicit_keys(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(3)))
    one = plot_training_curves(p, tmp_path / "one.png")
    import matplotlib.image as mpimg

    assert mpimg.imread(one).shape[:2] == (300, 420)  # only the reward panel exists
    picked = plot_training_curves(p, tmp_path / "picked.png", keys=["reward/mean", "not/there"])
    assert mpimg.imread(picked).shape[:2] == (300, 420)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_training_curves(empty, tmp_path / "empty.png").stat().st_size > 1000


def test_plot_has_a_panel_for_the_rollout_vs_old_gap(tmp_path):
    import matplotlib.image as mpimg

    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "reward/mean": s / 10, "training/rollout_log_probs_diff_mean": 0.01})
                         + "\n" for s in range(3)))
    assert mpimg.imread(plot_training_curves(p, tmp_path / "two.png")).shape[:2] == (300, 840)  # two panels


def test_per_source_training_metrics_hand_computed():
    # two groups of 2: a two-hop group scored alike (advantage 0), a single-hop group that differs,
    # where the one-search sample was right and the two-search one wrong
    sources = ["synth_hotpotqa", "synth_hotpotqa", "synth_nq", "synth_nq"]
    out = per_source_training_metrics(sources, em=[0, 0, 1, 0], advantages=[0.0, 0.0, 0.7, -0.7],
                                      scores=[0.5, 0.5, 2.5, 0.5], searches=[2, 2, 1, 2])
    assert out == {
        "reward/synth_hotpotqa/em": 0.0, "reward/synth_hotpotqa/mean": 0.5, "adv/synth_hotpotqa/zero_group_share": 1.0,
        "env/synth_hotpotqa/searches_mean": 2.0, "env/synth_hotpotqa/share_searches2": 1.0,
        "reward/synth_hotpotqa/em_searches2": 0.0, "adv/synth_hotpotqa/mean_searches2": 0.0,
        "reward/synth_nq/em": 0.5, "reward/synth_nq/mean": 1.5, "adv/synth_nq/zero_group_share": 0.0,
        "env/synth_nq/searches_mean": 1.5,
        "env/synth_nq/share_searches1": 0.5, "reward/synth_nq/em_searches1": 1.0, "adv/synth_nq/mean_searches1": 0.7,
        "env/synth_nq/share_searches2": 0.5, "reward/synth_nq/em_searches2": 0.0, "adv/synth_nq/mean_searches2": -0.7,
    }


def test_per_source_training_metrics_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="lengths differ"):
        per_source_training_metrics(["a", "b"], em=[1], advantages=[0.0, 0.0], scores=[1.0, 1.0], searches=[1, 1])
