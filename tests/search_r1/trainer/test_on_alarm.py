"""trainer.on_alarm on a scripted run: the fit loop with a stand-in worker group (checkpoints are real
CheckpointManager directories holding a marker file instead of weights) and a scripted train_step
whose K3 KL trips the drift alarm; no model, no retriever. Checked: warn goes on; stop saves and
raises AlarmStop naming the alarm and step; rollback restores the last checkpoint before the alarm's
window, drops the abandoned newer ones, scales lr and KL, logs alarm/rollbacks, and stops once
trainer.max_rollbacks are spent."""
from __future__ import annotations

from pathlib import Path

import pytest

from search_r1.trainer.alarms import AlarmStop
from search_r1.trainer.checkpoint import CheckpointManager
from search_r1.trainer.config import TrainConfig
from search_r1.trainer.ray_trainer import RayGRPOTrainer


class Weights:
    """A model whose only state is the step it was trained to."""

    def __init__(self):
        self.step = 0

    def save_pretrained(self, directory):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "step.txt").write_text(str(self.step))


class FakeGroup:
    """The worker-group methods the fit loop calls (ONE_TO_ALL: a list with one result)."""

    world_size = 1

    def __init__(self):
        self.model = Weights()
        self.lr = 1.0e-5
        self.kl_coef = None
        self.loads = []

    def save_checkpoint(self, root, step, keep_last, extra, loader_state, rng_state):
        path = CheckpointManager(root, keep_last=keep_last).save(step, self.model, extra_state=extra,
                                                                 dataloader_state=loader_state, rng_state=rng_state)
        return [str(path)]

    def load_checkpoint(self, path):
        self.model.step = int((Path(path) / "model" / "step.txt").read_text())
        self.loads.append(self.model.step)
        from search_r1.trainer.checkpoint import load_checkpoint

        state = load_checkpoint(path)
        return [{"step": state["step"], "extra_state": state["extra_state"], "dataloader": state["dataloader"],
                 "rng": state["rng"]}]

    def reference_identity(self):
        return [None]

    def rescale(self, lr_factor, kl_coef):
        self.lr *= lr_factor
        self.kl_coef = kl_coef
        return [self.lr]


class Loader:
    epoch = 0

    def __init__(self):
        self.position = 0

    def next_batch(self):
        self.position += 1
        return None

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def make_trainer(tmp_path, kl_script, **trainer):
    cfg = TrainConfig.from_dict({
        "algorithm": {"kl_coef": 0.001},
        "trainer": {"total_steps": 6, "save_freq": 1, "keep_last": 10, "test_freq": 0, "val_before_train": False,
                    "resume": "none", "kl_alarm": 0.1, "alarm_window": 2, "output_dir": str(tmp_path), **trainer},
        "warmstart": {"enabled": False}})
    group = FakeGroup()
    t = RayGRPOTrainer(cfg, None, group, None, Loader(), None, checkpoint_root=tmp_path / "checkpoints")

    def train_step(batch, step):  # the update moves the weights one step; KL as scripted
        group.model.step = step
        assert t.train_loader.position == step  # the data position follows the restored checkpoint
        return {"reward/mean": 1.0, "reward/em": 0.5, "actor/kl_loss": kl_script(step, t.rollbacks)}

    t.train_step = train_step
    t.validate = lambda step=0: {}
    return t, group


def drift_at_4(step, rollbacks):
    # window 2: steps 3-4 average (0 + 0.5) / 2 = 0.25 > 0.1 -> the drift alarm starts at step 4
    return 0.5 if step >= 4 and rollbacks == 0 else 0.0


def test_warn_goes_on(tmp_path):
    t, group = make_trainer(tmp_path, drift_at_4)
    summary = t.fit()
    records = [h for h in summary["history"] if "reward/em" in h]
    assert [h["step"] for h in records] == [1, 2, 3, 4, 5, 6] and records[3]["alarm/drift"] == 1.0
    assert group.loads == [] and "alarm/rollbacks" not in records[0]


def test_stop_saves_and_names_the_alarm_and_step(tmp_path):
    t, group = make_trainer(tmp_path, drift_at_4, on_alarm="stop", save_freq=0)
    with pytest.raises(AlarmStop, match=r"alarm \(drift\) at step 4.*on_alarm=stop.*global_step_4"):
        t.fit()
    saved = CheckpointManager(tmp_path / "checkpoints", keep_last=None).checkpoints()
    assert [s for s, _ in saved] == [4]
    assert AlarmStop.exit_code != 0


