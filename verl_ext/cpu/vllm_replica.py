"""`rollout.name=vllm` on the CPU platform: verl's own vLLM replica, with a CPU weight-sync fix.

verl builds the replica of `rollout.name` from `RolloutReplicaRegistry`; this module re-registers
the name `vllm` with a loader that returns verl's own `vLLMReplica` unless the process runs on the
CPU platform (`VERL_PLATFORM=cpu`), where it returns `verl_ext.cpu.vllm_server.CPUvLLMReplica`:
verl's replica and `vLLMHttpServer`, unchanged except for the vLLM worker extension
(`verl_ext.cpu.vllm_worker`), which makes weight syncs work on vLLM's CPU backend. Off the CPU
platform nothing changes. Neither this module nor the loader imports vllm before a replica is built.

What else a CPU run needs is configuration (configs/grpo_verl_cpu_vllm.yaml says why for each) and
the CPU platform's `rollout_env_vars()` (vLLM's thread binding, verl_ext/cpu/platform.py).
"""
from __future__ import annotations

from verl.workers.rollout.replica import RolloutReplicaRegistry

from verl_ext.cpu.platform import is_cpu_platform

ROLLOUT_NAME = "vllm"


def _replica_loader(verl_loader):
    def load():
        if not is_cpu_platform():
            return verl_loader()
        from verl_ext.cpu.vllm_server import CPUvLLMReplica

        return CPUvLLMReplica

    load.verl_loader = verl_loader  # the loader verl registered, kept for GPU platforms
    return load


def register() -> None:
    """Wrap verl's `vllm` loader (idempotent: a second call keeps the first wrapper)."""
    # RolloutReplicaRegistry has get/register only; its dict is the one way to read the loader verl
    # registered without building a replica (which would import vllm).
    current = RolloutReplicaRegistry._registry[ROLLOUT_NAME]
    if getattr(current, "verl_loader", None) is None:
        RolloutReplicaRegistry.register(ROLLOUT_NAME, _replica_loader(current))


register()  # on import: verl_ext.cpu imports this module right after verl's rollout package
