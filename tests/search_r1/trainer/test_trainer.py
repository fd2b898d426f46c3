"""End to end: the GRPO fit loop through Ray workers and the real retriever server (tiny model).

One 2-step run is shared by the tests of this module (Ray and model startup dominate on 2 cores):
its metrics are present and finite, checkpoints and the plot are written, and resuming from its
step-1 checkpoint reproduces its step-2 metrics exactly.
"""
import json
import math
import shutil
import socket
import time

import pytest
import torch

from search_r1.trainer.config import TrainConfig
from search_r1.trainer.main import StartupError, run

pytestmark = pytest.mark.slow

STEP_KEYS = [
    "reward/mean", "reward/std", "reward/em", "reward/format_valid", "actor/kl_loss", "actor/pg_loss",
    "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm", "actor/lr", "env/turns_mean",
    "env/searches_mean", "env/valid_action_ratio", "response/length_mean", "response/obs_tokens_mean",
    "timing/gen", "timing/search", "timing/old_log_prob", "timing/ref", "timing/reward", "timing/adv",
    "timing/update_actor", "timing/step",
]


def tiny_config(world, url, out, **trainer) -> TrainConfig:
    t = dict(total_steps=2, batch_size=2, mini_batch_size=1, micro_batch_size=2, val_batch_size=2,
             test_freq=0, save_freq=1, keep_last=3, resume="none", n_workers=1, threads_per_worker=1,
             seed=3, output_dir=str(out), loggers=["jsonl", "tensorboard"])
    t.update(trainer)
    return TrainConfig.from_dict({
        "model": {"name": "tiny-random-qwen3"},
        "data": {"train_files": [str(world / "train.parquet")], "test_files": [str(world / "test.parquet")],
                 "val_size": 2},
        "retriever": {"url": url, "topk": 2},
        "rollout": {"n": 2, "max_turns": 1, "max_tokens_per_turn": 8, "max_response_length": 64,
                    "max_obs_length": 32, "max_prompt_length": 512},
        # the random model scores every sample alike, so its updates would be skipped: this file
        # checks the update path (test_grpo_step.py checks the skip)
        "algorithm": {"kl_coef": 0.01, "entropy_coef": 0.01, "skip_zero_advantage": False},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "trainer": t,
        "warmstart": {"enabled": False},  # covered by test_warmstart.py; these tests check the GRPO loop
    })


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_record(out, step):
    return next(r for r in records(out) if r["step"] == step and "reward/mean" in r)


@pytest.fixture(scope="module")
def two_step_run(ray_session, retriever_server, synth_world, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_run")
    summary = run(tiny_config(synth_world, retriever_server.url, out))
    return out, summary


def test_two_step_run_logs_finite_metrics_and_checkpoints(two_step_run):
    out, summary = two_step_run
    for step in (1, 2):
        rec = train_record(out, step)
        missing = [k for k in STEP_KEYS if k not in rec]
        assert not missing, missing
        bad = {k: rec[k] for k in STEP_KEYS if rec[k] is None or not math.isfinite(rec[k])}
        assert not bad, bad
        assert rec["response/length_mean"] > 0 and rec["timing/gen"] > 0
    vals = [r for r in records(out) if "val/em" in r]
    assert [r["step"] for r in vals] == [0, 2]  # before training and at the end
    assert any(k.startswith("val/") and k.count("/") == 2 for k in vals[0])  # per data_source
    assert summary["val_before"]["val/n"] == 2
    # the same validations question by question, as the eval CLI records them
    from search_r1.evaluation.compare import Run
    runs = Run.load_validations(out)
    assert list(runs) == [0, 2]
    for rec, run in zip(vals, runs.values()):
        assert len(run.records) == 2
        assert sum(r["em"] for r in run.records.values()) / 2 == rec["val/em"]
        assert sum(r["searches"] for r in run.records.values()) / 2 == rec["val/searches"]
        for r in run.records.values():
            assert r["question"] and r["golden_answers"] and r["response"]
            assert r["prediction"] is None or r["prediction"] in r["response"]
    assert set(runs[0].records) == set(runs[2].records)  # the same questions, keyed alike
    # checkpoints: HF directory transformers can load, plus optimizer/scheduler/loader state
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("global_step_*"))
    assert ckpts == ["global_step_1", "global_step_2"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "global_step_2" / "model")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (out / "training_curves.png").stat().st_size > 0
    assert list((out / "tensorboard").glob("events.*"))


def test_resume_reproduces_the_next_step_exactly(two_step_run, retriever_server, synth_world, tmp_path):
    out, _ = two_step_run
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(out / "checkpoints" / "global_step_1", tmp_path / "checkpoints" / "global_step_1")
    summary = run(tiny_config(synth_world, retriever_server.url, tmp_path, resume="auto"))
    assert summary["resumed_from"] == 1
    expected, got = train_record(out, 2), train_record(tmp_path, 2)
    compared = [k for k in expected if not k.startswith(("timing/", "perf/")) and k not in ("time",)]
    assert len(compared) > 20
    assert {k: got[k] for k in compared} == {k: expected[k] for k in compared}
    assert not [r for r in records(tmp_path) if r["step"] == 1]  # step 1 was not re-run


def test_unreachable_retriever_fails_before_starting_anything(synth_world, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(StartupError, match="unreachable"):
        run(tiny_config(synth_world, f"http://127.0.0.1:{port}/retrieve", tmp_path))
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "metrics.jsonl").exists()
