"""The CPU variant of verl's hybrid actor/rollout/ref worker, and the hook a trainer uses to pick it.

Two things stand between verl's `ActorRolloutRefWorker` and a CPU, both fixed here without
touching verl:

1. Process group. verl's `TrainingWorker.__init__` calls `initialize_global_process_group_ray()`,
   which builds the backend string `f"cpu:gloo,{device}:{backend}"`; with device "cpu" that is
   "cpu:gloo,cpu:gloo" and torch refuses it ("Duplicate device type cpu"). verl skips the call
   when a group already exists, so this worker creates the group itself, with plain "cpu:gloo",
   before the inner training workers are built.
2. Engine lookup. verl registers its FSDP engines for devices "cuda" and "npu" only; the engine is
   device-agnostic (every device call goes through `get_platform()`), so this worker registers the
   same classes for "cpu" through `EngineRegistry.register` before `init_model` looks them up.

The worker also sets its torch threads to `compute_threads(local world size)` (the training
workers of a node compute at once; verl_ext.cpu.platform.compute_threads).

A trainer uses it through `cpu_role_worker_mapping` (no-op unless `VERL_PLATFORM=cpu`).
"""
from __future__ import annotations

import os
from datetime import timedelta

from verl.workers.engine_workers import ActorRolloutRefWorker

from verl_ext.cpu.platform import compute_threads, is_cpu_platform

# verl's FSDP engine classes, by the model_type verl registers them under.
_FSDP_ENGINES = {
    "language_model": "FSDPEngineWithLMHead",
    "value_model": "FSDPEngineWithValueHead",
}


def register_cpu_engines() -> None:
    """Register verl's FSDP/FSDP2 engines for device "cpu" (idempotent)."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    for model_type, class_name in _FSDP_ENGINES.items():
        # EngineRegistry.register asserts on duplicates and has no lookup by key; read its table.
        registry = EngineRegistry._engines.get(model_type, {})
        missing = [b for b in ("fsdp", "fsdp2") if "cpu" not in registry.get(b, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device="cpu")(
                getattr(transformer_impl, class_name))


def init_gloo_process_group() -> None:
    """Join the worker group's torch.distributed group with the CPU-only backend "cpu:gloo".

    Uses the RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT that verl's `Worker.__init__` exported.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(
        backend="cpu:gloo",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        # gloo's default 30 min is what verl uses for None; a stuck peer should fail, not hang forever.
        timeout=timedelta(minutes=30),
    )


class CPUActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's `ActorRolloutRefWorker` with a gloo process group and CPU engine registration."""

    def __init__(self, config, role: str, distillation_config=None, **kwargs):
        import torch

        super().__init__(config, role, distillation_config=distillation_config, **kwargs)
        # RAY_LOCAL_WORLD_SIZE: this node's training workers (verl's RayWorkerGroup sets it)
        torch.set_num_threads(compute_threads(int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))))
        print(f"[verl_ext.cpu] {role} worker rank {os.environ.get('RANK', '0')}: {torch.get_num_threads()} torch "
              f"threads (SEARCH_R1_COMPUTE_THREADS={os.environ.get('SEARCH_R1_COMPUTE_THREADS', 'auto')})", flush=True)
        init_gloo_process_group()
        register_cpu_engines()


def cpu_role_worker_mapping(role_worker_mapping: dict) -> dict:
    """Swap verl's `ActorRolloutRefWorker` for `CPUActorRolloutRefWorker` when on the CPU platform.

    `role_worker_mapping` is the trainer's {Role: ray.remote(worker class)} (built in verl's
    `PPOTrainer._init_resource_pool_mgr`). Returns it changed in place; unchanged off CPU.
    """
    if not is_cpu_platform():
        return role_worker_mapping
    import ray

    for role, remote_cls in list(role_worker_mapping.items()):
        cls = getattr(remote_cls, "__ray_actor_class__", remote_cls)
        if cls is ActorRolloutRefWorker:
            role_worker_mapping[role] = ray.remote(CPUActorRolloutRefWorker)
    return role_worker_mapping
