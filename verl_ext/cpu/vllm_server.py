"""verl's vLLM rollout server and replica for the CPU platform (imports vllm; vLLM-on-CPU env only).

`CPUvLLMHttpServer` is verl's `vLLMHttpServer` with two differences:
- the vLLM worker extension is `verl_ext.cpu.vllm_worker.CPUWeightSyncExtension` (verl's own
  extension plus the repair weight syncs need on vLLM's CPU backend; that module says why), chosen
  through the hook verl provides for it, `_get_worker_extension_cls`;
- settings vLLM's CPU backend cannot honour fail when the server starts, naming the key and the fix,
  instead of as a traceback from inside the engine process.

`CPUvLLMReplica` is verl's `vLLMReplica` serving that class. `verl_ext.cpu.vllm_replica` hands it to
verl as `rollout.name=vllm` when `VERL_PLATFORM=cpu`.
"""
from __future__ import annotations

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from verl_ext.cpu.platform import check_cpu_rollout_config

WORKER_EXTENSION = "verl_ext.cpu.vllm_worker.CPUWeightSyncExtension"


class CPUvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server with the CPU weight-sync extension and CPU config checks."""

    def _validate_configs(self) -> None:
        super()._validate_configs()
        check_cpu_rollout_config(self.config)

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION


class CPUvLLMReplica(vLLMReplica):
    """verl's vLLM replica launching `CPUvLLMHttpServer` actors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(CPUvLLMHttpServer)