def test_rollback_restores_before_the_window_and_goes_on_with_the_changes(tmp_path, capsys):
    t, group = make_trainer(tmp_path, drift_at_4, on_alarm="rollback", rollback_lr_scale=0.5,
                            rollback_kl_coef_scale=2.0)
    summary = t.fit()
    # alarm at step 4, window of 2 steps (3-4): the last checkpoint at or before step 2 is restored
    assert group.loads == [2]
    assert group.lr == pytest.approx(0.5e-5) and group.kl_coef == pytest.approx(0.002)
    assert t.cfg.algorithm.kl_coef == pytest.approx(0.002)
    out = capsys.readouterr()
    assert "ROLLBACK 1/2 on alarm (drift) at step 4: restored step 2" in out.out + out.err
    steps = [(h["step"], h["alarm/rollbacks"]) for h in summary["history"] if "reward/em" in h]
    assert steps == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0), (6, 1.0)]  # steps 3-4 redone
    # the abandoned steps' checkpoints were dropped and redone; the run ends at step 6, saved
    ckpts = CheckpointManager(tmp_path / "checkpoints", keep_last=None)
    assert [s for s, _ in ckpts.checkpoints()] == [0, 1, 2, 3, 4, 5, 6]
    from search_r1.trainer.checkpoint import read_extra_state

    assert read_extra_state(ckpts.latest())["rollbacks"] == 1


def test_rollback_stops_once_the_rollbacks_are_spent(tmp_path):
    always = lambda step, rollbacks: 0.5 if step >= 4 else 0.0  # noqa: E731  the drift comes back
    t, group = make_trainer(tmp_path, always, on_alarm="rollback", max_rollbacks=1)
    with pytest.raises(AlarmStop, match=r"alarm \(drift\) at step 4; the 1 rollbacks allowed .*max_rollbacks"):
        t.fit()
    assert group.loads == [2] and t.rollbacks == 1


def test_rollback_without_an_old_enough_checkpoint_stops_with_the_fix(tmp_path):
    t, group = make_trainer(tmp_path, drift_at_4, on_alarm="rollback", keep_last=1)
    with pytest.raises(AlarmStop, match=r"no checkpoint at or before step 2 .*raise trainer.keep_last"):
        t.fit()


def test_time_budget_stops_before_a_step_that_would_end_past_it(tmp_path, monkeypatch, capsys):
    """Scripted clock: the first validation takes 100 s, each step 60 s; a 5-minute budget fits step
    1 (100 + 60 + 100 = 260 s with the final validation) but not step 2 (160 + 60 + 100 = 320 s)."""
    from search_r1.trainer import ray_trainer

    now = [0.0]
    monkeypatch.setattr(ray_trainer, "_clock", lambda: now[0])
    t, group = make_trainer(tmp_path, drift_at_4, time_budget_minutes=5, val_before_train=True, save_freq=0,
                            kl_alarm=0)
    scripted_step = t.train_step

    def step(batch, i):
        now[0] += 60
        return {**scripted_step(batch, i), "timing/step": 60.0}

    def validate(step=0):
        now[0] += 100
        return {"timing/validate": 100.0}

    t.train_step, t.validate = step, validate
    summary = t.fit()
    assert summary["time_budget_stop"] == 1
    assert [h["step"] for h in summary["history"]] == [0, 1, 1]  # before, step 1, the final validation
    assert [s for s, _ in CheckpointManager(tmp_path / "checkpoints", keep_last=None).checkpoints()] == [1]
    out = capsys.readouterr()
    assert ("time budget: stopping after step 1 of 6 (trainer.time_budget_minutes=5: 2.7 min spent, a step "
            "takes up to 60 s and the final validation about 100 s") in out.out + out.err
    # no budget: every step
    now[0] = 0.0
    t2, _ = make_trainer(tmp_path / "free", drift_at_4, kl_alarm=0)
    assert "time_budget_stop" not in t2.fit() and t2.global_step == 6


def test_budget_stop_reason_is_the_sum_against_the_budget():
    from search_r1.trainer.ray_trainer import budget_stop_reason

    assert budget_stop_reason(0, 1e9, 1e9, 1e9) is None  # no budget
    assert budget_stop_reason(300, 100, 100, 100) is None  # exactly at the budget still fits
    assert "past the 5 min budget" in budget_stop_reason(300, 100, 100, 101)
