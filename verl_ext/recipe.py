"""The recipe card: the schedule a verl config will run, beside upstream Search-R1's, before a GPU
hour is spent.

    python -m verl_ext.main --dry-run [--config-name grpo_verl] [key=value ...]   # prints it
    (a real run prints it too and writes it to trainer.default_local_dir/recipe_card.txt)

Every number comes from the composed config through verl 0.9.1's own code, not re-derived here:

    trajectories per update  PPOTrainer._update_actor (actor.ppo_mini_batch_size x rollout.n), run
                             against a worker group that records what it would send
    batch padding            PPOTrainer._get_required_batch_multiple (lcm of the data-parallel
                             size and the mini-batch); verl pads the batch up to a multiple of it
    updates per step         verl.utils.tensordict_utils.make_iterator over one GPU's share, the
                             iterator the training worker runs (one optimizer step per mini-batch)
    micro-batches            verl.workers.engine.utils.prepare_micro_batches on one GPU's mini-batch,
                             and on one GPU's share of the step for the old-log-prob and reference
                             passes (rollout./ref.log_prob_micro_batch_size_per_gpu)
    learning-rate schedule   FSDPEngine._build_lr_scheduler on verl's typed optimizer config, stepped
    advantage                the configured estimator through compute_advantage_for_multi_trajectories
                             on a probe group (scores 1, 0, ..., 0): which std it divides by
    clip, KL, entropy        verl's typed actor config (omega_conf_to_dataclass)
    critic (configs with one: algorithm.adv_estimator=gae, or critic.enable)
                             updates through PPOTrainer._update_critic on a recording worker group;
                             micro-batches through prepare_micro_batches with the sizes of the
                             critic's typed engine config (what verl's critic worker is built with);
                             its lr schedule as the actor's; which tokens GAE and the value loss
                             cover by running verl's compute_advantage and compute_value_loss on a
                             probe with an observation token
    token budgets            verl_ext.agent_loop.SearchR1Settings.generation_config (what the agent
                             loop enforces)

Upstream's column is Search-R1's train_ppo.sh for a config with a critic (UPSTREAM_PPO, below), else
its train_grpo.sh on 8 GPUs with its early-verl defaults
(ppo_trainer.yaml): train batch 512, n_agent 5 with rollout.n 1 (so its ppo_mini_batch_size 256
counted trajectories: 256 // 8 GPUs x n 1 = 32 per GPU), micro-batch 64 // 8 = 8 per GPU, lr 1e-6
with int(0.285 x 1005) = 286 warmup steps then constant, AdamW (0.9, 0.999) weight decay 0.01, grad
clip 1.0, clip 0.2 without dual-clip, entropy 0.001, K3 KL loss 0.001, temperature 1 and top_p 0.95,
max_start_length 2048, 500 generated tokens per turn, 500 per observation, 2 search turns plus a
final one, responses at most 3 x 500 + 2 x 500 = 2500 tokens, rolling context 4096, 1005 steps.
"""
from __future__ import annotations

import math
import os
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf

CARD_FILE = "recipe_card.txt"
# Set by the rehearsal's own test only (verl_ext/rehearsal.py): verl_ext.main then starts a run whose
# schedule the card refuses, so the test can show the rehearsal catching at run time what the card
# catches before it.
SKIP_SCHEDULE_CHECK_ENV = "SEARCH_R1_SKIP_SCHEDULE_CHECK"
WRAP = 110  # column of the card's prose lines
# The config whose deliberate differences DECLARED lists.
SHIPPED = "grpo_verl"
UPSTREAM_GPUS = 8
# The PPO config whose deliberate differences DECLARED_PPO lists; upstream's train_ppo.sh ran on 4 GPUs
# (trainer.n_gpus_per_node=4).
SHIPPED_PPO = "ppo_verl"
UPSTREAM_PPO_GPUS = 4
# verl's vanilla policy loss clamps log(ratio) to [-20, 20]; a dual-clip bound above e^20 never binds.
RATIO_CAP = math.exp(20.0)

# (key, label) in card order.
LINES: tuple[tuple[str, str], ...] = (
    ("prompts_per_step", "prompts per step"),
    ("group_size", "trajectories per prompt (group size)"),
    ("trajectories_per_step", "trajectories per step"),
    ("updates_per_step", "optimizer updates per step"),
    ("trajectories_per_update", "trajectories per update"),
    ("micro_batches", "micro-batches per GPU per update"),
    ("log_prob_micro_batches", "micro-batches per GPU, log-probs"),
    ("attention", "attention (actor, reference)"),
    ("prompt_tokens", "prompt tokens"),
    ("turn_tokens", "generated tokens per turn"),
    ("obs_tokens", "tokens per observation"),
    ("turns", "turns"),
    ("response_tokens", "response tokens per trajectory"),
    ("context_tokens", "context tokens per trajectory"),
    ("kl", "KL"),
    ("loss_agg", "loss aggregation"),
    ("advantage", "advantage"),
    ("clip", "PPO clip"),
    ("entropy", "entropy coefficient"),
    ("lr", "learning rate"),
    ("optimizer", "optimizer"),
    ("grad_clip", "gradient clip (global L2 norm)"),
    ("sampling", "training sampling"),
    ("validation", "validation decoding"),
    ("steps", "steps"),
    ("topk", "passages per search"),
)
# The critic's lines (configs with a critic), in card order after the actor's gradient clip.
CRITIC_LINES: tuple[tuple[str, str], ...] = (
    ("critic_model", "critic model"),
    ("critic_updates", "critic updates per step"),
    ("critic_micro_batches", "critic micro-batches per GPU"),
    ("critic_lr", "critic learning rate"),
    ("critic_optimizer", "critic optimizer"),
    ("value_loss", "value loss"),
)
CRITIC_AFTER = "grad_clip"

