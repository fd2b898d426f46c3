"""The recipe card (verl_ext/recipe.py): grpo_verl's schedule through verl 0.9.1's own normalisation,
beside upstream Search-R1's; every line equal unless declared; verl's own rules really drive it
(the mini-batch times rollout.n, the lr scheduler, the estimator's std); impossible schedules are
refused before Ray; the card is printed by --dry-run and written to the run directory at start."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from verl_ext.recipe import (CARD_FILE, DECLARED, LINES, UPSTREAM, ScheduleError, format_card, recipe_card,
                             recipe_lines)

from tests.verl_ext.helpers import REPO, verl_config


def by_key(lines):
    return {x.key: x for x in lines}


def test_grpo_verl_equals_upstream_on_every_undeclared_line():
    lines = recipe_lines(verl_config())
    declared = {k for d in DECLARED for k in d.keys}
    undeclared = [(x.label, x.ours, x.upstream) for x in lines if x.differs and x.key not in declared]
    assert not undeclared, undeclared
    stale = sorted(declared - {x.key for x in lines if x.differs})
    assert not stale, f"declared differences that are not differences: {stale}"
    assert [x.key for x in lines] == [k for k, _ in LINES] and set(UPSTREAM) == {k for k, _ in LINES}
    v = {k: x.ours for k, x in by_key(lines).items()}
    # 480 prompts x 5 = 2400 trajectories; 48 x 5 = 240 per update -> 2400 / 240 = 10 updates
    # (upstream: 2560 / 256 = 10); each of 8 GPUs: 240 / 8 = 30 per update in micro-batches of 5 -> 6.
    assert (v["prompts_per_step"], v["trajectories_per_step"], v["updates_per_step"],
            v["trajectories_per_update"], v["micro_batches"]) == ("480", "2400", "10", "240", "6 x 5 trajectories (8 GPUs)")
    # int(0.285 x 1005) = 286 warmup steps, as upstream's get_constant_schedule_with_warmup
    assert v["lr"] == "1e-06, linear warmup over 286 steps, then constant"


def test_verls_own_rules_drive_the_card():
    """Each of the issue's silent differences shows on the card when its old setting comes back."""
    old = by_key(recipe_lines(verl_config(
        data__train_batch_size=512, actor_rollout_ref__actor__ppo_mini_batch_size=256,
        actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu=8,
        actor_rollout_ref__actor__clip_ratio_c=3.0, algorithm__adv_estimator="search_r1_grpo")))
    # verl multiplies ppo_mini_batch_size by rollout.n: 256 x 5 = 1280 trajectories, 2560 / 1280 = 2
    assert (old["trajectories_per_update"].ours, old["updates_per_step"].ours) == ("1280", "2")
    assert old["micro_batches"].ours == "20 x 8 trajectories (8 GPUs)"  # 1280 / 8 GPUs / 8
    assert old["clip"].ours == "ratio in [0.8, 1.2], dual-clip at 3 x |A|" and old["clip"].differs
    assert old["advantage"].ours.startswith("GRPO: (r - group mean) / (population std")
    # verl's vanilla loss reads clip_ratio_low/high; clip_ratio alone would not move the range
    assert by_key(recipe_lines(verl_config(actor_rollout_ref__actor__clip_ratio_high=0.28)))["clip"].ours \
        == "ratio in [0.8, 1.28], no dual-clip"
    lr = by_key(recipe_lines(verl_config(actor_rollout_ref__actor__optim__lr_scheduler_type="cosine",
                                         actor_rollout_ref__actor__optim__min_lr_ratio=0.1)))["lr"].ours
    assert lr == "1e-06, linear warmup over 286 steps, then cosine to 1e-07 at step 1005"  # min_lr_ratio 0.1
    assert by_key(recipe_lines(verl_config(algorithm__norm_adv_by_std_in_grpo=False)))["advantage"].ours \
        == "GRPO: r - group mean (no std, Dr. GRPO)"
    sampled = by_key(recipe_lines(verl_config(actor_rollout_ref__rollout__val_kwargs__temperature=1.0,
                                              actor_rollout_ref__rollout__val_kwargs__top_p=0.95)))
    assert not sampled["validation"].differs  # the declared switch restores upstream's value


def test_overrides_show_as_undeclared_differences():
    cfg = verl_config(actor_rollout_ref__actor__kl_loss_coef=0.01, trainer__n_gpus_per_node=4)
    card = recipe_card(cfg, "grpo_verl")
    assert "on 4 GPUs" in card and "12 x 5 trajectories (4 GPUs)" in card  # 240 / 4 GPUs = 60 per GPU, 5 each
    assert card.splitlines()[-1] == "Other differences (overrides or another config): KL"
    assert "Deliberate differences of configs/grpo_verl.yaml:" in card and "Switch: data.train_batch_size=512" in card
    # another config: nothing of grpo_verl's is declared for it
    other = format_card(recipe_lines(cfg), "my_config", 4)
    tail = other[other.index("Other differences"):]
    assert "Deliberate differences" not in other and "prompts per step" in tail and "validation decoding" in tail


