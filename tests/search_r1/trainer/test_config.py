"""Trainer config: every shipped YAML validates, code defaults equal the YAML, and bad values fail
fast with a message naming the key, the value, the allowed values and the fix."""
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from search_r1.trainer.config import CONFIG_DIR, TrainConfig
from search_r1.trainer.main import StartupError, check_cores, check_paths, check_retriever, prepare_data
TRAINER_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("grpo_*.yaml"))


def load(name: str, overrides=()) -> dict:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides))
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    return raw


def test_trainer_configs_are_shipped():
    assert "grpo_cpu" in TRAINER_CONFIGS


@pytest.mark.parametrize("name", TRAINER_CONFIGS)
def test_every_shipped_config_validates(name):
    cfg = TrainConfig.from_dict(load(name))
    assert cfg.trainer.batch_size % cfg.trainer.mini_batch_size == 0


def test_code_defaults_equal_the_default_yaml():
    assert TrainConfig.from_dict(load("grpo_cpu")) == TrainConfig()


def test_every_yaml_field_has_a_comment_above_it():
    for path in CONFIG_DIR.glob("grpo_*.yaml"):
        lines = path.read_text().splitlines()
        section = None
        for i, line in enumerate(lines):
            if line and not line.startswith((" ", "#")):
                section = line.split(":")[0]
            elif section != "hydra" and line.startswith("  ") and not line.lstrip().startswith("#") and ":" in line:
                assert lines[i - 1].lstrip().startswith("#"), f"{path.name}:{i + 1} `{line.strip()}` has no comment"


def test_hydra_overrides_reach_the_dataclasses():
    cfg = TrainConfig.from_dict(load("grpo_cpu", ["rollout.n=2", "optim.lr=3e-5", "algorithm.reward=em"]))
    assert (cfg.rollout.n, cfg.optim.lr, cfg.algorithm.reward) == (2, 3e-5, "em")


def test_plan_kl_coef_defaults_to_kl_coef_and_alone_needs_the_reference():
    from search_r1.trainer.main import worker_spec

    cfg = TrainConfig.from_dict(load("grpo_cpu", ["algorithm.kl_coef=0.02"]))
    assert (cfg.algorithm.plan_kl_coef, cfg.algorithm.plan_kl) == (None, 0.02)
    cfg = TrainConfig.from_dict(load("grpo_cpu", ["algorithm.kl_coef=0", "algorithm.plan_kl_coef=1.0"]))
    assert cfg.algorithm.plan_kl == 1.0 and cfg.algorithm.uses_ref and worker_spec(cfg).use_ref
    cfg = TrainConfig.from_dict(load("grpo_cpu", ["algorithm.kl_coef=0", "algorithm.plan_kl_coef=0"]))
    assert not cfg.algorithm.uses_ref and not worker_spec(cfg).use_ref


def test_anchor_settings_reach_the_workers():
    from search_r1.trainer.main import worker_spec

    assert worker_spec(TrainConfig.from_dict(load("grpo_cpu"))).anchor_plan_weight == 1.0
    spec = worker_spec(TrainConfig.from_dict(load("grpo_cpu", ["algorithm.anchor_coef=2",
                                                               "algorithm.anchor_plan_weight=4"])))
    assert (spec.anchor_coef, spec.anchor_plan_weight) == (2.0, 4.0)


