"""verl's own trainer on a CPU: the platform, the `hf` rollout and the worker, registered with verl.

Imported by `verl_ext` (the `verl.plugins` entry point), so it runs in every process that imports
verl, GPU nodes included. It only adds names to verl's registries; nothing is selected unless the
run asks for it with `VERL_PLATFORM=cpu` and `actor_rollout_ref.rollout.name=hf`
(configs/grpo_verl_cpu.yaml does both):

    platform "cpu"          verl_ext.cpu.platform  -> verl.plugin.platform.PlatformRegistry (at once:
                            verl modules resolve the platform at import time, e.g. transformer_impl)
    rollout replica "hf"    verl_ext.cpu.replica   -> verl.workers.rollout.replica.RolloutReplicaRegistry
    rollout adapter "hf"    verl_ext.cpu.replica   -> verl.workers.rollout.base._ROLLOUT_REGISTRY
                            (both when the `verl.workers.rollout` package is imported)
    CPU hybrid worker       verl_ext.cpu.worker    (picked by the trainer: cpu_role_worker_mapping)

It imports no vllm and no model code.

    bash scripts/train_grpo.sh --config-name grpo_verl_cpu
"""
from __future__ import annotations


def register() -> None:
    """Register the CPU platform now and the `hf` rollout once verl's rollout package loads (idempotent)."""
    from verl.plugin.platform import PlatformRegistry

    from verl_ext import register_after_import
    from verl_ext.cpu.platform import PLATFORM_NAME, PlatformCPU

    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    register_after_import("verl.workers.rollout", "verl_ext.cpu.replica")


register()
