"""Search-R1's GRPO advantage as a verl advantage estimator: `algorithm.adv_estimator=search_r1_grpo`.

verl's own `grpo` divides by the unbiased group std plus 1e-6 and gives a singleton group mean 0 and
std 1 (so its advantage is the raw score). The seed spec (search_r1.algos.compute_grpo_advantages,
also used by the embedded CPU trainer) divides by the population std plus 1e-8 and gives a singleton
group, and any group whose scores are all equal, exactly 0. Both stay selectable; this module only
adds the name, the arithmetic lives in search_r1.algos.
"""
from __future__ import annotations

import torch
from verl.trainer.ppo.core_algos import register_adv_est

from search_r1.algos import broadcast_to_tokens, compute_grpo_advantages

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