TOKEN_MEAN_MINI_BATCH = "token-mean over each mini-batch"
UNBIASED = "GRPO: (r - group mean) / (unbiased std + eps)"
POPULATION = "GRPO: (r - group mean) / (population std + eps)"
CENTRED = "GRPO: r - group mean (no std, Dr. GRPO)"
OBS_SKIPPED = "observation tokens skipped"
OBS_INCLUDED = "observation tokens included"
SAME_MODEL = "the actor's model + value head"

UPSTREAM: dict[str, str] = {
    "prompts_per_step": "512",
    "group_size": "5",
    "trajectories_per_step": "2560",
    "updates_per_step": "10",
    "trajectories_per_update": "256",
    "micro_batches": f"4 x 8 trajectories ({UPSTREAM_GPUS} GPUs)",
    # upstream: log_prob_micro_batch_size 128 over 8 GPUs, on a share of 2560 / 8 = 320 trajectories
    "log_prob_micro_batches": f"old-log-prob 20 x 16, reference 20 x 16 trajectories ({UPSTREAM_GPUS} GPUs)",
    "attention": "flash_attention_2, packed sequences (remove padding)",
    "prompt_tokens": "2048",
    "turn_tokens": "500",
    "obs_tokens": "500",
    "turns": "2 with search + 1 final",
    "response_tokens": "2500",
    "context_tokens": "4096",
    "kl": "low_var_kl (K3) in the loss, coef 0.001",
    "loss_agg": "mean of per-micro-batch token-means",
    "advantage": UNBIASED,
    "clip": "ratio in [0.8, 1.2], no dual-clip",
    "entropy": "0.001",
    "lr": "1e-06, linear warmup over 286 steps, then constant",
    "optimizer": "AdamW, betas (0.9, 0.999), weight decay 0.01",
    "grad_clip": "1.0",
    "sampling": "temperature 1.0, top_p 0.95, top_k -1",
    "validation": "sampled: temperature 1.0, top_p 0.95",
    "steps": "1005; validate at 0 and every 50; save every 100",
    "topk": "3",
}


@dataclass(frozen=True)
class Declared:
    """A deliberate difference of configs/grpo_verl.yaml from upstream: its card lines, why, and the
    overrides that restore upstream's value (empty when no verl 0.9.1 setting can)."""

    keys: tuple[str, ...]
    why: str
    switch: str


DECLARED: tuple[Declared, ...] = (
    Declared(("prompts_per_step", "trajectories_per_step", "trajectories_per_update"),
             "verl 0.9.1 counts actor.ppo_mini_batch_size in prompts and multiplies it by rollout.n, so "
             "upstream's 256 trajectories per update (51.2 prompts) cannot be written; 480 prompts in "
             "mini-batches of 48 keep upstream's 10 updates per step, at 240 trajectories each",
             "data.train_batch_size=512 actor_rollout_ref.actor.ppo_mini_batch_size=64 gives upstream's batch "
             "at 8 updates of 320 trajectories; no setting gives both"),
    Declared(("micro_batches",),
             "memory only (verl 0.9.1's token-mean divides by the tokens of the whole mini-batch, so the "
             "split does not change the gradient); each of 8 GPUs gets 30 trajectories per update, which "
             "do not split into upstream's 8s (5 also divides the share of 1, 2, 4 and 16 GPUs)",
             ""),
    Declared(("log_prob_micro_batches",),
             "verl's engine asserts that the micro-batch divides each GPU's share of the step batch "
             "(2400 trajectories: 300 on 8 GPUs), which upstream's 16 does not; 10 divides the share on 1, "
             "2, 4, 8 and 16 GPUs (memory only: log-probs do not depend on the split)",
             ""),
    Declared(("attention",),
             "`.[gpu]` (verl[vllm]==0.9.1) installs no FlashAttention, and verl's default flash_attention_2 "
             "would fail in every worker; sdpa on padded batches computes the same log-probs, slower",
             "pip install flash-attn --no-build-isolation, then actor_rollout_ref.model.override_config."
             "attn_implementation=flash_attention_2 actor_rollout_ref.model.use_remove_padding=true"),
    Declared(("loss_agg",),
             "verl 0.9.1 divides by the tokens of the whole mini-batch (all GPUs); upstream's early verl "
             "averaged per-micro-batch token means, weighting short and long micro-batches alike",
             ""),
    Declared(("validation",),
             "upstream meant validation to be greedy and sampled by mistake (its do_sample flag was dropped)",
             "actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.95 "
             "actor_rollout_ref.rollout.val_kwargs.do_sample=true"),
)


