"""A short `train` run on SmolLM2-135M-Instruct: the notebook path end to end on the real small model."""
import math

import pytest

from search_r1.grpo import GRPOTrainer, MockSearchEngine, SearchR1Config, synthetic_knowledge_base
from search_r1.grpo.data import load_training_data


@pytest.mark.slow
def test_train_two_steps_on_smollm2_then_resume(synth_world, tmp_path):
    queries, answers = load_training_data(synth_world / "train.jsonl", limit=2)
    cfg = SearchR1Config(model_name_or_path="smollm2-135m-instruct", device="cpu", max_tokens=32, group_size=2,
                         update_times=1, num_epochs=1, batch_size=1, save_interval=2, output_dir=str(tmp_path),
                         progress=False, log_interval=1)
    trainer = GRPOTrainer(cfg, search_engine=MockSearchEngine(synthetic_knowledge_base(synth_world)))
    history = trainer.train(queries, answers)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert math.isfinite(h["loss"]) and math.isfinite(h["kl_div"]) and h["skipped"] == 0
        assert 0 < h["avg_tokens"] <= 32 and -1.0 <= h["avg_reward"] <= 2.5
    assert (tmp_path / "global_step_2" / "optimizer.pt").is_file()
    resumed = GRPOTrainer(cfg, search_engine=MockSearchEngine({}), model=trainer.model, tokenizer=trainer.tokenizer)
    resumed.load(tmp_path)
    assert resumed.global_step == 2 and resumed.train(queries, answers) == []  # the epoch is already done
