"""The registered estimator `search_r1_grpo` and the reward function, through verl's own lookup paths.

The estimator is checked against an independent per-group reference (numpy, population std) and a
hand-computed case, and against verl's `grpo` to show both stay selectable and differ where the seed
spec says they should. The reward function is checked against search_r1.rewards on random responses,
through verl's loader (`get_custom_reward_fn`, which merges `reward_kwargs`).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

from search_r1.rewards import get_reward_fn


def reference_advantages(scores: np.ndarray, groups: list) -> np.ndarray:
    """Seed spec, one group at a time: (r - mean) / (population std + 1e-8); 0 for a singleton group
    or a group whose scores are all equal."""
    out = np.zeros_like(scores, dtype=np.float64)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = scores[idx].astype(np.float64)
        if len(r) > 1 and r.max() != r.min():
            out[idx] = (r - r.mean()) / (r.std(ddof=0) + 1e-8)
    return out


def random_batch(seed: int, n_groups: int = 6, length: int = 7):
    """Outcome rewards on each row's last generated token, groups of 1-5 rows, random masks."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, n_groups)
    groups = [f"uid{g}" for g, k in enumerate(sizes) for _ in range(k)]
    n = len(groups)
    mask = (rng.random((n, length)) < 0.8).astype(np.int64)
    mask[:, 0] = 1
    scores = rng.choice([0.0, 1.0, 0.5, -1.0, 2.5], size=n)
    if n_groups > 2:  # one group with equal scores
        first = [i for i, g in enumerate(groups) if g == "uid2"]
        scores[first] = 1.0
    rewards = np.zeros((n, length))
    last = [int(np.nonzero(m)[0].max()) for m in mask]
    rewards[np.arange(n), last] = scores
    return torch.tensor(rewards, dtype=torch.float32), torch.tensor(mask), np.array(groups, dtype=object), scores


@pytest.mark.parametrize("seed", range(5))
def test_registered_estimator_matches_the_seed_spec(seed):
    rewards, mask, groups, scores = random_batch(seed)
    adv, returns = get_adv_estimator_fn("search_r1_grpo")(token_level_rewards=rewards, response_mask=mask,
                                                          index=groups, config=None)
    want = reference_advantages(scores, list(groups))
    assert adv.shape == rewards.shape and torch.equal(adv, returns)
    torch.testing.assert_close(adv, torch.tensor(want[:, None] * mask.numpy(), dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)


def test_hand_computed_case_and_verl_grpo_stays_selectable():
    # group a: scores [1, 0] -> mean 0.5, population std 0.5 -> A = +-1/(0.5 + 1e-8) ~ +-1.
    #          verl's grpo: unbiased std 0.7071 -> A = +-0.7071.
    # group b: a single row with score 2 -> seed spec 0; verl's grpo: mean 0, std 1 -> A = 2.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    index = np.array(["a", "a", "b"], dtype=object)
    ours, _ = get_adv_estimator_fn("search_r1_grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    torch.testing.assert_close(ours, torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]]))
    theirs, _ = get_adv_estimator_fn("grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    torch.testing.assert_close(theirs, torch.tensor([[0.7071, 0.7071], [-0.7071, -0.7071], [2.0, 0.0]]),
                               rtol=1e-4, atol=1e-4)


def test_verl_v1_advantage_path_groups_by_uid_and_honours_dr_grpo():
    """verl's v1 trainer calls compute_advantage_for_multi_trajectories with the estimator name."""
    rewards, mask, groups, scores = random_batch(11)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": groups})
    keys = [f"{g}_{i}_0" for i, g in enumerate(groups)]
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": True})
    out = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator="search_r1_grpo",
                                                   config=config)
    want = reference_advantages(scores, list(groups))
    torch.testing.assert_close(out.batch["advantages"], torch.tensor(want[:, None] * mask.numpy(), dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)
    # Dr. GRPO: no division by the std
    config.norm_adv_by_std_in_grpo = False
    out = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator="search_r1_grpo",
                                                   config=config)
    centred = np.array([scores[i] - np.mean([scores[j] for j in range(len(groups)) if groups[j] == g])
                        for i, g in enumerate(groups)])
    single = np.array([sum(1 for h in groups if h == g) == 1 for g in groups])
    centred[single] = 0.0
    torch.testing.assert_close(out.batch["advantages"], torch.tensor(centred[:, None] * mask.numpy(), dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)


def random_responses(seed: int, n: int = 60):
    rng = random.Random(seed)
    golds = [["Ana Osk"], ["Paris", "the city of Paris"], ["1984"], ["Mirren"]]
    parts = ["<think>hmm</think>", "<search> who </search>", "\n\n<information>Doc 1(Title: X) <answer> Paris "
             "</answer></information>\n\n", "<answer> Ana Osk </answer>", "<answer> paris </answer>",
             "<answer> the Mirren river </answer>", "no tags at all", "<answer>1984</answer>", "<|im_end|>"]
    for _ in range(n):
        yield "".join(rng.choice(parts) for _ in range(rng.randint(0, 5))), {"target": rng.choice(golds)}


@pytest.mark.parametrize("reward", ["seed", "em", "f1", "subem"])
def test_reward_function_through_verls_loader_equals_search_r1_rewards(reward):
    config = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": "pkg://verl_ext.reward", "name": "compute_score", "reward_kwargs": {"reward": reward}}}})
    fn = get_custom_reward_fn(config)
    for text, gt in random_responses(hash(reward) % 1000):
        result = fn(data_source="synth", solution_str=text, ground_truth=gt, extra_info={"index": 0})
        assert result["score"] == get_reward_fn(reward)(text, gt), text
        assert {k: result[k] for k in ("em", "f1", "subem")} == \
            {k: get_reward_fn(k)(text, gt) for k in ("em", "f1", "subem")}


def test_reward_reads_the_last_answer_only():
    from verl_ext.reward import compute_score

    text = "<answer> London </answer> wait <answer> Paris </answer>"
    assert compute_score("nq", text, {"target": ["paris"]}, reward="em")["score"] == 1.0
    assert compute_score("nq", "<answer> Paris </answer> then <answer> London </answer>",
                         {"target": ["paris"]}, reward="em")["score"] == 0.0
    with pytest.raises(ValueError, match="valid rewards"):
        compute_score("nq", text, {"target": ["paris"]}, reward="bleu")
