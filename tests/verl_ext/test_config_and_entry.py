"""configs/grpo_verl.yaml against the installed verl: it composes, overrides apply, verl's own checks
and typed configs accept it; verl_ext.main's pre-Ray checks name the key and the fix; and
scripts/train_grpo.sh routes to the right trainer (checked with a stand-in python and nvidia-smi)."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_ext.main import CARD_RULE, ConfigError, check_config

from tests.verl_ext.helpers import REPO, verl_config

CONFIG = REPO / "verl_ext" / "configs" / "grpo_verl.yaml"


def test_composes_with_upstream_recipe_and_overrides():
    cfg = verl_config()
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    # upstream Search-R1 train_grpo.sh (UPSTREAM_NOTES); the batch as the recipe card declares it
    # (tests/verl_ext/test_recipe.py holds every schedule line against upstream's)
    assert (cfg.data.train_batch_size, r.n, a.ppo_mini_batch_size) == (480, 5, 48)
    assert (a.optim.lr, a.optim.lr_warmup_steps_ratio, a.optim.clip_grad) == (1e-6, 0.285, 1.0)
    assert (a.use_kl_loss, a.kl_loss_type, a.kl_loss_coef, a.clip_ratio_low, a.clip_ratio_high, a.entropy_coeff) == \
        (True, "low_var_kl", 0.001, 0.2, 0.2, 0.001)
    assert (cfg.search_r1.max_turns, cfg.search_r1.max_obs_length, cfg.search_r1.max_tokens_per_turn,
            cfg.search_r1.max_context_length, cfg.search_r1.retriever.topk) == (2, 500, 500, 4096, 3)
    assert (r.prompt_length, r.response_length) == (2048, 2500)  # interpolated from data.*
    assert (r.name, r.mode, r.agent.default_agent_loop, r.calculate_log_probs) == ("vllm", "async", "search_r1", True)
    assert (cfg.algorithm.adv_estimator, cfg.trainer.v1.trainer_mode) == ("grpo", "search_r1")
    assert cfg.reward.custom_reward_function.path == "pkg://verl_ext.reward"
    # keys verl defines and we do not touch keep verl's defaults
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 1 and cfg.critic.enable is None
    over = verl_config(actor_rollout_ref__rollout__n=3, search_r1__retriever__urls=["http://h1:8000", "http://h2:8000"])
    assert over.actor_rollout_ref.rollout.n == 3 and list(over.search_r1.retriever.urls) == ["http://h1:8000", "http://h2:8000"]


def test_verls_own_validation_and_typed_configs_accept_it():
    cfg = verl_config()
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    OmegaConf.resolve(cfg)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    algo = omega_conf_to_dataclass(cfg.algorithm)
    assert rollout.agent.default_agent_loop == "search_r1" and actor.kl_loss_type == "low_var_kl"
    assert algo.adv_estimator == "grpo" and actor.clip_ratio_c == 1e9


@pytest.mark.parametrize("path", sorted(CONFIG.parent.rglob("*.yaml")),
                         ids=lambda p: str(p.relative_to(CONFIG.parent)))
def test_every_field_has_a_comment_above_it(path):
    """As verl's CI requires of its own YAML: every field of every shipped verl config has a comment
    line right above it. Keys that only open a block of other keys (`actor:`) are exempt; their
    fields carry the comments."""
    lines = path.read_text().splitlines()
    indent = [len(x) - len(x.lstrip()) for x in lines]
    missing = []
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z_][\w.]*:", line):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        opens_block = line.rstrip().endswith(":") and indent[i + 1] > indent[i] and not nxt.strip().startswith("-")
        if not opens_block and not lines[i - 1].strip().startswith("#"):
            missing.append(f"line {i + 1}: {line.strip()}")
    assert not missing, missing


@pytest.mark.parametrize("override, message", [
    ({"search_r1__max_obs_lenght": 5}, r"unknown key\(s\) \['search_r1.max_obs_lenght'\]"),
    ({"search_r1__max_obs_length": 0}, r"max_obs_length must be an int >= 1.*search_r1.max_obs_length"),
    ({"search_r1__protocol": "json"}, r"allowed values: \['tags', 'tool_call'\]"),
    ({"data__max_response_length": 10, "search_r1__max_context_length": 20},
     r"max_start_length \(2048\) must be less than max_prompt_length \(20\).*actor_rollout_ref.rollout.prompt_length"),
    ({"algorithm__adv_estimator": "grpoo"}, r"algorithm.adv_estimator='grpoo' is not registered.*'search_r1_grpo'"),
    ({"trainer__v1__trainer_mode": "fast"}, r"trainer.v1.trainer_mode='fast' is not registered.*'search_r1', 'separate_async', 'sync'"),
    ({"actor_rollout_ref__rollout__agent__default_agent_loop": "search"}, r"default_agent_loop='search'.*'search_r1'"),
    ({"reward__custom_reward_function__reward_kwargs__reward": "bleu"}, r"reward='bleu' is not registered.*'em'"),
    ({"data__train_batch_size": 3, "trainer__n_gpus_per_node": 2, "actor_rollout_ref__rollout__n": 1},
     r"validate_config rejected.*real_train_batch_size \(3\) must be divisible"),
])
def test_config_errors_name_the_key_before_any_ray_start(override, message):
    with pytest.raises(ConfigError, match=message):
        check_config(verl_config(**override), dry_run=True)


def test_real_run_checks_data_files_and_retriever(tmp_path, retriever_server, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # past the GPU check: no GPU here
    with pytest.raises(ConfigError, match=r"data.train_files: .*nowhere.parquet does not exist. Fix: prepare"):
        check_config(verl_config(data__train_files=str(tmp_path / "nowhere.parquet")))
    data = tmp_path / "d.parquet"
    data.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no retriever in search_r1.retriever.urls answers.*retriever_server serve"):
        check_config(verl_config(data__train_files=str(data), data__val_files=str(data),
                                 search_r1__retriever__urls=["http://127.0.0.1:9"]))
    # one live URL of two: a warning for the dead one, no error
    warnings = check_config(verl_config(data__train_files=str(data), data__val_files=str(data),
                                        search_r1__retriever__urls=["http://127.0.0.1:9", retriever_server.url]))
    assert len(warnings) == 1 and "127.0.0.1:9" in warnings[0]
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA GPU is visible.*grpo_verl_cpu"):
        check_config(verl_config(data__train_files=str(data), data__val_files=str(data)))


def test_retriever_check_sends_retriever_api_key(tmp_path, retriever_server, start_retriever, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # past the GPU check: no GPU here
    monkeypatch.delenv("RETRIEVER_API_KEY", raising=False)
    server = start_retriever(retriever_server.index_dir, api_key="s3cret")
    data = tmp_path / "d.parquet"
    data.write_bytes(b"")
    cfg = verl_config(data__train_files=str(data), data__val_files=str(data), search_r1__retriever__urls=[server.url])
    with pytest.raises(ConfigError, match=r"HTTP 401 \(no key sent\).*RETRIEVER_API_KEY"):
        check_config(cfg)
    monkeypatch.setenv("RETRIEVER_API_KEY", "s3cret")  # what the agent loop's RetrieverClient sends
    assert check_config(cfg) == []


# -- scripts/train_grpo.sh routing ----------------------------------------------------------------
def _stub(path, body):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def route(tmp_path, *args, gpus: int = 0, env=None):
    """argv the script hands to python (a stand-in that prints it), with `gpus` fake GPUs visible."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = _stub(tmp_path / "python", 'if [[ "$1" == "-c" ]]; then echo 0; exit 0; fi; printf "%s\\n" "$@"\n')
    smi = bin_dir / "nvidia-smi"
    if gpus:
        _stub(smi, "".join(f'echo "GPU {i}: Fake GPU (UUID: GPU-{i})"\n' for i in range(gpus)))
    elif smi.exists():
        smi.unlink()
    run_env = {**os.environ, "PYTHON": str(python), "PATH": f"{bin_dir}:{os.environ['PATH']}", **(env or {})}
    run_env.pop("SEARCH_R1_FORCE_CPU", None) if not env or "SEARCH_R1_FORCE_CPU" not in env else None
    out = subprocess.run(["bash", str(REPO / "scripts" / "train_grpo.sh"), *args], env=run_env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def test_script_routes_each_case(tmp_path):
    # no GPU, no config name: the embedded CPU trainer, arguments untouched (today's default path)
    assert route(tmp_path, "trainer.total_steps=5", "-m", "optim.lr=1e-5,3e-5") == \
        ["-m", "search_r1.trainer.main", "trainer.total_steps=5", "-m", "optim.lr=1e-5,3e-5"]
    assert route(tmp_path, "--dry-run") == ["-m", "search_r1.trainer.main", "--cfg", "job", "--resolve"]
    # GPUs visible: verl's trainer with grpo_verl and the GPU count, sweeps forwarded
    assert route(tmp_path, "-m", "actor_rollout_ref.actor.optim.lr=1e-6,3e-6", gpus=4) == \
        ["-m", "verl_ext.main", "--config-name", "grpo_verl", "-m", "actor_rollout_ref.actor.optim.lr=1e-6,3e-6",
         "trainer.n_gpus_per_node=4"]
    # the user's own GPU count wins; SEARCH_R1_FORCE_CPU=1 keeps the CPU trainer
    assert route(tmp_path, "trainer.n_gpus_per_node=2", gpus=4)[-1] == "trainer.n_gpus_per_node=2"
    assert route(tmp_path, gpus=4, env={"SEARCH_R1_FORCE_CPU": "1"}) == ["-m", "search_r1.trainer.main"]
    # verl configs by name on any machine; --dry-run forwarded to verl_ext.main
    assert route(tmp_path, "--dry-run", "--config-name", "grpo_verl") == \
        ["-m", "verl_ext.main", "--dry-run", "--config-name", "grpo_verl"]
    assert route(tmp_path, "--config-name=grpo_verl_cpu", gpus=2) == ["-m", "verl_ext.main", "--config-name=grpo_verl_cpu"]
    # PPO with a critic goes to verl's trainer too, with the GPU count
    assert route(tmp_path, "--config-name", "ppo_verl", gpus=4) == \
        ["-m", "verl_ext.main", "--config-name", "ppo_verl", "trainer.n_gpus_per_node=4"]
    assert route(tmp_path, "--dry-run", "--config-name=ppo_verl") == \
        ["-m", "verl_ext.main", "--dry-run", "--config-name=ppo_verl"]
    # *_cpu_* configs are CPU configs too: no GPU count added
    assert route(tmp_path, "--config-name", "grpo_verl_cpu_vllm", gpus=2) == \
        ["-m", "verl_ext.main", "--config-name", "grpo_verl_cpu_vllm"]


def test_offline_mode_only_on_the_cpu_paths(tmp_path):
    """A fresh GPU node must download grpo_verl's hub model: the script sets the HF offline switches
    for the CPU paths only, and never overrides the user's own setting."""
    python = _stub(tmp_path / "python", 'if [[ "$1" == "-c" ]]; then echo 0; exit 0; fi; '
                                        'echo "hub=${HF_HUB_OFFLINE:-unset} tf=${TRANSFORMERS_OFFLINE:-unset}"\n')

    def env_seen(*args, **extra):
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                  "SEARCH_R1_FORCE_CPU")}
        env.update(PYTHON=str(python), PATH=f"{tmp_path}:{os.environ['PATH']}", **extra)
        return subprocess.run(["bash", str(REPO / "scripts" / "train_grpo.sh"), *args], env=env,
                              capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    assert env_seen("--config-name", "grpo_verl") == "hub=unset tf=unset"
    assert env_seen("--dry-run", "--config-name", "grpo_verl") == "hub=unset tf=unset"
    assert env_seen("--config-name", "grpo_verl_cpu") == "hub=1 tf=1"
    assert env_seen("trainer.total_steps=5") == "hub=1 tf=1"  # no GPU here: the embedded CPU trainer
    assert env_seen("trainer.total_steps=5", HF_HUB_OFFLINE="0") == "hub=0 tf=1"


def test_dry_run_prints_the_resolved_config_and_the_recipe_card_on_this_machine():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    env.pop("SEARCH_R1_FORCE_CPU", None)
    out = subprocess.run(["bash", str(REPO / "scripts" / "train_grpo.sh"), "--dry-run", "--config-name", "grpo_verl",
                          "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
                          "search_r1.max_turns=4"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    config, card = out.stdout.split(CARD_RULE + "\n")
    printed = OmegaConf.create(config[config.index("model_engine:"):])
    assert printed.actor_rollout_ref.rollout.n == 3 and printed.search_r1.max_turns == 4
    assert printed.actor_rollout_ref.rollout.prompt_length == 2048  # interpolations resolved
    assert "does not exist" in out.stderr  # the default data paths are missing here: a warning only
    # the card, after the checks, from this composed config: n=3 -> 480 x 3 = 1440 trajectories,
    # 48 x 3 = 144 per update, 10 updates, 144 / 8 GPUs = 18 per GPU in 3 micro-batches of 6; 4 search turns
    assert card.startswith("Recipe card: grpo_verl on 8 GPUs")
    lines = {line[:40].strip(): line[40:] for line in card.splitlines()}
    assert lines["trajectories per step"].split()[:2] == ["1440", "*"]
    assert lines["optimizer updates per step"].split() == ["10", "10"]
    assert lines["micro-batches per GPU per update"].startswith("3 x 6 trajectories (8 GPUs)")
    assert lines["turns"].startswith("4 with search + 1 final")


def test_ray_env_var_numbers_become_text_and_other_values_name_the_key():
    """Hydra reads `...env_vars.KEY=2` as a number and Ray takes only strings (it raised a TypeError from
    inside ray.init): numbers become their text; a bool, a null or a bad SEARCH_R1_COMPUTE_THREADS names the key."""
    from ray.runtime_env import RuntimeEnv

    key = "ray_kwargs__ray_init__runtime_env__env_vars__"
    cfg = verl_config(**{key + "SEARCH_R1_COMPUTE_THREADS": 2, key + "GOMP_SPINCOUNT": 10000, key + "X": "y"})
    check_config(cfg, dry_run=True)
    env = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
    assert env == {"SEARCH_R1_COMPUTE_THREADS": "2", "GOMP_SPINCOUNT": "10000", "X": "y"}
    RuntimeEnv(env_vars=env)  # Ray's own validation accepts it
    with pytest.raises(ConfigError, match=r"env_vars.DEBUG=True: an environment variable's value is text.*quote"):
        check_config(verl_config(**{key + "DEBUG": True}), dry_run=True)
    with pytest.raises(ConfigError, match=r"env_vars.DEBUG is null: .*remove it with ~ray_kwargs"):
        check_config(verl_config(**{key + "DEBUG": None}), dry_run=True)
    with pytest.raises(ConfigError, match=r"env_vars.SEARCH_R1_COMPUTE_THREADS: SEARCH_R1_COMPUTE_THREADS='many'"):
        check_config(verl_config(**{key + "SEARCH_R1_COMPUTE_THREADS": "many"}), dry_run=True)