@pytest.mark.parametrize("overrides, fragments", [
    (["algorithm.reward=bleu"], ["algorithm.reward", "'bleu'", "'seed'", "Fix"]),
    (["trainer.batch_size=3", "trainer.mini_batch_size=2"], ["trainer.batch_size", "multiple", "mini_batch_size"]),
    (["trainer.n_workers=3"], ["trainer.n_workers", "divisor"]),
    (["algorithm.grpo_std=sample"], ["algorithm.grpo_std", "population"]),
    (["rollout.top_p=1.5"], ["rollout.top_p", "1.0"]),
    (["rollout.top_p=0.9"], ["rollout.top_p", "1.0", "nucleus"]),
    (["rollout.temperature=0"], ["rollout.temperature", "(0, inf]"]),
    (["algorithm.rollout_is=tis"], ["algorithm.rollout_is", "'token'", "'sequence'"]),
    (["algorithm.plan_kl_coef=-1"], ["algorithm.plan_kl_coef", "[0, inf]"]),
    (["algorithm.entropy_coef=-0.1"], ["algorithm.entropy_coef", "[0, inf]"]),
    (["algorithm.anchor_coef=-1"], ["algorithm.anchor_coef", "[0, inf]"]),
    (["algorithm.anchor_two_hop_share=1.5"], ["algorithm.anchor_two_hop_share", "[0.0, 1.0]"]),
    (["algorithm.anchor_plan_weight=0"], ["algorithm.anchor_plan_weight", "(0, inf]"]),
    (["algorithm.anchor_coef=1", "algorithm.anchor_examples=4", "algorithm.anchor_batch_size=8"],
     ["algorithm.anchor_batch_size", "anchor_examples (4)"]),
    (["algorithm.anchor_coef=1", "algorithm.anchor_two_hop_share=0.5", "rollout.max_turns=1"],
     ["algorithm.anchor_two_hop_share", "rollout.max_turns=2"]),
    (["trainer.total_steps=ten"], ["trainer.total_steps", "integer"]),
    (["trainer.resume=/no/such/ckpt"], ["trainer.resume", "auto"]),
    (["data.train_files=[/no/such/train.parquet]"], ["data.train_files", "/no/such/train.parquet", "does not exist"]),
    (["data.dir=/no/such/dir"], ["data.dir", "train.parquet", "auto"]),
    (["warmstart.train_files=[/no/such/demos.parquet]"], ["warmstart.train_files", "/no/such/demos.parquet",
                                                          "does not exist", "data.train_files"]),
    (["retriever.url=localhost:8000"], ["retriever.url", "http://"]),
    (["trainer.loggers=[console,mlflow]"], ["loggers", "mlflow", "wandb"]),
    (["model.compute_dtype=fp16"], ["model.compute_dtype", "'fp16'", "'auto'"]),
    (["warmstart.format=chat"], ["warmstart.format", "'no_search'", "'rag'"]),
    (["warmstart.batching=random"], ["warmstart.batching", "'shuffled'", "'stratified'"]),
    (["warmstart.lr_schedule=cosine"], ["warmstart.lr_schedule", "'constant'", "'linear'"]),
    (["warmstart.two_hop_share=0.5", "rollout.max_turns=1"], ["warmstart.two_hop_share", "rollout.max_turns=2"]),
    (["warmstart.no_search_share=0.5", "warmstart.format=rag"], ["warmstart.no_search_share", "format=search"]),
    (["warmstart.no_search_share=0.6", "warmstart.two_hop_share=0.5", "rollout.max_turns=2"],
     ["warmstart.no_search_share", "at most 1 - warmstart.two_hop_share"]),
    (["rollout.backend=sglang"], ["rollout.backend", "'hf'", "'vllm'"]),
    (["trainer.val_sampler=vllm"], ["trainer.val_sampler", "'rollout'", "'hf'"]),
    (["trainer.val_baseline=/no/such/run/metrics.jsonl"],
     ["trainer.val_baseline", "no metrics log at /no/such/run/metrics.jsonl", "leave it empty"]),
    (["rollout.backend=vllm", "rollout.vllm_python=/no/such/python"],
     ["no python with vLLM", "/no/such/python", "make install-vllm", "rollout.backend=hf"]),
])
def test_bad_config_fails_fast_naming_key_and_fix(overrides, fragments):
    with pytest.raises(ValueError) as err:  # paths are checked at start-up, the rest when parsing
        check_paths(TrainConfig.from_dict(load("grpo_cpu", overrides)))
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_unknown_keys_and_sections_are_errors():
    raw = load("grpo_cpu")
    raw["trainer"]["total_step"] = 3
    with pytest.raises(ValueError, match=r"trainer\.total_step.*valid keys"):
        TrainConfig.from_dict(raw)
    with pytest.raises(ValueError, match="unknown config section"):
        TrainConfig.from_dict({**load("grpo_cpu"), "critic": {}})


def test_too_many_threads_for_the_cores_is_an_error():
    cfg = TrainConfig.from_dict(load("grpo_cpu", ["trainer.threads_per_worker=1000"]))
    with pytest.raises(ValueError, match="threads_per_worker"):
        check_cores(cfg)


def test_unreachable_retriever_fails_fast_with_the_fix():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StartupError, match=r"unreachable.*retriever_server serve"):
        check_retriever(f"http://127.0.0.1:{port}/retrieve", timeout=1.0)


