"""use_openai=True: rollouts through a local fake of vLLM's /v1/completions (the API is the boundary)."""
import math

import pytest

from search_r1.grpo import GRPOTrainer, MockSearchEngine, PolicyUpdateUnavailable, SearchR1Config
from search_r1.models import load_model_and_tokenizer
from search_r1.rollout.backends import HFGenerator
from tests.search_r1.rollout.test_backends_openai import FakeVLLM


@pytest.fixture(scope="module")
def server():
    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    fake = FakeVLLM(HFGenerator(model, tokenizer), tokenizer)
    yield fake
    fake.close()


def test_rollouts_go_to_the_api_and_updates_are_refused(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
    cfg = SearchR1Config(use_openai=True, openai_base_url=server.base_url + "/v1", openai_model="tiny",
                         model_name_or_path="tiny-random-qwen3", max_tokens=12, progress=False)
    trainer = GRPOTrainer(cfg, search_engine=MockSearchEngine({}))
    assert trainer.model is None and trainer.config.openai_api_key == "sk-local"
    t = trainer.generate_trajectory("Who founded Veltra?", ground_truth="Ana Osk")
    request = server.requests[-1]
    assert request["model"] == "tiny" and request["prompt"] == trainer.prompt_ids("Who founded Veltra?")
    assert request["stop"] == ["</search>", "</answer>"] and request["max_tokens"] == 12
    assert 0 < len(t.token_steps) <= 12 and t.reward == -1.0
    for p, step in zip(t.generated_positions, t.token_steps):
        assert t.full_input_ids[p] == step.token_id
        assert math.isfinite(step.log_prob) and step.log_prob <= 0.0  # log-probs reported by the API
    with pytest.raises(PolicyUpdateUnavailable, match="use_openai=True"):
        trainer.update_policy([t])
    with pytest.raises(PolicyUpdateUnavailable, match="no gradient flows through an API"):
        trainer.train_step(["Who founded Veltra?"], [["Ana Osk"]])
    with pytest.raises(ValueError, match="do not pass model="):
        GRPOTrainer(cfg, search_engine=MockSearchEngine({}), model=object())
