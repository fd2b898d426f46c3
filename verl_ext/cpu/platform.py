"""A CPU platform for verl 0.9's platform registry, so verl's own trainer runs without an accelerator.

Selected by `VERL_PLATFORM=cpu` (verl reads it in `verl.plugin.platform.platform_manager.
_detect_platform_name`), or detected in a process whose torch build drives no accelerator (a
CPU-only torch); `register()` in `verl_ext.cpu` adds the class to `PlatformRegistry` in every process
that imports verl (the `verl.plugins` entry point), before anything calls `get_platform()`. It is
registered after verl's accelerators, so detection probes it last: a CUDA or ROCm torch (GPU nodes,
and CPU-only Ray actors on them) keeps verl's own detection. Without it, every CPU-only process
that builds a verl `Worker` (the embedded CPU trainer's workers, every run) logged "No supported
accelerator detected ... Falling back to 'nvidia'" and "Platform 'nvidia' ... is registered but
not available", and answered CUDA names on a host without CUDA.

What verl asks of a platform and why the answers are these:
- `device_name` "cpu", `current_device()` "cpu": verl moves tensors with `.to(get_device_id())`;
  on CPU-only torch `.to(0)` means cuda:0 and raises, `.to("cpu")` is right.
- `device_module`: `torch.cpu` lacks `empty_cache`, memory statistics, `mem_get_info` and the
  RNG-state calls verl makes through `get_torch_device()`; `CPU_DEVICE_MODULE` adds them with
  CPU meanings (no cache to empty, process RSS as "allocated", the CPU RNG state).
- `communication_backend_name` "gloo": torch's only CPU collective backend.
- `rollout_env_vars()`: vLLM's CPU thread binding for verl's vLLM server actors (the method says why).
- `check_cpu_rollout_config(config)`: rollout settings vLLM's CPU backend rejects fail early, naming the fix.
- `compute_threads(n)`: torch threads for each of the n training workers (or `hf` rollout servers)
  of a node, which compute while the others wait (the function says why).
- `ray_resource_name` "GPU": verl's resource pools always ask Ray for accelerators
  (`ResourcePoolManager.create_resource_pool` passes `use_gpu=True`, `_check_resource_available`
  counts "GPU"/"NPU"). Starting Ray with `num_gpus=N` creates N *logical* GPU slots that only
  schedule the N training processes; nothing touches a real GPU (CPU-only torch cannot).
"""
from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

from verl.plugin.platform import PlatformBase

from search_r1.vllm_cpu import vllm_thread_binding

PLATFORM_NAME = "cpu"
COMPUTE_THREADS_ENV = "SEARCH_R1_COMPUTE_THREADS"


def parse_compute_threads(value: str) -> Optional[int]:
    """`SEARCH_R1_COMPUTE_THREADS`'s value -> a thread count, or None for "auto"; ValueError otherwise."""
    value = str(value).strip()
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{COMPUTE_THREADS_ENV}={value!r}: allowed a whole number >= 1 or 'auto' "
                         f"(cores // processes computing at once)")
    return int(value)


def compute_threads(processes: int) -> int:
    """Torch threads for one of `processes` processes of this node that compute at the same time.

    verl's sync trainer runs its phases one after another: the rollout servers generate while the
    training workers wait, then the training workers compute log-probs and the update while the
    servers wait. Each phase can therefore split every core this process may use among its own
    processes: cores // processes, at least 1 (a node with 2 cores and one training worker: 2
    threads; two workers: 1 each). The light processes (driver, agent loops, reward) keep the
    OMP_NUM_THREADS of configs/verl_cpu/base.yaml. `SEARCH_R1_COMPUTE_THREADS` (in the Ray
    runtime_env there) overrides with a number; "auto" or unset computes it.
    """
    threads = parse_compute_threads(os.environ.get(COMPUTE_THREADS_ENV, "auto"))
    if threads is not None:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, processes))


def _rss_bytes() -> int:
    """Resident set size of this process (what "allocated device memory" means on a CPU)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # psutil missing or /proc unreadable: report nothing rather than fail a log line
        return 0


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of host memory, the shape of `torch.cuda.mem_get_info`."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _build_device_module() -> types.ModuleType:
    """`torch.cpu` plus the calls verl makes on `get_torch_device()` that torch.cpu does not have."""
    mod = types.ModuleType("verl_ext.cpu.device_module", "torch.cpu with the CUDA-module calls verl uses")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    noop = lambda *args, **kwargs: None  # noqa: E731  (no allocator cache or IPC handles on CPU)
    mod.empty_cache = noop
    mod.ipc_collect = noop
    mod.reset_peak_memory_stats = noop
    mod.set_per_process_memory_fraction = noop
    mod.memory_allocated = lambda device=None: _rss_bytes()
    mod.memory_reserved = lambda device=None: _rss_bytes()
    mod.max_memory_allocated = lambda device=None: _rss_bytes()
    mod.max_memory_reserved = lambda device=None: _rss_bytes()
    mod.mem_get_info = _mem_get_info
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_device_name = lambda device=None: "cpu"
    # torch.cpu.current_device() already returns "cpu"; set_device/synchronize/Stream exist there.
    return mod


CPU_DEVICE_MODULE = _build_device_module()


class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts (tests and small runs of verl's own trainer)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Probed after verl's accelerators; true only for a torch that can drive none of them, so a
        # GPU build (even in a CPU-only actor, where torch.cuda.is_available() is False) never lands here.
        return torch.version.cuda is None and torch.version.hip is None and not torch.cuda.is_available()

    def current_device(self) -> str:  # verl's annotation says int; "cpu" is what `.to()` needs here
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None  # no CUDA caching allocator to configure

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for actors holding logical GPUs; CPU-only torch ignores it.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # logical Ray slots, see the module docstring

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def rollout_env_vars(self) -> dict[str, str]:
        """Environment of verl's rollout server actors (`vLLMReplica.launch_servers` puts it in their
        runtime_env, so the vLLM engine and worker processes inherit it): vLLM's thread binding over
        every core this process may run on, none reserved (`search_r1.vllm_cpu` says why)."""
        return vllm_thread_binding()

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def is_cpu_platform() -> bool:
    """True when this process selected the CPU platform (`VERL_PLATFORM=cpu`): the runs of verl's
    trainer on a CPU (the `*_cpu` configs), whose workers verl_ext/cpu swaps."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def check_cpu_rollout_config(config) -> None:
    """Raise ValueError for rollout settings vLLM's CPU backend rejects (vLLM itself fails later, inside
    its engine process: "Sleep mode is not supported on current platform")."""
    prefix = "actor_rollout_ref.rollout"
    if config.enable_sleep_mode:
        raise ValueError(f"{prefix}.enable_sleep_mode=true: vLLM has no sleep mode on CPU (its CPU worker "
                         f"cannot release memory; verl's default is true). Fix: +{prefix}.enable_sleep_mode=false "
                         f"(configs/grpo_verl_cpu_vllm.yaml sets it)")