@pytest.mark.parametrize("override, message", [
    ({"trainer__n_gpus_per_node": 7},
     r"ppo_mini_batch_size=48 x rollout.n=5 = 240 trajectories per update is not divisible by the 7 "
     r"data-parallel GPUs"),
    ({"actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu": 8},
     r"ppo_micro_batch_size_per_gpu=8 does not divide the 30 trajectories each GPU gets per update"),
    ({"trainer__nnodes": 2, "actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu": 6},  # 240 / 16 = 15
     r"ppo_micro_batch_size_per_gpu=6 does not divide the 15 trajectories"),
])
def test_schedules_verl_would_reject_fail_before_ray(override, message):
    with pytest.raises(ScheduleError, match=message):
        recipe_lines(verl_config(**override))


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("SEARCH_R1_FORCE_CPU", None)
    return env


def test_real_start_writes_and_prints_the_card(tmp_path, retriever_server):
    """verl_ext.main without --dry-run, up to verl's run_ppo (replaced by a recorder, and the GPU check
    passed: no GPU here)."""
    data = tmp_path / "d.parquet"
    data.write_bytes(b"")
    run_dir = tmp_path / "run"
    code = ("import sys, runpy, torch, verl.trainer.main_ppo as m\n"
            "torch.cuda.is_available = lambda: True\n"
            "m.run_ppo = lambda config, task_runner_class: print('RUN_PPO', config.trainer.default_local_dir)\n"
            "sys.argv = ['verl_ext.main'] + sys.argv[1:]\n"
            "runpy.run_module('verl_ext.main', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code, f"data.train_files={data}",
                          f"data.val_files={data}", f"trainer.default_local_dir={run_dir}",
                          f"search_r1.retriever.urls=[{retriever_server.url}]"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    written = (run_dir / CARD_FILE).read_text()
    assert written.startswith("Recipe card: grpo_verl on 8 GPUs") and "optimizer updates per step" in written
    assert written.strip() in out.stdout  # logged at start, identical to the file
    assert out.stdout.index("Recipe card") < out.stdout.index("RUN_PPO")  # before verl's trainer starts


# -- log-prob passes: the micro-batch must divide each GPU's share of the whole step ------------------
@pytest.mark.parametrize("gpus, share", [(1, 2400), (2, 1200), (4, 600), (8, 300), (16, 150)])
def test_shipped_log_prob_micro_batches_divide_every_world_size(gpus, share):
    """grpo_verl's 10 divides the share of 1..16 GPUs (verl's prepare_micro_batches on that share)."""
    line = by_key(recipe_lines(verl_config(trainer__n_gpus_per_node=gpus)))["log_prob_micro_batches"].ours
    assert line == f"old-log-prob {share // 10} x 10, reference {share // 10} x 10 trajectories ({gpus} GPUs)"


@pytest.mark.parametrize("key, name", [
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "old-log-prob"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "reference"),
])
def test_a_log_prob_micro_batch_that_does_not_divide_the_share_is_refused(key, name):
    """The old config's 16 on 8 GPUs: 2400 / 8 = 300 per GPU, 300 % 16 = 12 -> verl's AssertionError in
    the first step's old-log-prob pass, after the whole rollout. The card names the key first."""
    with pytest.raises(ScheduleError, match=rf"{re.escape(key)}=16 does not divide the 300 trajectories each of the 8 "
                                            rf"data-parallel GPUs gets per step \(2400 / 8\).*the {name} pass"):
        recipe_lines(verl_config(**{key.replace(".", "__"): 16}))
    # 2 x 8 GPUs (docs/multinode.md): 150 per GPU
    with pytest.raises(ScheduleError, match=r"=16 does not divide the 150 trajectories"):
        recipe_lines(verl_config(trainer__nnodes=2, **{key.replace(".", "__"): 16}))
    # dynamic batch sizing has no divisibility rule
    dynamic = key.replace("micro_batch_size_per_gpu", "use_dynamic_bsz").replace(".", "__")
    extra = {"actor_rollout_ref__actor__use_dynamic_bsz": True} if "rollout" in key else {}
    assert f"{name} dynamic" in by_key(recipe_lines(verl_config(**{key.replace(".", "__"): 16, dynamic: True},
                                                                   **extra)))["log_prob_micro_batches"].ours


def test_the_rule_is_verls_own_prepare_micro_batches():
    """What the card refuses, verl's own function asserts on (and what it accepts, verl accepts)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    def split(rows, micro):
        td = TensorDict({"x": torch.arange(rows)}, batch_size=[rows])
        tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro)
        return len(prepare_micro_batches(td)[0])

    with pytest.raises(AssertionError, match="data size must be divisible"):
        split(300, 16)
    assert split(300, 10) == 30 and split(150, 10) == 15


def test_the_attention_line_declares_sdpa_and_the_switch():
    lines = by_key(recipe_lines(verl_config()))
    assert lines["attention"].ours == "sdpa, padded batches" and lines["attention"].differs
    flash = by_key(recipe_lines(verl_config(actor_rollout_ref__model__override_config__attn_implementation="flash_attention_2",
                                            actor_rollout_ref__model__use_remove_padding=True)))
    assert not flash["attention"].differs  # the declared switch restores upstream's