# Upstream's train_ppo.sh (PeterGriffinJin/Search-R1) with its early-verl defaults: 4 GPUs, train batch 512,
# n_agent 1 and rollout.n 1, ppo_mini_batch_size 256 (2 updates per step), global micro-batches divided by
# the 4 GPUs (actor 64 -> 16, log-probs 128 -> 32 on each GPU's 128 trajectories, critic 8 -> 2 for both
# its update and its values pass), GAE with gamma = lambda = 1 over the attention mask (observation tokens
# included, in the critic's value loss too), KL `kl` in the reward with a fixed 0.001, actor lr 1e-6 with
# int(0.95 x 305) = 289 warmup steps, critic lr 1e-5 with int(0.05 x 305) = 15, both then constant,
# retriever top 10 reranked to 3 passages, 305 steps; the rest as train_grpo.sh.
UPSTREAM_PPO: dict[str, str] = {
    **UPSTREAM,
    "prompts_per_step": "512",
    "group_size": "1",
    "trajectories_per_step": "512",
    "updates_per_step": "2",
    "trajectories_per_update": "256",
    "micro_batches": f"4 x 16 trajectories ({UPSTREAM_PPO_GPUS} GPUs)",
    "log_prob_micro_batches": f"old-log-prob 4 x 32, reference 4 x 32 trajectories ({UPSTREAM_PPO_GPUS} GPUs)",
    "kl": "kl in the reward, fixed coef 0.001",
    "advantage": f"GAE: gamma 1, lambda 1, whitened; {OBS_INCLUDED}",
    "lr": "1e-06, linear warmup over 289 steps, then constant",
    "steps": "305; validate at 0 and every 50; save every 100",
    "topk": "3 (the top 3 of 10 after a reranker)",
    "critic_model": SAME_MODEL,
    "critic_updates": "2 x 256 trajectories",
    "critic_micro_batches": f"update 32 x 2, values 64 x 2 trajectories ({UPSTREAM_PPO_GPUS} GPUs)",
    "critic_lr": "1e-05, linear warmup over 15 steps, then constant",
    "critic_optimizer": "AdamW, betas (0.9, 0.999), weight decay 0.01, grad clip 1.0",
    "value_loss": f"clipped to +-0.5 of the rollout's values, mean of per-micro-batch token-means; {OBS_INCLUDED}",
}

_MICRO = ("micro_batches", "log_prob_micro_batches", "critic_micro_batches")
DECLARED_PPO: tuple[Declared, ...] = (
    Declared(_MICRO,
             "memory only (no loss depends on the split): upstream's early verl divided global micro-batches "
             "by its 4 GPUs, with actor and critic offloaded to CPU; ours are per GPU and divide each GPU's "
             "share on 1, 2, 4, 8 and 16 GPUs",
             "trainer.n_gpus_per_node=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 "
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 "
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 critic.ppo_micro_batch_size_per_gpu=2 "
             "critic.forward_micro_batch_size_per_gpu=2"),
    Declared(("advantage", "value_loss"),
             "verl's GAE and value loss cover the tokens of response_mask, which the agent loop sets to 0 on "
             "retrieved text: the critic is not trained to value text the policy did not write, as the "
             "policy loss already skips it (upstream's GAE and critic used the attention mask); verl 0.9.1 "
             "also takes the value loss's token-mean over the whole mini-batch",
             ""),
    *(d for d in DECLARED if set(d.keys) & {"loss_agg", "validation"}),
    Declared(("attention",),
             "`.[gpu]` (verl[vllm]==0.9.1) installs no FlashAttention, and verl's default flash_attention_2 "
             "would fail in every worker; sdpa on padded batches computes the same log-probs and values, slower",
             "pip install flash-attn --no-build-isolation, then actor_rollout_ref.model.override_config."
             "attn_implementation=flash_attention_2 actor_rollout_ref.model.use_remove_padding=true "
             "critic.model.override_config.attn_implementation=flash_attention_2 critic.model.use_remove_padding=true"),
    Declared(("topk",),
             "this project has no reranker: 3 passages straight from the retriever, as upstream's "
             "train_grpo.sh",
             ""),
)


@dataclass(frozen=True)
class Upstream:
    """Upstream Search-R1's run a verl config is shown beside: its script and GPUs, its card values, and
    the shipped config whose deliberate differences `declared` lists."""

    script: str
    gpus: int
    values: dict[str, str]
    shipped: str
    declared: tuple[Declared, ...]


GRPO_UPSTREAM = Upstream("train_grpo.sh", UPSTREAM_GPUS, UPSTREAM, SHIPPED, DECLARED)
PPO_UPSTREAM = Upstream("train_ppo.sh", UPSTREAM_PPO_GPUS, UPSTREAM_PPO, SHIPPED_PPO, DECLARED_PPO)


@dataclass(frozen=True)
class Line:
    key: str
    label: str
    ours: str
    upstream: str

    @property
    def differs(self) -> bool:
        return self.ours != self.upstream


class ScheduleError(ValueError):
    """A schedule verl's workers would reject at the first update (names the keys and the fix)."""


# -- through verl ------------------------------------------------------------------------------------
class _Sent(Exception):
    """Raised by the recording worker group in place of running an update."""


class _RecordingWorkerGroup:
    def update_actor(self, batch):
        raise _Sent(dict(batch.extra_info))

    def train_mini_batch(self, batch):  # the critic's update
        raise _Sent(dict(batch.extra_info))


