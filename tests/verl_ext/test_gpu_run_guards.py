"""What a new reading of the GPU run against verl 0.9.1 found, each guarded before a GPU hour is spent:
the attention kernel a fresh `.[gpu]` node cannot import; a `-m` sweep whose jobs shared one checkpoint
directory (job 2 resumed job 1); an auto-resume into a directory whose recorded recipe differs; the
retriever key that workers on other nodes never got (forwarded through Ray, never printed); a step
whose every search failed (the run stops with the cause); the documented Qwen3 override; the GPU count
from CUDA_VISIBLE_DEVICES."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from verl_ext.main import (RECIPE_RECORD, ConfigError, check_attention, check_config, check_resume_record,
                           forwarded_secrets, job_local_dir)
from verl_ext.trainer import search_outage

from tests.verl_ext.helpers import REPO, verl_config
from tests.verl_ext.test_config_and_entry import route


# -- attention ----------------------------------------------------------------------------------------
def test_flash_attention_without_flash_attn_is_refused_with_the_fix(monkeypatch):
    """verl builds the actor with flash_attention_2 unless override_config names another; `.[gpu]`
    installs no flash-attn, so that default failed in every worker's init_model."""
    pytest.importorskip("torch")
    if __import__("importlib").util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    assert check_attention(verl_config()) is None  # grpo_verl: sdpa on padded batches
    cfg = verl_config()
    del cfg.actor_rollout_ref.model.override_config["attn_implementation"]  # verl's default
    cfg.actor_rollout_ref.model.use_remove_padding = True
    problem = check_attention(cfg)
    assert "attn_implementation=flash_attention_2 (verl's default when unset) needs the `flash_attn` package" in problem
    assert "pip install flash-attn --no-build-isolation" in problem
    assert "attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=false" in problem
    # --dry-run warns (any machine may check a config), a real run stops before Ray
    assert any("flash_attn" in w for w in check_config(cfg, dry_run=True))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # past the GPU check: no GPU here
    with pytest.raises(ConfigError, match="flash_attn"):
        check_config(cfg, dry_run=False)


# -- sweeps and resumes -------------------------------------------------------------------------------
def test_each_sweep_job_gets_its_own_checkpoint_directory(tmp_path, retriever_server):
    """The documented `-m actor_rollout_ref.actor.optim.lr=1e-6,3e-6`: before, both jobs had one
    default_local_dir and resume_mode=auto, so job 1 resumed job 0's checkpoint."""
    data = tmp_path / "d.parquet"
    data.write_bytes(b"")
    code = ("import sys, runpy, torch, verl.trainer.main_ppo as m\n"
            "torch.cuda.is_available = lambda: True\n"
            "m.run_ppo = lambda config, task_runner_class: print('RUN_DIR', config.trainer.default_local_dir)\n"
            "sys.argv = ['verl_ext.main'] + sys.argv[1:]\n"
            "runpy.run_module('verl_ext.main', run_name='__main__')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, "-m", "actor_rollout_ref.actor.optim.lr=1e-6,3e-6",
                          f"data.train_files={data}", f"data.val_files={data}",
                          f"trainer.default_local_dir={tmp_path / 'sweep'}", f"hydra.sweep.dir={tmp_path / 'multirun'}",
                          f"search_r1.retriever.urls=[{retriever_server.url}]"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    dirs = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("RUN_DIR ")]
    assert dirs == [str(tmp_path / "sweep" / "job0"), str(tmp_path / "sweep" / "job1")], out.stdout[-2000:]
    # each job recorded its own recipe
    lrs = [json.loads((tmp_path / "sweep" / j / RECIPE_RECORD).read_text())["actor_rollout_ref.actor.optim"]["lr"]
           for j in ("job0", "job1")]
    assert lrs == [1e-6, 3e-6]


def test_single_run_directory_is_absolute():
    cfg = verl_config(trainer__default_local_dir="outputs/verl/x")
    assert job_local_dir(cfg) == os.path.join(os.getcwd(), "outputs/verl/x")


