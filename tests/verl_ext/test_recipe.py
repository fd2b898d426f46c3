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

from verl_ext.recipe import (CARD_FILE, CRITIC_LINES, DECLARED, DECLARED_PPO, LINES, UPSTREAM, UPSTREAM_PPO,
                             ScheduleError, card_lines, format_card, recipe_card, recipe_lines)

from tests.verl_ext.helpers import REPO, ppo_config, verl_config


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


# -- ppo_verl: upstream's train_ppo.sh, the critic's schedule ----------------------------------------
def test_ppo_verl_equals_upstream_ppo_on_every_undeclared_line():
    """ppo_verl's card is beside train_ppo.sh's values (not train_grpo.sh's), with the critic's lines."""
    lines = recipe_lines(ppo_config())
    assert [x.key for x in lines] == [k for k, _ in card_lines(True)]
    assert set(UPSTREAM_PPO) == {k for k, _ in LINES + CRITIC_LINES}
    declared = {k for d in DECLARED_PPO for k in d.keys}
    undeclared = [(x.label, x.ours, x.upstream) for x in lines if x.differs and x.key not in declared]
    assert not undeclared, undeclared
    stale = sorted(declared - {x.key for x in lines if x.differs})
    assert not stale, f"declared differences that are not differences: {stale}"
    v = {k: x.ours for k, x in by_key(lines).items()}
    # 512 prompts x n 1; mini-batch 256 -> 2 updates (upstream the same); 256 / 8 GPUs = 32 per GPU in 4s -> 8;
    # each GPU's 512 / 8 = 64 trajectories in log-prob micro-batches of 8 -> 8
    assert (v["prompts_per_step"], v["group_size"], v["trajectories_per_step"], v["updates_per_step"],
            v["trajectories_per_update"]) == ("512", "1", "512", "2", "256")
    assert v["micro_batches"] == "8 x 4 trajectories (8 GPUs)"
    assert v["log_prob_micro_batches"] == "old-log-prob 8 x 8, reference 8 x 8 trajectories (8 GPUs)"
    # int(0.95 x 305) = 289 actor warmup steps; int(0.05 x 305) = 15 for the critic (upstream's ratios)
    assert v["lr"] == "1e-06, linear warmup over 289 steps, then constant"
    assert v["critic_lr"] == "1e-05, linear warmup over 15 steps, then constant"
    assert (v["kl"], v["critic_model"], v["critic_updates"]) == \
        ("kl in the reward, fixed coef 0.001", "the actor's model + value head", "2 x 256 trajectories")
    # the critic: 32 per GPU per update in 4s, the values pass over each GPU's 64 in 8s
    assert v["critic_micro_batches"] == "update 8 x 4, values 8 x 8 trajectories (8 GPUs)"
    # verl's GAE and value loss, run on a probe with an observation token, skip it
    assert v["advantage"] == "GAE: gamma 1, lambda 1, whitened; observation tokens skipped"
    assert v["value_loss"].endswith("token-mean over each mini-batch; observation tokens skipped")
    card = recipe_card(ppo_config(), "ppo_verl")
    assert "upstream Search-R1's train_ppo.sh on 4 GPUs" in card.splitlines()[0]
    assert "Deliberate differences of configs/ppo_verl.yaml:" in card and "Other differences" not in card
    # the GRPO card keeps its own lines and upstream
    assert "critic" not in recipe_card(verl_config(), "grpo_verl")


def test_ppo_micro_batch_switch_gives_upstreams_lines():
    """The declared switch (4 GPUs, upstream's micro-batches per GPU) makes all three micro-batch lines
    equal upstream's: the card computes them the way upstream's early verl split them."""
    switch = next(d.switch for d in DECLARED_PPO if "critic_micro_batches" in d.keys)
    overrides = {k.replace(".", "__"): int(v) for k, v in (item.split("=") for item in switch.split())}
    lines = by_key(recipe_lines(ppo_config(**overrides)))
    assert [lines[k].differs for k in ("micro_batches", "log_prob_micro_batches", "critic_micro_batches")] == \
        [False, False, False]