def _sent_by(method: str, call: str, config: DictConfig, **trainer_fields) -> dict:
    """What verl's `PPOTrainer.<method>` sends its workers through `call` (global_batch_size =
    trajectories per update, epochs, seed, dataloader_kwargs), from verl's own method run on a stand-in
    trainer whose worker group records the call."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    me = SimpleNamespace(config=config, **trainer_fields)
    try:
        getattr(PPOTrainer, method)(me, SimpleNamespace(extra_info={}), {})
    except _Sent as sent:
        return sent.args[0]
    raise RuntimeError(f"verl's PPOTrainer.{method} did not call {call}; verl changed")


def _actor_update_info(config: DictConfig) -> dict:
    """What verl's `_update_actor` sends the actor workers."""
    return _sent_by("_update_actor", "update_actor", config, actor_rollout_wg=_RecordingWorkerGroup(),
                    distillation_config=None)


def _critic_update_info(config: DictConfig) -> dict:
    """What verl's `_update_critic` sends the critic workers."""
    return _sent_by("_update_critic", "train_mini_batch", config, critic_wg=_RecordingWorkerGroup())


def uses_critic(config: DictConfig) -> bool:
    """verl's need_critic: critic.enable when set, else algorithm.adv_estimator == gae."""
    from verl.trainer.ppo.utils import need_critic

    with warnings.catch_warnings():  # "Disabled critic ...": check_config already showed it
        warnings.simplefilter("ignore", UserWarning)
        return need_critic(config)


def typed_critic(config: DictConfig):
    """verl's typed critic config (FSDPCriticConfig, its `engine` what verl's critic worker is built
    with), without critic.model: verl's HFModelConfig loads the model's config and tokenizer (from the
    hub for a hub id), which a check before the run neither needs nor may be able to do."""
    from verl.utils.config import omega_conf_to_dataclass

    critic = OmegaConf.create(OmegaConf.to_container(config, resolve=True)).critic
    critic.model = None
    return omega_conf_to_dataclass(critic)


def _batch_multiple(config: DictConfig, dp: int) -> int:
    """verl's `_get_required_batch_multiple`: the step batch is padded to a multiple of this."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    me = SimpleNamespace(config=config, use_critic=uses_critic(config), global_steps=config.trainer.critic_warmup)
    return PPOTrainer._get_required_batch_multiple(me, dp)


def _count_updates(rows_per_gpu: int, mini_per_gpu: int, info: dict) -> int:
    """Mini-batches verl's training worker iterates over one GPU's share (one optimizer step each)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    td = TensorDict({"row": torch.arange(rows_per_gpu)}, batch_size=[rows_per_gpu])
    it = tu.make_iterator(td, mini_batch_size=mini_per_gpu, epochs=info["epochs"], seed=info["seed"],
                          dataloader_kwargs=dict(info["dataloader_kwargs"]))
    return sum(1 for _ in it)


