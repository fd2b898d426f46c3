"""`vllm serve` as a child process on 127.0.0.1: start it, wait until it answers, load new weights, stop it.

Used by the embedded trainer's vLLM rollout (`rollout.backend=vllm`, search_r1/trainer/vllm_rollout.py)
and by the vLLM-on-CPU tests. vLLM lives in its own environment on CPU (`.venv-vllm`, docs/vllm_cpu.md),
so the server runs with that environment's interpreter, not necessarily this one.

    server = VLLMServer("/models/policy", log_path="vllm.log", python=find_vllm_python("auto"), weight_sync=True)
    server.start()                          # raises ServerStartError with the log's tail on failure
    server.base_url                         # http://127.0.0.1:PORT  (OpenAI API: /v1/completions)
    server.load_weights("/dev/shm/w.safetensors")   # new weights into the running engine (see below)
    server.stop()

The server gets its own process group (the API server spawns an engine and a worker process; stopping
the group stops all three). Its threads are bound to every core this process may run on, none reserved
(search_r1.vllm_cpu, as for verl's vLLM servers on the CPU platform): the trainer's workers wait while
it generates.

`weight_sync=True` loads vLLM's worker extension `verl_ext.cpu.vllm_worker.CPUWeightSyncExtension`
and turns on vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`: `/collective_rpc`,
`/reset_prefix_cache`), through which `load_weights` asks the worker to read a safetensors file. Those
endpoints let any local process reload the served weights, so they are only for a loopback server
this process owns; the server never binds another address.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from retriever_server.launcher import ServerStartError, free_port
from search_r1.vllm_cpu import vllm_thread_binding

WEIGHT_SYNC_EXTENSION = "verl_ext.cpu.vllm_worker.CPUWeightSyncExtension"
STARTUP_TIMEOUT_S = 600.0  # import vllm ~20 s, engine ~10-30 s on an idle 2-core host; far more when busy
REPO = Path(__file__).resolve().parents[2]


def has_vllm(python: str) -> bool:
    """True when `python` can import vllm (without importing it here: it is slow and may be absent)."""
    # Compared unresolved: every venv's python is a symlink to the same base interpreter.
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    try:
        return subprocess.run([python, "-c", "import importlib.util, sys; "
                               "sys.exit(importlib.util.find_spec('vllm') is None)"],
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_vllm_python(setting: str = "auto") -> str:
    """The interpreter that runs vLLM. auto: this one if it has vLLM, else $SEARCH_R1_VLLM_PYTHON, else
    the project's .venv-vllm. Raises ValueError naming the fix when none has vLLM."""
    if setting != "auto":
        candidates = [setting]
    else:
        candidates = [sys.executable, os.environ.get("SEARCH_R1_VLLM_PYTHON", ""), str(REPO / ".venv-vllm/bin/python")]
    for python in filter(None, candidates):
        if Path(python).is_file() and has_vllm(python):
            return python
    raise ValueError(f"no python with vLLM found (tried {', '.join(filter(None, candidates))}). Fix: `make "
                     f"install-vllm` (builds .venv-vllm; docs/vllm_cpu.md), or set rollout.vllm_python to an "
                     f"interpreter that has vLLM, or rollout.backend=hf")


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a vLLM process: offline, one OpenMP binding over every allowed core."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **vllm_thread_binding(),
            **(extra or {})}


class VLLMServer:
    """`vllm serve MODEL` on 127.0.0.1 (`port=None`: a free one). Context manager or start()/stop()."""

    def __init__(self, model: str, log_path: str | Path, python: str | None = None, served_name: str = "policy",
                 port: int | None = None, dtype: str = "float32", max_model_len: int = 2048,
                 kv_cache_bytes: int = 256 * 2**20, seed: int | None = None, weight_sync: bool = False,
                 extra: list[str] | None = None):
        self.model, self.log_path, self.served_name = str(model), Path(log_path), served_name
        self.python = python or sys.executable
        self.port = port or free_port()
        self.dtype, self.max_model_len, self.kv_cache_bytes = dtype, max_model_len, kv_cache_bytes
        self.seed, self.weight_sync = seed, weight_sync
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        # The interpreter's `vllm` console script, with the CPU flags docs/vllm_cpu.md explains: eager
        # (no compile on CPU), an explicit KV-cache size (the default fraction of RAM fails).
        cmd = [str(Path(self.python).parent / "vllm"), "serve", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", self.served_name, "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--enforce-eager",
               "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        if self.weight_sync:
            cmd += ["--worker-extension-cls", WEIGHT_SYNC_EXTENSION]
        return cmd + self.extra

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "VLLMServer":
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = vllm_env({"VLLM_SERVER_DEV_MODE": "1"} if self.weight_sync else None)
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"vllm serve exited with code {self.proc.returncode} during start-up; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"vllm serve did not answer within {timeout:g} s (a busy machine may need "
                                       f"longer); log {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def load_weights(self, path: str | Path, timeout: float = 300.0) -> float:
        """Load a safetensors file of the served model's parameters (HF names) into the running engine,
        then empty the prefix cache (its entries were computed with the old weights). Returns seconds."""
        import httpx

        if not self.weight_sync:
            raise RuntimeError("VLLMServer.load_weights needs weight_sync=True (the worker extension and "
                               "vLLM's /collective_rpc endpoint)")
        start = time.perf_counter()
        for endpoint, body in (("/collective_rpc", {"method": "load_weights_from_safetensors",
                                                    "args": [str(path)], "timeout": timeout}),
                               ("/reset_prefix_cache", None)):
            resp = httpx.post(self.base_url + endpoint, json=body, timeout=timeout)
            if resp.status_code != 200:
                raise RuntimeError(f"vllm serve {endpoint} returned {resp.status_code}: {resp.text[:500]}; "
                                   f"log {self.log_path}")
        return time.perf_counter() - start

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

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
