"""Search-R1's GRPO advantage as a verl advantage estimator (`algorithm.adv_estimator=search_r1_grpo`)
and PPO-clip + LLDS as a verl policy loss (`actor_rollout_ref.actor.policy_loss.loss_mode=search_r1_llds`).

verl's own `grpo` divides by the unbiased group std plus 1e-6 and gives a singleton group mean 0 and
std 1 (so its advantage is the raw score). The seed spec (search_r1.algos.compute_grpo_advantages,
also used by the embedded CPU trainer) divides by the population std plus 1e-8 and gives a singleton
group, and any group whose scores are all equal, exactly 0. Both stay selectable; this module only
adds the names, the arithmetic lives in search_r1.algos.

LLDS on the verl path (arXiv 2512.04220; the embedded trainer's algorithm.llds_coef): verl's
`PolicyLossConfig` is a closed dataclass (an unknown key fails when verl instantiates the actor
config), but verl builds it from its `_target_`, so the supported way to give the loss its own keys is
a subclass named there. Turn LLDS on with

    actor_rollout_ref.actor.policy_loss._target_=verl_ext.algos.LLDSPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=search_r1_llds
    +actor_rollout_ref.actor.policy_loss.llds_coef=0.1        (+...llds_gate=response|action)

(`+` because verl's YAML does not have the keys; a config that sets `_target_` and the two keys in its
policy_loss section needs only the loss_mode override and the coefficient).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, register_adv_est, register_policy_loss
from verl.workers.config import PolicyLossConfig

from search_r1.algos import AGG_MODES, LLDS_GATES, broadcast_to_tokens, compute_grpo_advantages
from search_r1.algos import agg_loss as search_r1_agg_loss
from search_r1.algos import likelihood_sums, llds_penalty

ESTIMATOR_NAME = "search_r1_grpo"
EPS = 1e-8


@register_adv_est(ESTIMATOR_NAME)
def compute_search_r1_grpo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                     config=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage, seed spec, in verl's estimator signature.

        r_i = sum_t token_level_rewards[i, t]
        A_i = (r_i - mean_g) / (std_g + 1e-8)   std_g the population std of group g = index_i
        A_i = 0 when group g has one member or all its scores are equal

    `algorithm.norm_adv_by_std_in_grpo=false` gives A_i = r_i - mean_g (Dr. GRPO), as verl's `grpo`.

    Shapes: token_level_rewards (N, L) float, response_mask (N, L), index (N,) group ids (verl passes
    the `uid` column) -> (advantages, returns), both (N, L): A_i on every response token, 0 under mask 0.
    """
    scale = bool(getattr(config, "norm_adv_by_std_in_grpo", True)) if config is not None else True
    scores = token_level_rewards.sum(dim=-1)  # (N, L) -> (N,)
    adv = compute_grpo_advantages(scores, index, eps=EPS, std="population" if scale else "none")  # (N,)
    adv_tokens = broadcast_to_tokens(adv, response_mask)  # (N,) x (N, L) -> (N, L)
    return adv_tokens, adv_tokens


LLDS_LOSS_NAME = "search_r1_llds"


@dataclass
class LLDSPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss settings plus LLDS's (`policy_loss._target_=verl_ext.algos.LLDSPolicyLossConfig`).

    llds_coef: weight of the LLDS term (0 = the loss is verl's vanilla PPO-clip; the likelihood
        diagnostics are still logged). llds_gate: response | action (each generation turn between
        observations; the paper's best), as the embedded trainer's algorithm.llds_gate.
    """

    llds_coef: float = 0.0
    llds_gate: str = "action"

    def __post_init__(self):
        if not self.llds_coef >= 0:
            raise ValueError(f"actor_rollout_ref.actor.policy_loss.llds_coef={self.llds_coef!r} is invalid: allowed "
                             f"a number >= 0. Fix: set it to 0 (off) or a positive weight such as 0.1")
        if self.llds_gate not in LLDS_GATES:
            raise ValueError(f"actor_rollout_ref.actor.policy_loss.llds_gate={self.llds_gate!r} is invalid: allowed "
                             f"one of {list(LLDS_GATES)}. Fix: set it to one of them")


def llds_settings(config) -> tuple[float, str]:
    """(llds_coef, llds_gate) from the actor config's policy_loss section; a ValueError naming the
    fix when it is verl's own PolicyLossConfig (which cannot carry them)."""
    policy_loss = config.policy_loss
    coef, gate = policy_loss.get("llds_coef", None), policy_loss.get("llds_gate", None)
    if coef is None or gate is None:
        raise ValueError(f"policy_loss.loss_mode={LLDS_LOSS_NAME} needs the LLDS settings, which verl's "
                         f"PolicyLossConfig does not have. Fix: add actor_rollout_ref.actor.policy_loss._target_="
                         f"verl_ext.algos.LLDSPolicyLossConfig and +actor_rollout_ref.actor.policy_loss.llds_coef=0.1 "
                         f"(optionally +...llds_gate=response|action)")
    return float(coef), str(gate)


@register_policy_loss(LLDS_LOSS_NAME)
def compute_policy_loss_search_r1_llds(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                       response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                                       config=None, rollout_is_weights: torch.Tensor | None = None,
                                       ) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's vanilla PPO-clip loss plus llds_coef * the LLDS term (search_r1.algos.llds_penalty):

        loss = vanilla(old_log_prob, log_prob, A, m) + llds_coef * agg(g * relu(old_log_prob - log_prob), m)

    aggregated by verl's `agg_loss` with the policy loss's mode and global batch info (dp size,
    global token / sequence counts), so the term scales as the PPO term does across micro-batches
    and ranks. The vanilla part is verl's own registered "vanilla" function, called unchanged.

    Metrics (averaged over micro-batches by verl): the vanilla loss's, `actor/llds_loss` (the term,
    unweighted, with this micro-batch's own normaliser), `actor/llds_gated_token_frac`,
    `actor/llds_gated_response_frac`, and `likelihood/preserved_fell_frac`: the share of responses
    with A >= 0 whose summed log pi_theta - log pi_old is negative, log pi_theta being the actor's at
    this micro-batch's update (0 in a batch's first update, where pi_theta is pi_old).

    Shapes: old_log_prob, log_prob, advantages, response_mask (bs, response_length) -> loss ().
    """
    coef, gate = llds_settings(config)
    pg_loss, metrics = get_policy_loss_fn("vanilla")(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
    penalty, stats = llds_penalty(log_prob, old_log_prob, advantages, response_mask, gate)  # (bs, L)
    if coef > 0:
        pg_loss = pg_loss + coef * agg_loss(loss_mat=penalty, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                                            **config.global_batch_info)
    local_mode = loss_agg_mode if loss_agg_mode in AGG_MODES else "token-mean"  # a report: verl's extra modes read as token-mean
    stats["actor/llds_loss"] = float(search_r1_agg_loss(penalty.detach(), response_mask, local_mode))
    sums = likelihood_sums(log_prob, old_log_prob, response_mask, torch.zeros(len(log_prob), dtype=torch.bool),
                           advantages)
    if sums["preserved"] > 0:
        stats["likelihood/preserved_fell_frac"] = sums["preserved_fell"] / sums["preserved"]
    metrics.update(stats)
    return pg_loss, metrics
