"""RunAlarms on hand-made metric streams: each alarm fires once when its window crosses, clears after."""
import json

import pytest

from search_r1.trainer.alarms import RunAlarms, first_validation, read_history


def step(em, kl):
    return {"reward/em": em, "actor/kl_loss": kl}


def test_drift_needs_a_full_window_above_the_threshold():
    alarms = RunAlarms(kl=0.1, window=3)
    assert alarms.check(step(0.5, 0.5)) == []  # one step: no full window yet
    assert alarms.check(step(0.5, 0.0)) == []
    got = alarms.check(step(0.5, 0.0))  # mean (0.5 + 0 + 0) / 3 = 0.167 > 0.1
    assert len(got) == 1 and got[0].startswith("ALARM (drift)") and "0.167" in got[0]
    m = step(0.5, 0.3)  # last three (0, 0, 0.3): 0.1 is not above 0.1 -> cleared, once
    assert alarms.check(m) == ["alarm cleared (drift)"] and m["alarm/drift"] == 0.0
    assert alarms.check(step(0.5, 0.0)) == []


def test_reward_fall_compares_the_last_window_with_the_first():
    alarms = RunAlarms(kl=0, window=2)  # kl 0: the drift alarm is off
    for em in (0.6, 0.6, 0.5):
        assert alarms.check(step(em, 1.0)) == []
    got = alarms.check(step(0.2, 1.0))  # last two: 0.35 >= 0.3 -> no
    assert got == []
    got = alarms.check(step(0.1, 1.0))  # last two: 0.15 < 0.3 = half of 0.6
    assert len(got) == 1 and "fell from 0.600" in got[0] and "0.150" in got[0]


def test_validation_alarm_uses_the_binomial_standard_error():
    alarms = RunAlarms()
    assert alarms.check({"val/em": 0.6, "val/n": 64.0}) == []
    assert alarms.check({"val/em": 0.5, "val/n": 64.0}) == []  # 0.1 < 2 se (~0.17)
    got = alarms.check({"val/em": 0.16, "val/n": 64.0})
    assert len(got) == 1 and got[0].startswith("ALARM (validation)")


def test_validation_alarm_watches_each_data_source():
    """The 3:1 two-hop run of README "Does it learn?": overall 0.734 -> 0.578 stayed inside two standard
    errors (0.166) while single-hop fell 0.938 -> 0.531 (n=32 each); the per-source alarm names it."""
    alarms = RunAlarms()
    first = {"val/em": 0.734, "val/n": 64.0, "val/synth_nq/em": 0.938, "val/synth_nq/n": 32.0,
             "val/synth_hotpotqa/em": 0.531, "val/synth_hotpotqa/n": 32.0}
    assert alarms.check(first) == []
    m = {"val/em": 0.578, "val/n": 64.0, "val/synth_nq/em": 0.531, "val/synth_nq/n": 32.0,
         "val/synth_hotpotqa/em": 0.625, "val/synth_hotpotqa/n": 32.0}
    got = alarms.check(m)
    assert len(got) == 1 and got[0].startswith("ALARM (validation/synth_nq)") and "n=32" in got[0], got
    assert (m["alarm/validation"], m["alarm/validation/synth_nq"], m["alarm/validation/synth_hotpotqa"]) == (0, 1, 0)
    # a source with no count of its own (an older log) is left alone rather than guessed
    assert alarms.check({"val/em": 0.734, "val/n": 64.0, "val/synth_nq/em": 0.9,
                         "val/synth_nq/n": 32.0, "val/other/em": 0.0}) == ["alarm cleared (validation/synth_nq)"]


def test_skipped_updates_count_for_the_reward_but_not_for_the_kl_window():
    alarms = RunAlarms(kl=0.1, window=2)
    assert alarms.check(step(0.6, 0.3)) == []
    assert alarms.check({"reward/em": 0.6}) == []  # update skipped: no KL measured, no full KL window
    got = alarms.check(step(0.6, 0.0))  # the last two KL measurements: (0.3 + 0) / 2 = 0.15 > 0.1
    assert len(got) == 1 and "0.150" in got[0]
    alarms = RunAlarms(kl=0, window=2)
    for em in (0.6, 0.6, 0.2):
        alarms.check({"reward/em": em})
    got = alarms.check({"reward/em": 0.0})  # skipped steps still show the sampled EM falling
    assert len(got) == 1 and "fell from 0.600" in got[0]


