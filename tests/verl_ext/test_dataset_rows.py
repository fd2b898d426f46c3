"""The synthetic world's parquet rows are what verl's real `RLHFDataset` and `AgentLoopWorker` need:
chat messages for `raw_prompt`, `agent_name: search_r1` (the loop verl runs per row), the data source
and the ground truth the reward function reads."""
from __future__ import annotations

from omegaconf import OmegaConf
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from search_r1.prompts import make_prompt

from tests.search_r1.rollout.scripted import smollm2_tokenizer
from tests.verl_ext.helpers import verl_config


def test_rlhf_dataset_reads_the_world_rows(synth_world):
    data_cfg = verl_config(data__max_prompt_length=512).data
    OmegaConf.update(data_cfg, "dataloader_num_workers", 0)
    ds = RLHFDataset(str(synth_world / "train.parquet"), smollm2_tokenizer(), data_cfg)
    assert len(ds) > 10
    rows = [ds[i] for i in range(4)]
    for row in rows:
        assert row["agent_name"] == "search_r1"
        assert row["raw_prompt"] == [{"role": "user", "content": make_prompt(row["question"])}]
        assert row["reward_model"]["ground_truth"]["target"] and row["data_source"]
        assert row["index"] == row["extra_info"]["index"]
    batch = collate_fn(rows)  # what the trainer's dataloader hands the agent-loop workers
    assert list(batch["agent_name"]) == ["search_r1"] * 4
