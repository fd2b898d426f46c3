"""The `search_r1` trainer mode: registered, behaves as verl's sync mode, and its metric helpers give
hand-computed values. (The whole fit() runs in part 2's end-to-end test, tests/verl_ext/cpu/.)"""
from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl_ext.trainer import SearchR1Trainer, format_qa_table, likelihood_diagnostics, qa_metrics, search_metrics

from tests.verl_ext.helpers import verl_config


def test_registered_and_behaves_as_sync():
    assert get_trainer_cls("search_r1") is SearchR1Trainer and issubclass(SearchR1Trainer, PPOTrainerSync)
    assert get_trainer_cls("sync") is PPOTrainerSync  # verl's own modes stay selectable
    cfg = verl_config(data__train_batch_size=4)
    assert cfg.trainer.v1.trainer_mode == "search_r1"
    trainer = SearchR1Trainer.__new__(SearchR1Trainer)  # no workers: only the mode-dependent parts
    trainer.config = cfg
    trainer.trainer_mode = cfg.trainer.v1.trainer_mode  # what PPOTrainer.__init__ does
    assert trainer.trainer_mode == "sync" and trainer.registered_mode == "search_r1"
    trainer._add_prompts_to_generate = lambda n: n
    buffer = trainer._build_replay_buffer()
    # verl picks the synchronous replay buffer for "sync" and the async one for any other mode name
    assert type(buffer) is ReplayBuffer and not isinstance(buffer, ReplayBufferAsync)


def test_search_metrics_hand_computed():
    stats = [
        # turns 2, one search, answered
        {"turns": 2, "valid_actions": 2, "valid_searches": 1, "search_failures": 0, "answered": 1, "truncated": 0,
         "generated_tokens": 30, "observation_tokens": 50, "overshoot_tokens": 0, "shortened_observations": 0},
        # turns 3: invalid, search that failed, never answered, truncated
        {"turns": 3, "valid_actions": 1, "valid_searches": 1, "search_failures": 1, "answered": 0, "truncated": 1,
         "generated_tokens": 10, "observation_tokens": 20, "overshoot_tokens": 4, "shortened_observations": 1,
         "prompt_cut": 7},
    ]
    m = search_metrics(stats)
    assert m["env/turns_mean"] == 2.5 and m["env/searches_mean"] == 1.0
    assert m["env/valid_action_ratio"] == 3 / 5  # valid actions over all turns of the batch
    assert m["env/finish_ratio"] == 0.5 and m["env/search_failures"] == 1.0
    assert m["env/search_failure_rate"] == 0.5  # 1 failed of 2 issued
    assert m["response/generated_tokens_mean"] == 20.0 and m["response/obs_tokens_mean"] == 35.0
    assert m["response/truncated_ratio"] == 0.5 and m["response/overshoot_tokens"] == 4.0
    assert m["prompt/cut_ratio"] == 0.5  # one of two prompts was cut
    assert search_metrics([]) == {}


def test_qa_metrics_and_table():
    sources = ["nq", "nq", "hotpotqa", "nq"]
    extra = {"em": [1.0, 0.0, 1.0, 1.0], "f1": [1.0, 0.5, 1.0, 1.0], "reward": [1, 0, 1, 1], "acc": [1, 0, 1, 1]}
    m = qa_metrics(sources, extra)
    assert m["val/nq/em"] == pytest.approx(2 / 3) and m["val/nq/f1"] == pytest.approx(2.5 / 3)
    assert m["val/hotpotqa/em"] == 1.0 and m["val/nq/n"] == 3 and m["val/hotpotqa/n"] == 1
    assert m["val/em"] == 0.75 and m["val/f1"] == pytest.approx(3.5 / 4) and m["val/n"] == 4  # pooled
    table = format_qa_table([(0, m), (50, qa_metrics(["nq"], {"em": [0.0], "f1": [0.25]}))])
    lines = table.splitlines()
    assert lines[0].split() == ["step", "data_source", "n", "EM", "F1"]
    assert lines[1].split() == ["0", "hotpotqa", "1", "1.000", "1.000"]
    assert lines[2].split() == ["0", "nq", "3", "0.667", "0.833"]
    assert lines[3].split() == ["0", "all", "4", "0.750", "0.875"]
    assert lines[4].split()[:4] == ["50", "nq", "1", "0.000"] and lines[-1].split()[1] == "all"
    # a sample whose reward manager produced no em (None) is skipped, not counted as 0
    assert qa_metrics(["nq", "nq"], {"em": [None, 1.0]})["val/nq/em"] == 1.0


def test_likelihood_diagnostics_hand_computed():
    # row 0 correct (EM 1), 2 tokens: old [-1, -3] (mean -2), rollout [-1, -1]; A = 1 -> preserved,
    #   sum old - rollout = -2 < 0: the sampler rated it likelier than the actor ("fell")
    # row 1 incorrect (EM 0), 1 token (2nd is padding): old -4, rollout -5; A = -1 (not preserved)
    mask = torch.tensor([[1, 1], [1, 0]])
    old = torch.tensor([[-1.0, -3.0], [-4.0, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0], [-5.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    m = likelihood_diagnostics([1.0, 0.0], mask, old, adv, rollout)
    assert m == pytest.approx({"likelihood/correct_logp_old": -2.0, "likelihood/correct_logp_rollout": -1.0,
                               "likelihood/incorrect_logp_old": -4.0, "likelihood/incorrect_logp_rollout": -5.0,
                               "likelihood/preserved_fell_frac_old_vs_rollout": 1.0})
    # no rollout log-probs: only what pi_old gives
    assert likelihood_diagnostics([1.0, 0.0], mask, old, adv) == pytest.approx(
        {"likelihood/correct_logp_old": -2.0, "likelihood/incorrect_logp_old": -4.0})
