"""Search-R1 reward for verl's reward loop: `reward.custom_reward_function.path=pkg://verl_ext.reward`.

verl's reward manager calls `compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=..., **reward_kwargs)` once per trajectory, where `solution_str` is the decoded response
(generated tokens and the observations between them, never the prompt) and `ground_truth` is the
row's `reward_model.ground_truth` (`{"target": [aliases]}`). The score is `search_r1.rewards`'
function named by `reward_kwargs.reward` (seed | em | f1 | subem), which reads the last `<answer>`
of the response only.

The returned dict also carries `em`, `f1` and `subem` of the same answer: verl keeps every key as
`reward_extra_info`, and its validation reports each one per `data_source`
(`val-core/<data_source>/em/mean@1`), which the `search_r1` trainer mode prints as a table.
"""
from __future__ import annotations

from typing import Any

from search_r1.rewards import get_reward_fn

METRICS = ("em", "f1", "subem")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  reward: str = "seed", **kwargs) -> dict[str, float]:
    """`{"score": reward(solution_str, ground_truth), "em": .., "f1": .., "subem": ..}`.

    reward: the training reward's name in `search_r1.rewards.REWARD_FNS` (unknown names raise
        ValueError listing the valid ones). `data_source`, `extra_info` and other keyword arguments
        verl passes (e.g. `reward_router_address`) do not change the score.
    """
    score = {"score": float(get_reward_fn(reward)(solution_str, ground_truth))}
    score.update({name: float(get_reward_fn(name)(solution_str, ground_truth)) for name in METRICS})
    return score