def _count_micro_batches(mini_per_gpu: int, micro_per_gpu: int) -> int:
    """Micro-batches verl's engine splits one GPU's mini-batch into (fixed-size micro-batches)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    td = TensorDict({"row": torch.arange(mini_per_gpu)}, batch_size=[mini_per_gpu])
    tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_per_gpu)
    return len(prepare_micro_batches(td)[0])


def _lr_schedule(optim, total_steps: int) -> str:
    """Peak lr, warmup and shape, read off the scheduler verl's FSDP engine builds, stepped."""
    import torch
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    optim.total_training_steps = total_steps
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.lr)
    sched = FSDPEngine._build_lr_scheduler(SimpleNamespace(optimizer_config=optim, rank=1), opt)
    lrs = []
    for _ in range(total_steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    peak = max(lrs)
    warmup = next(i for i, lr in enumerate(lrs) if lr >= peak * (1 - 1e-9))
    ramp = f", linear warmup over {warmup} steps" if warmup else ""
    if all(abs(lr - peak) <= 1e-12 * peak for lr in lrs[warmup:]):
        return f"{peak:g}{ramp}, then constant"
    return f"{peak:g}{ramp}, then {optim.lr_scheduler_type} to {lrs[-1]:.3g} at step {total_steps}"


def _advantage(config: DictConfig, n: int) -> str:
    """Which normalisation the configured estimator applies, found by running it (verl's v1 path) on
    one group of n trajectories with scores (1, 0, ..., 0): the first advantage is
    (1 - 1/n) / std with std unbiased sqrt(1/n), population sqrt(n - 1)/n, or 1 (no std)."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    name = config.algorithm.adv_estimator
    if name == "gae":
        return _gae(config)
    if n < 2:
        return f"{name} (groups of one trajectory)"
    scores = torch.zeros(n, 2)
    scores[0, 1] = 1.0  # (n, L=2): the score on the last token
    data = DataProto.from_dict(tensors={"token_level_rewards": scores, "response_mask": torch.ones(n, 2)},
                               non_tensors={"uid": np.array(["probe"] * n, dtype=object)})
    try:
        out = compute_advantage_for_multi_trajectories(
            data, batch_keys=[f"probe_{i}_0" for i in range(n)], adv_estimator=name,
            norm_adv_by_std_in_grpo=config.algorithm.get("norm_adv_by_std_in_grpo", True), config=config.algorithm)
    except Exception as err:  # estimators needing values, old log-probs, ...: not a group normalisation
        return f"{name} (not probed: {type(err).__name__})"
    a0 = float(out.batch["advantages"][0, 0])
    centred = 1 - 1 / n
    for label, std in ((UNBIASED, math.sqrt(1 / n)), (POPULATION, math.sqrt(n - 1) / n), (CENTRED, 1.0)):
        if math.isclose(a0, centred / std, rel_tol=1e-4):
            return label if name in ("grpo", "search_r1_grpo", "grpo_vectorized") else f"{name}: {label}"
    return f"{name} (first advantage of the probe {a0:.4g})"


def _gae(config: DictConfig) -> str:
    """GAE's gamma and lambda, whether it whitens, and whether observation tokens count, found by running
    verl's v1 advantage path on one probe trajectory of 4 tokens whose second is an observation
    (response_mask 0) with the reward on the last: when GAE skips observation tokens, that token's
    value changes nothing at the generated ones."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    algo = config.algorithm
    mask = torch.tensor([[1, 0, 1, 1]])  # (1, L=4): generated, observation, generated, generated

    def run(obs_value: float):
        data = DataProto.from_dict(
            tensors={"token_level_rewards": torch.tensor([[0.0, 0.0, 0.0, 1.0]]), "response_mask": mask,
                     "values": torch.tensor([[0.1, obs_value, 0.3, 0.4]])},
            non_tensors={"uid": np.array(["probe"], dtype=object)})
        out = compute_advantage_for_multi_trajectories(
            data, batch_keys=["probe_0_0"], adv_estimator=algo.adv_estimator, gamma=algo.gamma, lam=algo.lam,
            config=algo).batch
        return out["advantages"], out["returns"]

    (adv, ret), (_, ret2) = run(5.0), run(-5.0)
    generated = mask[0].bool()
    skipped = torch.allclose(ret[0, generated], ret2[0, generated])
    whitened = ", whitened" if abs(float(adv[0, generated].mean())) < 1e-4 else ""
    return f"GAE: gamma {algo.gamma:g}, lambda {algo.lam:g}{whitened}; {OBS_SKIPPED if skipped else OBS_INCLUDED}"


def _value_loss(critic) -> str:
    """The critic's value loss: clip range, aggregation, and whether observation tokens count, found by
    running verl's compute_value_loss (what verl's critic loss calls) on a probe of one generated and one
    observation token (response_mask 0) whose predictions differ between two runs."""
    import torch
    from verl.trainer.ppo.core_algos import compute_value_loss

    def run(obs_prediction: float) -> float:
        loss, _ = compute_value_loss(
            vpreds=torch.tensor([[0.5, obs_prediction]]), returns=torch.tensor([[1.0, 1.0]]),
            values=torch.tensor([[0.5, 0.5]]), response_mask=torch.tensor([[True, False]]),
            cliprange_value=critic.cliprange_value, loss_agg_mode=critic.loss_agg_mode)
        return float(loss)

    masked = run(3.0) == run(-3.0)
    agg = TOKEN_MEAN_MINI_BATCH if critic.loss_agg_mode == "token-mean" else critic.loss_agg_mode
    return (f"clipped to +-{critic.cliprange_value:g} of the rollout's values, {agg}; "
            f"{OBS_SKIPPED if masked else OBS_INCLUDED}")


def _critic_schedule(config: DictConfig, dp: int, rows_per_gpu: int, trajectories: int, padding: int) -> dict[str, str]:
    """Critic lines: updates per step and micro-batches, through verl's _update_critic, make_iterator and
    prepare_micro_batches with the sizes of the critic's typed engine config (ScheduleError naming the key
    when verl's critic worker would fail)."""
    critic = typed_critic(config)
    if critic.strategy not in ("fsdp", "fsdp2"):
        na = f"not computed for critic.strategy={critic.strategy}"
        return {"critic_updates": na, "critic_micro_batches": na}
    engine = critic.engine
    info = _critic_update_info(config)
    per_update = int(info["global_batch_size"])
    n = int(config.actor_rollout_ref.rollout.n)
    if per_update % dp:
        raise ScheduleError(
            f"critic.ppo_mini_batch_size={critic.ppo_mini_batch_size} x rollout.n={n} = {per_update} trajectories "
            f"per critic update is not divisible by the {dp} data-parallel GPUs; verl's critic worker would fail "
            f"at the first update. Fix: a critic.ppo_mini_batch_size whose product with rollout.n is a multiple "
            f"of {dp}")
    mini_per_gpu = per_update // dp
    try:
        updates = _count_updates(rows_per_gpu, mini_per_gpu, info)
    except AssertionError:
        raise ScheduleError(
            f"{rows_per_gpu} trajectories per GPU do not split into critic mini-batches of {mini_per_gpu} "
            f"(critic.ppo_mini_batch_size={critic.ppo_mini_batch_size}); verl's critic worker would fail. Fix: make "
            f"data.train_batch_size a multiple of critic.ppo_mini_batch_size") from None
    if engine.use_dynamic_bsz:
        # verl's trainer sets both of the critic engine's token budgets to ppo_infer_max_token_len_per_gpu
        micro = f"dynamic, <= {critic.ppo_infer_max_token_len_per_gpu} tokens each ({dp} GPUs)"
    else:
        parts = []
        for name, rows, size, key, engine_key in (
                ("update", mini_per_gpu, engine.micro_batch_size_per_gpu, "critic.ppo_micro_batch_size_per_gpu",
                 "micro_batch_size_per_gpu"),
                ("values", rows_per_gpu, engine.infer_micro_batch_size_per_gpu,
                 "critic.forward_micro_batch_size_per_gpu", "infer_micro_batch_size_per_gpu")):
            where = (f"each GPU gets per critic update" if name == "update" else
                     f"each GPU gets per step ({trajectories}{f' + {padding} padding' if padding else ''} / {dp})")
            if size is None:
                raise ScheduleError(
                    f"critic.fsdp.{engine_key} is not set, so verl's critic worker has no micro-batch for its "
                    f"{name} pass. Fix: critic.fsdp.{engine_key}=${{{key}}} (as configs/ppo_verl.yaml), or "
                    f"critic.fsdp.use_dynamic_bsz=true")
            try:
                parts.append(f"{name} {_count_micro_batches(rows, int(size))} x {int(size)}")
            except AssertionError:
                raise ScheduleError(
                    f"{key}={size} (critic.fsdp.{engine_key}, what verl's critic worker reads) does not divide the "
                    f"{rows} trajectories {where}; verl's engine would fail in the critic's {name} pass "
                    f"(AssertionError: data size must be divisible by ... micro_batch_size_per_gpu). Fix: {key}=D "
                    f"with D a divisor of {rows}") from None
        micro = ", ".join(parts) + f" trajectories ({dp} GPUs)"
    return {"critic_updates": f"{updates} x {per_update} trajectories", "critic_micro_batches": micro}


def _critic_algorithm(config: DictConfig) -> dict[str, str]:
    """Critic lines: model, lr schedule, optimizer, value loss (verl's typed critic config)."""
    critic = typed_critic(config)
    optim = critic.optim
    total = config.trainer.total_training_steps
    path = OmegaConf.select(config, "critic.model.path")
    return {
        "critic_model": SAME_MODEL if path == config.actor_rollout_ref.model.path else f"{path} + value head",
        "critic_lr": (_lr_schedule(optim, int(total)) if total else f"{optim.lr:g}, warmup ratio "
                      f"{optim.lr_warmup_steps_ratio:g} of steps verl derives from the dataset"),
        "critic_optimizer": f"{optim.optimizer}, betas {tuple(optim.betas)}, weight decay {optim.weight_decay:g}, "
                            f"grad clip {optim.clip_grad:.1f}",
        "value_loss": _value_loss(critic),
    }


# -- the card ----------------------------------------------------------------------------------------
def _schedule(config: DictConfig) -> dict[str, str]:
    """Batch lines: prompts, trajectories, updates, micro-batches per step (through verl, above)."""
    actor = config.actor_rollout_ref.actor
    n = int(config.actor_rollout_ref.rollout.n)
    n_gpus = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    sp = int(actor.get("fsdp_config", {}).get("ulysses_sequence_parallel_size", 1) or 1)
    if actor.strategy not in ("fsdp", "fsdp2"):
        na = f"not computed for actor.strategy={actor.strategy}"
        return {k: na for k in ("trajectories_per_step", "updates_per_step", "trajectories_per_update",
                                "micro_batches", "log_prob_micro_batches")} | {"prompts_per_step": str(config.data.train_batch_size),
                                                     "group_size": str(n)}
    dp = n_gpus // sp
    mode = config.trainer.v1.trainer_mode
    mode = "sync" if mode == "search_r1" else mode  # our mode runs as verl's sync (verl_ext/trainer.py)
    sync_steps = int((config.trainer.v1.get(mode) or {}).get("parameter_sync_step", 1))
    prompts = int(config.data.train_batch_size) // sync_steps  # per local update (verl's step())

    info = _actor_update_info(config)
    per_update = int(info["global_batch_size"])
    trajectories = prompts * n
    multiple = _batch_multiple(config, dp)
    padding = -trajectories % multiple  # verl's upsample_batch_to_divisible_size appends these
    if per_update % dp:
        raise ScheduleError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} x rollout.n={n} = {per_update} "
            f"trajectories per update is not divisible by the {dp} data-parallel GPUs; verl's training worker "
            f"would fail at the first update. Fix: a ppo_mini_batch_size whose product with rollout.n is a "
            f"multiple of {dp}")
    mini_per_gpu = per_update // dp
    rows_per_gpu = (trajectories + padding) // dp
    try:
        updates = _count_updates(rows_per_gpu, mini_per_gpu, info) * sync_steps
    except AssertionError:
        raise ScheduleError(
            f"{rows_per_gpu} trajectories per GPU do not split into mini-batches of {mini_per_gpu} "
            f"(actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}); verl's training worker "
            f"would fail. Fix: make data.train_batch_size a multiple of ppo_mini_batch_size") from None
    if actor.get("use_dynamic_bsz"):
        micro = f"dynamic, <= {actor.ppo_max_token_len_per_gpu} tokens each ({dp} GPUs)"
    else:
        m = int(actor.ppo_micro_batch_size_per_gpu)
        try:
            micro = f"{_count_micro_batches(mini_per_gpu, m)} x {m} trajectories ({dp} GPUs)"
        except AssertionError:
            raise ScheduleError(
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={m} does not divide the {mini_per_gpu} "
                f"trajectories each GPU gets per update; verl's engine would fail at the first update. Fix: a "
                f"divisor of {mini_per_gpu}") from None
    critic = _critic_schedule(config, dp, rows_per_gpu, trajectories, padding) if uses_critic(config) else {}
    return critic | {
        "log_prob_micro_batches": _log_prob_micro_batches(config, rows_per_gpu, dp, trajectories, padding),
        "prompts_per_step": str(prompts * sync_steps),
        "group_size": str(n),
        "trajectories_per_step": str(trajectories * sync_steps) + (f" + {padding} padding" if padding else ""),
        "updates_per_step": str(updates),
        "trajectories_per_update": str(per_update),
        "micro_batches": micro,
    }