@pytest.mark.parametrize("gpus, update, share", [(1, 256, 512), (2, 128, 256), (4, 64, 128), (8, 32, 64), (16, 16, 32)])
def test_shipped_critic_micro_batches_divide_every_world_size(gpus, update, share):
    """ppo_verl's critic micro-batches (4 per update, 8 per values pass) divide each GPU's share on 1..16
    GPUs, through verl's prepare_micro_batches with the sizes of verl's typed critic engine config."""
    nodes = {"trainer__nnodes": 2, "trainer__n_gpus_per_node": 8} if gpus == 16 else {"trainer__n_gpus_per_node": gpus}
    lines = by_key(recipe_lines(ppo_config(**nodes)))
    assert lines["critic_micro_batches"].ours == \
        f"update {update // 4} x 4, values {share // 8} x 8 trajectories ({gpus} GPUs)"
    assert lines["micro_batches"].ours == f"{update // 4} x 4 trajectories ({gpus} GPUs)"


@pytest.mark.parametrize("override, message", [
    # 256 / 8 GPUs = 32 per GPU per critic update; 32 % 3 != 0
    ({"critic__ppo_micro_batch_size_per_gpu": 3},
     r"critic.ppo_micro_batch_size_per_gpu=3 \(critic.fsdp.micro_batch_size_per_gpu, what verl's critic worker "
     r"reads\) does not divide the 32 trajectories each GPU gets per critic update.*the critic's update pass"),
    # each GPU's share of the step: 512 / 8 = 64; 64 % 5 != 0
    ({"critic__forward_micro_batch_size_per_gpu": 5},
     r"critic.forward_micro_batch_size_per_gpu=5 .* does not divide the 64 trajectories each GPU gets per step "
     r"\(512 / 8\).*the critic's values pass"),
    # 2 x 8 GPUs: 256 / 16 = 16 per GPU per update; 16 % 32 != 0
    ({"trainer__nnodes": 2, "critic__ppo_micro_batch_size_per_gpu": 32}, r"=32 .*does not divide the 16 trajectories"),
    # 100 trajectories per critic update over 8 GPUs
    ({"critic__ppo_mini_batch_size": 100},
     r"critic.ppo_mini_batch_size=100 x rollout.n=1 = 100 trajectories per critic update is not divisible by the 8"),
])
def test_a_critic_schedule_verl_would_reject_fails_before_ray(override, message):
    with pytest.raises(ScheduleError, match=message):
        recipe_lines(ppo_config(**override))


def test_the_critic_line_shows_what_verls_critic_worker_runs():
    """verl 0.9.1's v1 trainer builds the critic worker from critic.fsdp (an engine config whose
    use_dynamic_bsz defaults to true) and does not copy critic.ppo_micro_batch_size_per_gpu into it:
    without ppo_verl's three wiring lines the critic runs token-budgeted micro-batches, and the card
    says so instead of checking a micro-batch nobody reads."""
    dynamic = by_key(recipe_lines(ppo_config(critic__fsdp__use_dynamic_bsz=True,
                                             critic__ppo_micro_batch_size_per_gpu=3)))
    assert dynamic["critic_micro_batches"].ours == "dynamic, <= 32768 tokens each (8 GPUs)"
    with pytest.raises(ScheduleError, match=r"critic.fsdp.micro_batch_size_per_gpu is not set"):
        recipe_lines(ppo_config(critic__fsdp__micro_batch_size_per_gpu=None))


def test_dry_run_path_refuses_a_bad_critic_micro_batch():
    """What verl_ext.main --dry-run runs before printing the card: the config checks pass (verl's own
    critic validation included, without downloading the critic model), the card refuses the schedule."""
    from verl_ext.main import check_config

    cfg = ppo_config(critic__ppo_micro_batch_size_per_gpu=6)
    assert all("does not exist" in w for w in check_config(cfg, dry_run=True))
    with pytest.raises(ScheduleError, match=r"critic.ppo_micro_batch_size_per_gpu=6"):
        recipe_card(cfg, "ppo_verl")
