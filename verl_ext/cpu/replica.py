"""The `hf` rollout for verl: a `RolloutReplica` that launches `HFRolloutServer` actors, and the
worker-side `BaseRollout` adapter verl's hybrid worker uses to sync weights into them.

verl's pieces and how these fit them:
- `LLMServerManager` builds `rollout.name`'s replica from `RolloutReplicaRegistry` and calls
  `init_hybrid(worker_group)`, which calls our `launch_servers()`: one server actor per replica,
  named `hf_server_{replica_rank}_0` so the workers' adapter can find it, pinned to the node of the
  replica's first worker.
- The hybrid worker builds `_ROLLOUT_REGISTRY[("hf", "async")]` (`HFServerAdapter`) in
  `init_model`, and in the naive weight sync (`ActorRolloutRefWorker.update_weights`) calls
  `resume(["weights"])`, `update_weights(generator)`, `resume(["kv_cache"])`. Every rank drains
  the generator (FSDP's `full_tensor()` is a collective), the replica's rank 0 sends the tensors
  to its server in one Ray call.

Only the hybrid mode (rollout colocated with the trainer, verl's sync trainer) is implemented;
standalone and colocated modes raise with the reason.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Generator, Optional

import ray

from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"
SERVER_NAME_PREFIX = "hf_"


def server_actor_name(replica_rank: int, node_rank: int = 0, suffix: str = "") -> str:
    return f"{SERVER_NAME_PREFIX}server_{replica_rank}_{node_rank}{suffix}"


class HFReplica(RolloutReplica):
    """verl rollout replica served by one `HFRolloutServer` actor (CPU): one per training worker with
    rollout TP 1, one for all N workers with TP N (the GPU rehearsal's fewer, fuller batches)."""

    async def launch_servers(self):
        from verl_ext.cpu.server import HFRolloutServer

        if self.rollout_mode != RolloutMode.HYBRID:
            raise ValueError(f"rollout.name=hf supports the hybrid (colocated sync) mode only, got "
                             f"{self.rollout_mode}; use a colocated sync trainer mode (trainer.v1.trainer_mode=sync or search_r1)")
        # A replica of world size > 1 (rollout.tensor_model_parallel_size > 1) is still one server process:
        # HF does not shard the model; the replica's other ranks only drain the weight sync (the adapter).
        node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        name = server_actor_name(self.replica_rank, 0, self.name_suffix)
        server = ray.remote(HFRolloutServer).options(
            name=name,
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False),
            max_concurrency=self.max_concurrency,
            num_cpus=0,  # it shares the cores of the worker it serves; Ray CPUs are logical here
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank,
                  servers_per_node=max(1, self.gpus_per_node // self.world_size))
        await server.get_stats.remote()  # surface a failed model load here, not at the first request
        self.servers = [server]
        self._server_handle = server
        # No HTTP endpoint: verl's agent loops talk to the handle (token in, token out).
        self._server_address = f"ray://{name}"


class HFServerAdapter(BaseRollout):
    """Worker-side handle on this rank's `HFRolloutServer` (verl's `BaseRollout` contract)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ["RANK"])
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._server = None
        self.sleep_level = 1  # read by verl's update_weights for LoRA; nothing to release on CPU

    def _server_handle(self):
        if self.rollout_rank != 0:
            return None
        if self._server is None:
            # The server is launched after the hybrid worker (LLMServerManager.create), so look it up lazily.
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        server = self._server_handle()
        if server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self):
        server = self._server_handle()
        if server is not None:
            await server.sleep.remote()

    async def update_weights(self, weights: Generator[tuple[str, Any], None, None], global_steps: Optional[int] = None,
                             wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"rollout.name=hf takes full weights (wire_format='named_tensors'), got "
                             f"{wire_format!r}; set rollout.checkpoint_engine.backend=naive")
        if kwargs.get("peft_config") is not None:
            raise ValueError("rollout.name=hf loads merged weights only, not LoRA adapters; set "
                             "actor_rollout_ref.model.lora.merge=true")
        server = self._server_handle()
        named = {}
        for name, tensor in weights:  # every rank drains: full_tensor() inside is a collective
            if server is not None:
                named[name] = tensor.detach().to("cpu")
        if server is None:
            return
        await server.load_weights.remote(named, global_steps)
        await server.clear_kv_cache.remote()


def register() -> None:
    """Name this rollout `hf` in verl's replica registry (trainer side) and adapter registry (workers)."""
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFReplica)
    # verl's adapter registry maps (name, mode) to a dotted class path it imports on use.
    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"


register()  # on import: verl_ext.cpu imports this module right after verl's rollout package
