"""Fixtures for the real retriever service: `python -m retriever_server serve` in a subprocess.

- `retriever_server` (session): BM25 index over `synth_world`'s corpus.jsonl, served on a free
  127.0.0.1 port. Yields a `RetrieverHandle` with `.base_url` ("http://127.0.0.1:PORT"), `.url`
  (base_url + "/retrieve", upstream's search_url convention), `.corpus_path`, `.index_dir`,
  `.log_path` (the server's stdout/stderr, for debugging a failed test).
- `start_retriever` (function): factory `start_retriever(index_dirs, env=None, **flags)` for tests
  that need their own server (other limits, auth, a server to kill): flags are `serve` options with
  underscores (`max_queries=4` -> `--max-queries 4`, `True` -> bare flag). Returns a started handle
  with `.url`, `.base_url`, `.stop()`, `.restart()` (same port); every server is stopped after the test.
- `build_retriever_index(corpus, kind, out, **flags)`: runs `python -m retriever_server build`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from search_r1.net import free_port

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(extra or {})
    return env


def _flags(flags: dict) -> list[str]:
    out = []
    for key, value in flags.items():
        opt = "--" + key.replace("_", "-")
        if value is True:
            out.append(opt)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [opt, str(v)]
        else:
            out += [opt, str(value)]
    return out


def build_retriever_index(corpus, kind: str, out, **flags) -> Path:
    """`python -m retriever_server build` as a subprocess; raises with its output on failure."""
    cmd = [sys.executable, "-m", "retriever_server", "build", "--corpus", str(corpus), "--kind", kind,
           "--out", str(out), *_flags(flags)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env({"TQDM_DISABLE": "1"}), capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return Path(out)


@dataclass
class RetrieverHandle:
    """A `python -m retriever_server serve` subprocess on 127.0.0.1:port."""
    index_dirs: list
    log_path: Path
    flags: dict = field(default_factory=dict)
    env: dict | None = None
    port: int = field(default_factory=free_port)
    corpus_path: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base_url + "/retrieve"

    @property
    def index_dir(self) -> Path:
        return Path(self.index_dirs[0])

    @property
    def command(self) -> list[str]:
        flags = {"torch_threads": 1, "faiss_threads": 1, **self.flags}
        return [sys.executable, "-m", "retriever_server", "serve",
                *[a for d in self.index_dirs for a in ("--index", str(d))],
                "--port", str(self.port), *_flags(flags)]

    def launch(self) -> "RetrieverHandle":
        """Start the subprocess without waiting (see `wait_healthy`); lets tests start several at once."""
        log = open(self.log_path, "ab")
        log.write(f"\n$ {' '.join(self.command)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.command, cwd=REPO, env=_env(self.env), stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> "RetrieverHandle":
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"retriever exited with {self.proc.returncode}; log {self.log_path}:\n"
                                   + self.log_path.read_text()[-3000:])
            try:
                if requests.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"retriever not healthy after {timeout}s; log {self.log_path}:\n"
                           + self.log_path.read_text()[-3000:])

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "RetrieverHandle":
        return self.launch().wait_healthy(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> "RetrieverHandle":
        """Stop and start again on the same port (uvicorn sets SO_REUSEADDR)."""
        self.stop()
        return self.start()

    def health(self) -> dict:
        import requests
        return requests.get(self.base_url + "/health", timeout=5).json()


@pytest.fixture(scope="session")
def retriever_server(synth_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("retriever_server")
    corpus = Path(synth_world) / "corpus.jsonl"
    index_dir = build_retriever_index(corpus, "bm25", root / "index_bm25")
    handle = RetrieverHandle([index_dir], log_path=root / "server.log", corpus_path=corpus)
    handle.start()
    yield handle
    handle.stop()


@pytest.fixture
def start_retriever(tmp_path):
    handles: list[RetrieverHandle] = []

    def start(index_dirs, env: dict | None = None, **flags) -> RetrieverHandle:
        dirs = [index_dirs] if isinstance(index_dirs, (str, Path)) else list(index_dirs)
        handle = RetrieverHandle(dirs, log_path=tmp_path / f"retriever_{len(handles)}.log",
                                 flags=flags, env=env)
        handles.append(handle)
        return handle.start()

    yield start
    for handle in handles:
        handle.stop()