def write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_run_without_its_own_before_validation_compares_with_the_baseline():
    """experiment_cpu.sh's later seeds skip the "before" validation: without a baseline their final
    validation became the first one and was compared with nothing."""
    final = {"val/em": 0.3, "val/n": 64.0, "val/synth_hotpotqa/em": 0.1, "val/synth_hotpotqa/n": 32.0}
    alone = RunAlarms()
    assert alone.check(dict(final)) == [] and "alarm/validation" not in final
    alarms = RunAlarms()
    alarms.set_baseline({"step": 0, "val/em": 0.6, "val/n": 64.0, "val/synth_hotpotqa/em": 0.3,
                         "val/synth_hotpotqa/n": 32.0, "val/synth_nq/em": 0.9})  # no n: not a baseline
    m = dict(final)
    got = alarms.check(m)
    assert [g.split(":")[0] for g in got] == ["ALARM (validation)", "ALARM (validation/synth_hotpotqa)"], got
    assert "below the first validation's 0.600" in got[0]
    assert set(alarms._first_val) == {"val", "val/synth_hotpotqa"}


def test_replay_restores_windows_first_validation_and_active_alarms_silently():
    alarms = RunAlarms(kl=0.1, window=2)
    history = [{"step": 0, "val/em": 0.6, "val/n": 64.0}, {"step": 1, **step(0.5, 0.3)},
               {"step": 2, **step(0.5, 0.3)}]  # the drift alarm was on at step 2
    alarms.replay(history)
    assert "alarm/drift" not in history[2]  # the log's records are not changed
    assert alarms.check(step(0.5, 0.3)) == []  # still on: not announced again
    assert alarms.check(step(0.5, 0.0)) == []  # (0.3 + 0) / 2 = 0.15: still on
    assert alarms.check(step(0.5, 0.0)) == ["alarm cleared (drift)"]
    got = alarms.check({"val/em": 0.2, "val/n": 64.0})  # compared with step 0, not taken as the first
    assert len(got) == 1 and "0.600" in got[0]


def test_read_history_keeps_the_latest_attempt(tmp_path):
    val0 = {"step": 0, "val/em": 0.5, "val/n": 4.0}
    log = write_log(tmp_path / "metrics.jsonl", [
        val0, {"step": 1, "reward/em": 0.1}, {"step": 2, "reward/em": 0.2}, {"step": 3, "reward/em": 0.3},
        # crashed after step 3, resumed from the step-1 checkpoint: steps 2 and 3 again, then the end
        {"step": 2, "reward/em": 0.7}, {"step": 3, "reward/em": 0.8}, {"step": 4, "reward/em": 0.9},
        {"step": 4, "val/em": 0.75, "val/n": 4.0}])
    got = read_history(log)
    assert [(r["step"], r.get("reward/em", r.get("val/em"))) for r in got] == [
        (0, 0.5), (1, 0.1), (2, 0.7), (3, 0.8), (4, 0.9), (4, 0.75)]
    assert [r["step"] for r in read_history(tmp_path, upto_step=2)] == [0, 1, 2]  # a run directory works
    assert first_validation(log) == val0
    # trainer.resume=none in the same directory: the earlier run's records are dropped
    write_log(log, [val0, {"step": 1, "reward/em": 0.1}, {"step": 0, "val/em": 0.25, "val/n": 4.0}])
    assert first_validation(log)["val/em"] == 0.25


def test_a_baseline_that_is_not_a_validated_run_is_refused_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics log at"):
        first_validation(tmp_path / "nowhere.jsonl")
    log = write_log(tmp_path / "metrics.jsonl", [{"step": 1, "reward/em": 0.1}])
    with pytest.raises(ValueError, match="never validated.*val_before_train=true"):
        first_validation(log)
    log.write_text('{"step": 1}\n{"val/em": 0.5}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: record 2 is not a metrics record with a step"):
        first_validation(log)


def test_a_torn_line_from_a_crash_does_not_block_the_resume(tmp_path):
    """A run killed mid-write leaves half a line, and the resumed run appends after it."""
    log = write_log(tmp_path / "metrics.jsonl", [{"step": 0, "val/em": 0.5, "val/n": 4.0}, {"step": 1, "reward/em": 0.1}])
    with open(log, "a") as f:
        f.write('{"step": 2, "rew')
    assert [r["step"] for r in read_history(log, upto_step=1)] == [0, 1]
    assert first_validation(log)["val/em"] == 0.5