def log_prob_passes(config: DictConfig) -> list[tuple[str, str, str]]:
    """The forward-only passes verl runs over the whole step batch before the update, as
    (name, micro-batch key, dynamic-batch key): the actor's old-log-prob recompute (skipped in
    rollout_correction bypass mode) and the reference's (run on the actor without its LoRA adapter,
    with the actor's micro-batch, when the model has one: trainer_base's ref_in_actor)."""
    from verl.trainer.ppo.utils import need_reference_policy

    rollout = "actor_rollout_ref.rollout"
    old = ("old-log-prob", f"{rollout}.log_prob_micro_batch_size_per_gpu", f"{rollout}.log_prob_use_dynamic_bsz")
    bypass = bool(OmegaConf.select(config, "algorithm.rollout_correction.bypass_mode", default=False))
    passes = [] if bypass else [old]
    model = config.actor_rollout_ref.model
    ref_in_actor = (model.get("lora_rank", 0) or 0) > 0 or model.get("lora_adapter_path") is not None
    if need_reference_policy(config):
        ref = "actor_rollout_ref.ref"
        passes.append(("reference", *old[1:]) if ref_in_actor else
                      ("reference", f"{ref}.log_prob_micro_batch_size_per_gpu", f"{ref}.log_prob_use_dynamic_bsz"))
    return passes


