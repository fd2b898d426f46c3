"""Seams of verl_ext/cpu against the installed verl: the platform, the verl behaviours the CPU worker
works around (so a verl upgrade that changes them fails here), and the registrations."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import verl  # noqa: F401  (loads the verl.plugins entry point, i.e. verl_ext and verl_ext.cpu)
from verl_ext.cpu.platform import CPU_DEVICE_MODULE, PlatformCPU, compute_threads

REPO = Path(__file__).resolve().parents[3]


def test_platform_is_selected_by_verl_platform_in_a_fresh_process():
    # verl resolves the platform once per process; a fresh interpreter sees what a Ray worker sees.
    code = (
        "import verl\n"
        "from verl.utils.device import get_device_name, get_device_id, get_nccl_backend, get_resource_name\n"
        "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "print(get_device_name(), get_device_id(), get_nccl_backend(), get_resource_name(),\n"
        "      RolloutReplicaRegistry.get('hf').__name__, get_rollout_class('hf').__name__)\n"
    )
    env = {**os.environ, "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["cpu", "cpu", "gloo", "GPU", "HFReplica", "HFServerAdapter"]


def test_cpu_platform_is_detected_only_for_a_torch_without_accelerators(monkeypatch):
    # A CUDA or ROCm build (a GPU host, or a CPU-only Ray actor on one) keeps verl's own detection.
    assert torch.version.cuda is None and not torch.cuda.is_available()  # this machine: CPU-only torch
    assert PlatformCPU().is_platform_available(use_smi_check=True) is True
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert PlatformCPU().is_platform_available(use_smi_check=True) is False
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.3")
    assert PlatformCPU().is_platform_available(use_smi_check=True) is False
    assert PlatformCPU().ray_resource_options(2) == {"num_gpus": 2}


def test_a_cpu_only_process_resolves_the_cpu_platform_without_warnings():
    """The embedded CPU trainer's Ray workers and driver, as a fresh process sees it (no VERL_PLATFORM):
    building a verl Worker and placing a worker group resolve verl's platform. Before, verl fell back
    to 'nvidia' with two warnings per process, on every run."""
    code = (
        "import logging, os\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "os.environ.update(WORLD_SIZE='1', RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT='29500')\n"
        "from verl.single_controller.base import Worker\n"
        "from verl.utils.device import get_device_name, get_visible_devices_keyword\n"
        "Worker()\n"
        "print('RESOLVED', get_device_name(), get_visible_devices_keyword())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RESOLVED cpu CUDA_VISIBLE_DEVICES" in out.stdout
    assert "No supported accelerator detected" not in out.stderr, out.stderr[-2000:]
    assert "is registered but not available" not in out.stderr, out.stderr[-2000:]


def test_device_module_supplies_what_torch_cpu_lacks():
    # verl calls these on get_torch_device(); torch.cpu has none of them (if it gains them, the shim can go).
    for name in ("empty_cache", "mem_get_info", "max_memory_allocated", "get_rng_state", "set_rng_state"):
        assert not hasattr(torch.cpu, name)
    free, total = CPU_DEVICE_MODULE.mem_get_info()
    assert 0 < free <= total
    assert CPU_DEVICE_MODULE.max_memory_allocated() > 0  # this process's RSS
    state = CPU_DEVICE_MODULE.get_rng_state()
    a = torch.rand(3)
    CPU_DEVICE_MODULE.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    assert CPU_DEVICE_MODULE.current_device() == "cpu"  # `.to(get_device_id())` must mean the CPU


def test_verl_builds_a_backend_string_torch_rejects_on_cpu(monkeypatch):
    """Why CPUActorRolloutRefWorker opens the process group itself: verl's helper joins "cpu:gloo" with
    "{device}:{backend}", i.e. "cpu:gloo,cpu:gloo" on CPU, and skips everything if a group exists.
    If verl changes either behaviour, this fails and the worker subclass should be revisited."""
    import torch.distributed as dist

    from verl.utils import distributed as vd

    seen = []
    monkeypatch.setattr(vd, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(vd, "get_nccl_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.append(backend))
    vd.initialize_global_process_group_ray()
    assert seen == ["cpu:gloo,cpu:gloo"]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    vd.initialize_global_process_group_ray()
    assert seen == ["cpu:gloo,cpu:gloo"]  # already initialised: verl leaves our group alone
    # The parse torch's init_process_group does: verl's string fails, the worker's "cpu:gloo" works.
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        BackendConfig(Backend("cpu:gloo,cpu:gloo"))
    assert BackendConfig(Backend("cpu:gloo")).get_device_backend_map() == {"cpu": "gloo"}


def test_engines_are_registered_for_cpu_by_us_not_by_verl(monkeypatch):
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    from verl_ext.cpu.worker import register_cpu_engines

    saved = {mt: {b: dict(devs) for b, devs in backends.items()} for mt, backends in EngineRegistry._engines.items()}
    try:
        for backend in ("fsdp", "fsdp2"):  # verl registers cuda/npu only; if it adds cpu, drop ours
            EngineRegistry._engines["language_model"][backend].pop("cpu", None)
        monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
        with pytest.raises(ValueError, match="No engine registered for device='cpu'"):
            EngineRegistry.get_engine_cls("language_model", "fsdp2")
        register_cpu_engines()
        register_cpu_engines()  # idempotent
        assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
        assert EngineRegistry.get_engine_cls("value_model", "fsdp") is FSDPEngineWithValueHead
    finally:
        EngineRegistry._engines.clear()
        EngineRegistry._engines.update(saved)


def test_cpu_role_worker_mapping_swaps_only_on_the_cpu_platform(monkeypatch):
    import ray
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from verl_ext.cpu.worker import CPUActorRolloutRefWorker, cpu_role_worker_mapping

    def mapping():
        return {"actor_rollout_ref": ray.remote(ActorRolloutRefWorker), "critic": ray.remote(TrainingWorker)}

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    m = cpu_role_worker_mapping(mapping())
    assert m["actor_rollout_ref"].__ray_actor_class__ is ActorRolloutRefWorker
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    m = cpu_role_worker_mapping(mapping())
    assert m["actor_rollout_ref"].__ray_actor_class__ is CPUActorRolloutRefWorker
    assert m["critic"].__ray_actor_class__ is TrainingWorker


def test_compute_threads_split_the_cores_among_a_phases_processes(monkeypatch):
    """cores // processes computing at once (at least 1); SEARCH_R1_COMPUTE_THREADS overrides, and a bad
    value is an error naming the variable."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("SEARCH_R1_COMPUTE_THREADS", raising=False)
    assert [compute_threads(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    monkeypatch.setenv("SEARCH_R1_COMPUTE_THREADS", "auto")
    assert compute_threads(2) == 2
    monkeypatch.setenv("SEARCH_R1_COMPUTE_THREADS", "3")
    assert compute_threads(2) == 3
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv("SEARCH_R1_COMPUTE_THREADS", bad)
        with pytest.raises(ValueError, match="SEARCH_R1_COMPUTE_THREADS"):
            compute_threads(1)