def test_retriever_check_sends_the_key_the_rollouts_send(retriever_server, start_retriever, monkeypatch):
    """A retriever started with --api-key: the pre-start check sends RETRIEVER_API_KEY as the rollouts'
    RetrieverClient does (it used to send none, so such a retriever failed the check)."""
    from search_r1.search import RetrieverClient

    monkeypatch.delenv("RETRIEVER_API_KEY", raising=False)
    server = start_retriever(retriever_server.index_dir, api_key="s3cret")
    with pytest.raises(StartupError, match=r"refused /retrieve with HTTP 401 \(no key sent\).*Set RETRIEVER_API_KEY"):
        check_retriever(server.url)
    monkeypatch.setenv("RETRIEVER_API_KEY", "s3cret")
    check_retriever(server.url)
    assert RetrieverClient(server.url, topk=1).batch_search(["alpha"])  # the same key reaches the rollouts
    check_retriever(server.url, api_key="s3cret")
    monkeypatch.setenv("RETRIEVER_API_KEY", "wrong")
    with pytest.raises(StartupError, match=r"HTTP 401 \(the key from RETRIEVER_API_KEY sent\)"):
        check_retriever(server.url)


def test_missing_data_file_at_startup(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"")
    (tmp_path / "test.parquet").write_bytes(b"")
    cfg = TrainConfig.from_dict(load("grpo_cpu", [f"data.dir={tmp_path}"]))
    (tmp_path / "test.parquet").unlink()  # removed after validation: caught again at startup
    with pytest.raises(StartupError, match="test.parquet does not exist"):
        prepare_data(cfg)


def test_auto_retriever_serves_for_the_run_and_stops(synth_world, retriever_server, tmp_path):
    import requests

    from search_r1.trainer.config import TrainConfig
    from search_r1.trainer.main import DataPaths, retriever_for_run

    cfg = TrainConfig.from_dict({"retriever": {"url": "auto", "index": str(retriever_server.index_dir)}})
    data = DataPaths(Path(synth_world), (), (), Path(synth_world) / "corpus.jsonl")
    with retriever_for_run(cfg, data, tmp_path) as url:
        assert url != retriever_server.url
        r = requests.post(url, json={"queries": ["who founded the city"], "topk": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["result"][0]) == 2
    with pytest.raises(requests.ConnectionError):  # stopped with the run
        requests.post(url, json={"queries": ["x"]}, timeout=5)


def test_auto_retriever_that_cannot_start_names_its_log(tmp_path):
    from search_r1.trainer.config import TrainConfig
    from search_r1.trainer.main import DataPaths, retriever_for_run

    bad = tmp_path / "index"
    bad.mkdir()
    (bad / "manifest.json").write_text('{"kind": "bm25", "format_version": 999}')
    cfg = TrainConfig.from_dict({"retriever": {"url": "auto", "index": str(bad)}})
    data = DataPaths(tmp_path, (), (), tmp_path / "corpus.jsonl")
    with pytest.raises(StartupError, match=r"(?s)exited with code 2.*retriever.log.*rebuild the index"):
        with retriever_for_run(cfg, data, tmp_path / "logs"):
            pass


def test_auto_data_dir_follows_synth_seed(monkeypatch, tmp_path):
    """data.dir=auto must not train on a cached world of another seed."""
    import json as _json

    from search_r1.trainer.config import TrainConfig
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path))
    for seed in (1, 0, 0):
        data = prepare_data(TrainConfig.from_dict({"data": {"synth_seed": seed}}))
        assert _json.loads((data.dir / "meta.json").read_text())["seed"] == seed
        assert data.dir == tmp_path / "synth" / "default" and data.corpus.is_file()


def test_auto_retriever_rebuilds_its_index_for_a_changed_corpus(synth_world, tmp_path):
    import shutil

    from retriever_server.manifest import file_sha256, read_manifest
    from search_r1.trainer.config import TrainConfig
    from search_r1.trainer.main import DataPaths, retriever_for_run
    from tests._fixtures.retriever import build_retriever_index

    world = tmp_path / "world"
    shutil.copytree(synth_world, world)
    other = tmp_path / "other.jsonl"  # an index built from another corpus sits where ours belongs
    other.write_text("\n".join(open(world / "corpus.jsonl").read().splitlines()[:50]) + "\n")
    build_retriever_index(other, "bm25", world / "index_bm25")
    cfg = TrainConfig.from_dict({"retriever": {"url": "auto"}})
    with retriever_for_run(cfg, DataPaths(world, (), (), world / "corpus.jsonl"), tmp_path / "logs"):
        pass
    assert read_manifest(world / "index_bm25").corpus_sha256 == file_sha256(world / "corpus.jsonl")