def _log_prob_micro_batches(config: DictConfig, rows_per_gpu: int, dp: int, trajectories: int, padding: int) -> str:
    """Each log-prob pass's micro-batches on one GPU's share of the step, through verl's
    prepare_micro_batches (ScheduleError naming the key when the micro-batch does not divide it)."""
    parts = []
    for name, key, dynamic_key in log_prob_passes(config):
        if OmegaConf.select(config, dynamic_key, default=False):
            parts.append(f"{name} dynamic")
            continue
        m = OmegaConf.select(config, key)
        if m is None:
            raise ScheduleError(f"{key} is not set; verl's worker needs it for the {name} pass. Fix: a divisor of "
                                f"{rows_per_gpu} (each GPU's share of the step), or {dynamic_key}=true")
        m = int(m)
        try:
            parts.append(f"{name} {_count_micro_batches(rows_per_gpu, m)} x {m}")
        except AssertionError:
            shares = f"{trajectories}" + (f" + {padding} padding" if padding else "")
            divisors = [d for d in range(1, rows_per_gpu + 1) if rows_per_gpu % d == 0 and d <= max(m, 1) * 2]
            raise ScheduleError(
                f"{key}={m} does not divide the {rows_per_gpu} trajectories each of the {dp} data-parallel GPUs "
                f"gets per step ({shares} / {dp}); verl's engine would fail in the {name} pass, after the whole "
                f"first rollout (AssertionError: data size must be divisible by ... micro_batch_size_per_gpu). "
                f"Fix: {key}=D with D a divisor of {rows_per_gpu} (e.g. {divisors[-1]}), or {dynamic_key}=true") from None
    return ", ".join(parts) + f" trajectories ({dp} GPUs)" if parts else "none"


def attention(config: DictConfig) -> tuple[str, bool]:
    """(attention kernel verl builds the actor and reference with, whether sequences are packed):
    verl's HFModelConfig reads override_config.attn_implementation, default flash_attention_2."""
    model = config.actor_rollout_ref.model
    impl = (model.get("override_config") or {}).get("attn_implementation", "flash_attention_2")
    return str(impl), bool(model.get("use_remove_padding", False))


def _attention_line(config: DictConfig) -> str:
    impl, packed = attention(config)
    return f"{impl}, " + ("packed sequences (remove padding)" if packed else "padded batches")


def _budgets(config: DictConfig) -> dict[str, str]:
    from verl_ext.agent_loop import SearchR1Settings

    settings = SearchR1Settings.from_config(config)
    g = settings.generation_config(config.actor_rollout_ref.rollout)
    return {
        "prompt_tokens": str(g.max_start_length),
        "turn_tokens": str(g.limits.max_tokens_per_turn),
        "obs_tokens": str(g.max_obs_length),
        "turns": f"{g.max_turns} with search + 1 final",
        "response_tokens": str(g.max_response_length),
        "context_tokens": str(g.max_prompt_length),
        "topk": str(settings.retriever.topk),
    }