def test_auto_resume_into_a_directory_with_another_recipe_is_refused(tmp_path):
    run = tmp_path / "run"
    check_resume_record(verl_config(), str(run))  # a fresh run records its recipe
    assert json.loads((run / RECIPE_RECORD).read_text())["actor_rollout_ref.actor.optim"]["lr"] == 1e-6
    (run / "latest_checkpointed_iteration.txt").write_text("100")  # verl's tracker: a checkpoint exists
    check_resume_record(verl_config(trainer__total_training_steps=2000), str(run))  # steps may change
    with pytest.raises(ConfigError) as err:
        check_resume_record(verl_config(actor_rollout_ref__actor__optim__lr=3e-6, trainer__n_gpus_per_node=4), str(run))
    text = str(err.value)
    assert "actor_rollout_ref.actor.optim.lr: saved 1e-06, now 3e-06" in text
    assert "trainer.n_gpus_per_node: saved 8, now 4" in text
    assert "Fix: a new directory for this run (trainer.experiment_name=NEW" in text and "resume_mode=disable" in text
    # resume_mode=disable starts over there: no refusal, the record is rewritten
    check_resume_record(verl_config(actor_rollout_ref__actor__optim__lr=3e-6, trainer__resume_mode="disable"), str(run))
    assert json.loads((run / RECIPE_RECORD).read_text())["actor_rollout_ref.actor.optim"]["lr"] == 3e-6


# -- the retriever key reaches every worker, and never the log ----------------------------------------
def test_retriever_key_is_forwarded_through_ray_init_and_not_printed(monkeypatch, capsys):
    """verl's run_ppo prints its ray.init arguments, then calls ray.init: the key is added to the
    runtime_env's env_vars (which Ray applies to every worker, on every node) after that print."""
    import ray
    from verl.trainer.main_ppo import run_ppo

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RETRIEVER_API_KEY", "s3cret-key")
    cfg = verl_config(ray_kwargs__ray_init__runtime_env__env_vars__X="1")
    with forwarded_secrets() as names, pytest.raises(Stop):
        run_ppo(cfg, task_runner_class=None)
    assert names == ["RETRIEVER_API_KEY"]
    env_vars = seen["runtime_env"]["env_vars"]
    assert env_vars["RETRIEVER_API_KEY"] == "s3cret-key" and env_vars["X"] == "1"
    assert "ray init kwargs" in capsys.readouterr().out  # verl's own print ran...
    assert ray.init is fake_init  # ...and the wrapper is gone afterwards
    out = capsys.readouterr()
    assert "s3cret-key" not in out.out + out.err
    # a value the config sets explicitly wins; no key in the shell: ray.init untouched
    monkeypatch.delenv("RETRIEVER_API_KEY")
    with forwarded_secrets() as names:
        assert names == [] and ray.init is fake_init


# -- a step whose every search failed stops the run ---------------------------------------------------
def test_a_step_whose_every_search_failed_stops_with_the_cause():
    urls = ["http://10.0.0.5:8000/retrieve"]
    failed = [{"valid_searches": 2, "search_failures": 2, "search_error": "HTTP 401 from http://10.0.0.5:8000 "
                                                                             "(no key sent): set RETRIEVER_API_KEY"},
              {"valid_searches": 1, "search_failures": 1}, {"valid_searches": 0, "search_failures": 0}]
    msg = search_outage(failed, 7, urls)
    assert msg.startswith("every search of step 7 failed (3 of 3)") and "HTTP 401" in msg and urls[0] in msg
    assert "RETRIEVER_API_KEY" in msg
    # one search answered, or no search at all: the run goes on (failures are counted in env/search_failures)
    assert search_outage([*failed, {"valid_searches": 1, "search_failures": 0}], 7, urls) is None
    assert search_outage([{"valid_searches": 0, "search_failures": 0}], 7, urls) is None


# -- documented overrides and the GPU count -----------------------------------------------------------
def test_the_documented_qwen3_override_composes():
    from hydra import compose, initialize_config_dir

    header = (REPO / "configs" / "grpo_verl.yaml").read_text()
    override = "+data.apply_chat_template_kwargs.enable_thinking=false"
    assert override in header
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("grpo_verl", overrides=["actor_rollout_ref.model.path=Qwen/Qwen3-4B", override])
        assert cfg.data.apply_chat_template_kwargs.enable_thinking is False
        with pytest.raises(Exception, match="enable_thinking"):  # without `+`: Hydra refuses the key
            compose("grpo_verl", overrides=[override.lstrip("+")])


def test_gpu_count_honours_cuda_visible_devices(tmp_path):
    """nvidia-smi -L lists every GPU of the node; CUDA_VISIBLE_DEVICES is what this process may use."""
    assert route(tmp_path, gpus=8, env={"CUDA_VISIBLE_DEVICES": "0,1,2"})[-1] == "trainer.n_gpus_per_node=3"
    assert route(tmp_path, gpus=8)[-1] == "trainer.n_gpus_per_node=8"
    assert route(tmp_path, gpus=8, env={"CUDA_VISIBLE_DEVICES": ""}) == ["-m", "search_r1.trainer.main"]
    # --rehearse routes to verl_ext.main with the GPU config, on a machine without GPUs too
    assert route(tmp_path, "--rehearse") == ["-m", "verl_ext.main", "--rehearse", "--config-name", "grpo_verl"]
