"""The GPU rehearsal really runs verl's trainer and catches, at run time, the crash the recipe card
predicts: a GPU-shaped config whose old-log-prob micro-batch does not divide each data-parallel
worker's share of the step. The card's static check is switched off for this run, so it is verl's own
engine that fails, in the old-log-prob pass after the first rollout, and the rehearsal that names the
key. (The full 8-worker rehearsal of the shipped grpo_verl is a command, not a test: docs/guides/
verl-gpu.md has its wall time and memory.)"""
from __future__ import annotations

import re

import pytest

from verl_ext.recipe import ScheduleError, recipe_lines
from verl_ext.rehearsal import rehearse

from tests.verl_ext.helpers import verl_config

KEY = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.budget(360, reason="verl's trainer starting with 2 workers and one rollout: 126-133 s alone on a "
                                "2-core AVX2 EPYC, 189 s in make test's two workers (2026-12-07)")
def test_rehearsal_catches_a_log_prob_micro_batch_that_does_not_divide_the_share(capsys):
    # 2 workers, 2 prompts x 3 samples = 6 trajectories: 3 per worker; updates split 3 = 1 x 3, but the
    # old-log-prob micro-batch of 2 does not divide 3 (the shape of grpo_verl's old 16 on 8 GPUs: 300 % 16)
    cfg = verl_config(trainer__n_gpus_per_node=2, data__train_batch_size=2, actor_rollout_ref__rollout__n=3,
                      actor_rollout_ref__actor__ppo_mini_batch_size=2,
                      actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=3,
                      actor_rollout_ref__ref__log_prob_micro_batch_size_per_gpu=3,
                      trainer__val_before_train=False, trainer__experiment_name="rehearsal_test",
                      **{KEY.replace(".", "__"): 2})
    cfg.actor_rollout_ref.model.path = "Qwen/Qwen3-4B"  # the stand-in: tiny-random-qwen3
    with pytest.raises(ScheduleError, match=rf"{KEY}=2 does not divide the 3 trajectories"):
        recipe_lines(cfg)  # what --dry-run says before anything runs
    rc = rehearse(cfg, source="grpo_verl", warm_start=False, check_schedule=False)
    out = capsys.readouterr().out
    assert rc == 1, out[-4000:]
    verdict = [line for line in out.splitlines() if line.startswith("[rehearsal] rehearsal ")]
    assert verdict and verdict[-1].startswith("[rehearsal] rehearsal failed in phase train: verl's engine stopped "
                                              "the old-log-prob pass: each of the 2 data-parallel workers got "
                                              "about 3 trajectories"), out[-4000:]
    assert f"{KEY}=2 does not divide" in verdict[-1] and "Fix:" in verdict[-1]
    # it said what it changed for the CPU, with both values
    assert "  trainer.n_gpus_per_node" not in out  # the geometry is the config's own: not a change
    # the stand-in: a tiny random Qwen3 with its own 2,048-token vocabulary (the log-prob passes' cost)
    assert re.search(r"  actor_rollout_ref.model.path: Qwen/Qwen3-4B -> \$\{search_r1_model:\S*tiny-random-qwen3-vocab2048\}", out)
    assert "  actor_rollout_ref.rollout.name: vllm -> hf" in out