def _algorithm(config: DictConfig) -> dict[str, str]:
    from verl.utils.config import omega_conf_to_dataclass

    resolved = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    actor = omega_conf_to_dataclass(resolved.actor_rollout_ref.actor)
    optim = omega_conf_to_dataclass(resolved.actor_rollout_ref.actor.optim)
    algo, rollout, trainer = resolved.algorithm, resolved.actor_rollout_ref.rollout, resolved.trainer

    kl = []
    if actor.use_kl_loss:
        k3 = " (K3)" if actor.kl_loss_type == "low_var_kl" else ""
        kl.append(f"{actor.kl_loss_type}{k3} in the loss, coef {actor.kl_loss_coef:g}")
    if algo.use_kl_in_reward:
        kl.append(f"{algo.kl_penalty} in the reward, {algo.kl_ctrl.type} coef {algo.kl_ctrl.kl_coef:g}")
    # verl's vanilla loss: clip_ratio_low/high when set, else clip_ratio (both default to 0.2 in its yaml)
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    dual = "no dual-clip" if actor.clip_ratio_c > RATIO_CAP else f"dual-clip at {actor.clip_ratio_c:g} x |A|"
    clip = f"ratio in [{1 - low:g}, {1 + high:g}], {dual}"
    if actor.policy_loss.loss_mode != "vanilla":
        clip = f"policy loss {actor.policy_loss.loss_mode}: {clip}"

    total = trainer.total_training_steps
    val = rollout.val_kwargs
    steps = f"{total}; validate {'at 0 and ' if trainer.val_before_train else ''}every " \
            f"{trainer.test_freq}; save every {trainer.save_freq}"
    return {
        "kl": "; ".join(kl) or "none",
        "loss_agg": TOKEN_MEAN_MINI_BATCH if actor.loss_agg_mode == "token-mean" else actor.loss_agg_mode,
        "advantage": _advantage(config, int(rollout.n)),
        "clip": clip,
        "entropy": f"{actor.entropy_coeff:g}",
        "lr": (_lr_schedule(optim, int(total)) if total else
               f"{optim.lr:g}, warmup ratio {optim.lr_warmup_steps_ratio:g} of steps verl derives from the dataset"),
        "optimizer": f"{optim.optimizer}, betas {tuple(optim.betas)}, weight decay {optim.weight_decay:g}",
        "grad_clip": f"{optim.clip_grad:.1f}",
        "sampling": f"temperature {rollout.temperature:.1f}, top_p {rollout.top_p:g}, top_k {rollout.top_k}",
        # verl's agent-loop worker samples validation with val_kwargs' temperature/top_p/top_k
        "validation": ("greedy" if val.temperature == 0 else
                       f"sampled: temperature {val.temperature:.1f}, top_p {val.top_p:g}"),
        "steps": steps,
    }


def card_lines(critic: bool) -> tuple[tuple[str, str], ...]:
    """(key, label) of a card in order: LINES, with CRITIC_LINES after the gradient clip for a config
    with a critic."""
    if not critic:
        return LINES
    at = [k for k, _ in LINES].index(CRITIC_AFTER) + 1
    return LINES[:at] + CRITIC_LINES + LINES[at:]


def upstream_of(config: DictConfig) -> Upstream:
    """Upstream's PPO run (train_ppo.sh) for a config with a critic, else its GRPO run."""
    return PPO_UPSTREAM if uses_critic(config) else GRPO_UPSTREAM


def recipe_lines(config: DictConfig) -> list[Line]:
    """The card's lines for a composed verl config, beside upstream's run of the same algorithm
    (ScheduleError when verl would fail at the first update)."""
    critic = uses_critic(config)
    values = {**_schedule(config), **_budgets(config), **_algorithm(config), "attention": _attention_line(config),
              **(_critic_algorithm(config) if critic else {})}
    upstream = upstream_of(config).values
    return [Line(key, label, values[key], upstream[key]) for key, label in card_lines(critic)]


def format_card(lines: list[Line], source: str, n_gpus: int) -> str:
    """Two columns, this run and upstream (train_ppo.sh's when the lines have a critic, else
    train_grpo.sh's), `*` beside a differing line; then, for the shipped config of that algorithm
    (grpo_verl, ppo_verl), each declared difference (why, switch) and the undeclared ones (the user's
    overrides or another config)."""
    critic = any(x.key == CRITIC_LINES[0][0] for x in lines)
    up = PPO_UPSTREAM if critic else GRPO_UPSTREAM
    width = max(len(x.label) for x in lines) + 2
    ours_w = max(len(x.ours) for x in lines) + 2
    gpus = f"{n_gpus} GPU{'s' if n_gpus != 1 else ''}"
    out = [f"Recipe card: {source} on {gpus}, through verl's normalisation "
           f"(* = differs from upstream Search-R1's {up.script} on {up.gpus} GPUs)",
           f"  {'':<{width}}{'this run':<{ours_w}}  upstream"]
    for x in lines:
        out.append(f"  {x.label:<{width}}{x.ours:<{ours_w}}{'*' if x.differs else ' '} {x.upstream}")
    differing = {x.key for x in lines if x.differs}
    labels = {x.key: x.label for x in lines}
    declared = [d for d in up.declared if differing & set(d.keys)] if source == up.shipped else []
    if declared:
        out.append(f"Deliberate differences of configs/{up.shipped}.yaml:")
        for d in declared:
            switch = f" Switch: {d.switch}." if d.switch else " No verl 0.9.1 setting gives upstream's."
            text = f"- {', '.join(labels[k] for k in d.keys if k in differing)}: {d.why}.{switch}"
            out.append(textwrap.fill(text, WRAP, initial_indent="  ", subsequent_indent="    "))
    other = sorted(differing - {k for d in declared for k in d.keys}, key=[x.key for x in lines].index)
    if other:
        out.append(textwrap.fill("Other differences (overrides or another config): "
                                 + ", ".join(labels[k] for k in other), WRAP, subsequent_indent="  "))
    return "\n".join(out)


def recipe_card(config: DictConfig, source: str) -> str:
    n_gpus = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    return format_card(recipe_lines(config), source, n_gpus)


def write_card(card: str, run_dir: str | os.PathLike) -> Path:
    """Write the card to run_dir/recipe_card.txt (atomically: a reader never sees half of it)."""
    path = Path(run_dir).expanduser() / CARD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{CARD_FILE}.{os.getpid()}.part")
    tmp.write_text(card + "\n")
    os.replace(tmp, path)
    return path