def test_retriever_requests_do_not_log_at_info(retriever_server, caplog):
    """Hydra sets the root logger to INFO; httpx would then print one line per search request."""
    import logging

    from search_r1.search import RetrieverClient
    from search_r1.logs import quiet_library_loggers

    levels = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    try:
        quiet_library_loggers()
        with caplog.at_level(logging.INFO):
            check_retriever(retriever_server.url)
            RetrieverClient(retriever_server.url, topk=1).batch_search(["alpha"])
        assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_reuse_freed_memory_is_off_by_default_and_reaches_the_worker():
    """trainer.reuse_freed_memory -> WorkerSpec -> glibc's settings in the worker's process."""
    from search_r1.trainer.main import worker_spec
    from tests._fixtures.memory_kept import memory_kept

    assert not worker_spec(TrainConfig.from_dict(load("grpo_cpu"))).reuse_freed_memory
    assert worker_spec(TrainConfig.from_dict(load("grpo_cpu", ["trainer.reuse_freed_memory=true"]))).reuse_freed_memory
    if sys.platform.startswith("linux"):
        assert memory_kept("worker-off")[0] < 20
        kept, after_release = memory_kept("worker")
        assert kept > 90 and after_release < 20, (kept, after_release)


def test_omp_spincount_reaches_the_worker_env():
    """trainer.omp_spincount -> WorkerSpec -> the actors' environment: N > 0 (10000 by default) spins
    N times (GOMP_SPINCOUNT) without also naming PASSIVE (the opposite policy); 0 sleeps at once."""
    from search_r1.trainer.main import worker_spec
    from search_r1.trainer.workers import worker_env

    env = worker_env(worker_spec(TrainConfig.from_dict(load("grpo_cpu"))))
    assert env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    env = worker_env(worker_spec(TrainConfig.from_dict(load("grpo_cpu", ["trainer.omp_spincount=0"]))))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["GOMP_SPINCOUNT"] == "0"
    with pytest.raises(ValueError, match="trainer.omp_spincount"):
        TrainConfig.from_dict(load("grpo_cpu", ["trainer.omp_spincount=-1"]))


@pytest.mark.parametrize("spincount, inherited, want", [
    (10000, {"OMP_WAIT_POLICY": "PASSIVE"}, "10000"),  # a shell profile's PASSIVE does not undo the spin
    (10000, {"OMP_WAIT_POLICY": "ACTIVE"}, "10000"),  # nor ACTIVE's 30 billion spins
    (0, {"GOMP_SPINCOUNT": "300000"}, "0"),  # nor an inherited spin count the PASSIVE setting
])
def test_torch_openmp_runtime_takes_the_worker_env(spincount, inherited, want):
    """What torch's OpenMP runtime (libgomp) resolves from worker_env laid over an inherited
    environment, as Ray lays an actor's env_vars over its raylet's: read back with
    OMP_DISPLAY_ENV=VERBOSE, which libgomp prints when torch loads it. Fails if torch ships another
    OpenMP runtime (Intel's or LLVM's ignore GOMP_SPINCOUNT), where the knob would do nothing."""
    import os
    import re
    import subprocess

    from search_r1.trainer.workers import WorkerSpec, worker_env

    env = {**os.environ, **inherited, **worker_env(WorkerSpec(model_name="m", omp_spincount=spincount)),
           "OMP_DISPLAY_ENV": "VERBOSE"}
    out = subprocess.run([sys.executable, "-c", "import torch; torch.ones(8).sum()"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr + out.stdout)
    assert found == [want], (out.stderr + out.stdout)[-2000:]


def test_llds_and_on_alarm_keys_are_checked_with_the_fix():
    base = {"trainer": {"batch_size": 2, "mini_batch_size": 1}}
    cfg = TrainConfig.from_dict({**base, "algorithm": {"llds_coef": 0.1, "llds_gate": "response"}})
    assert (cfg.algorithm.llds_coef, cfg.algorithm.llds_gate) == (0.1, "response")
    with pytest.raises(ValueError, match=r"algorithm.llds_gate='turn'.*\['response', 'action'\]"):
        TrainConfig.from_dict({**base, "algorithm": {"llds_gate": "turn"}})
    # one update per batch: pi_theta == pi_old in it, so LLDS would be 0; the error says what to change
    with pytest.raises(ValueError, match=r"algorithm.llds_coef=0.1.*trainer.mini_batch_size"):
        TrainConfig.from_dict({"algorithm": {"llds_coef": 0.1}})
    assert TrainConfig.from_dict({"algorithm": {"llds_coef": 0.1}, "trainer": {"ppo_epochs": 2}}).algorithm.llds_coef == 0.1
    with pytest.raises(ValueError, match=r"trainer.on_alarm='halt'.*\['warn', 'stop', 'rollback'\]"):
        TrainConfig.from_dict({"trainer": {"on_alarm": "halt"}})
    with pytest.raises(ValueError, match=r"trainer.rollback_lr_scale=0.0"):
        TrainConfig.from_dict({"trainer": {"rollback_lr_scale": 0.0}})
