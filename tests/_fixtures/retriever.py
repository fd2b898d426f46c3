"""Fixtures for the real retriever service: `python -m retriever_server serve` in a subprocess.

- `retriever_server` (session): BM25 index over `synth_world`'s corpus.jsonl, served on a free
  127.0.0.1 port. Yields a `RetrieverHandle` with `.base_url` ("http://127.0.0.1:PORT"), `.url`
  (base_url + "/retrieve", upstream's search_url convention), `.corpus_path`, `.index_dir`,
  `.log_path` (the server's stdout/stderr, for debugging a failed test).
- `start_retriever` (function): factory `start_retriever(index_dirs, env=None, **flags)` for tests
  that need their own server (other limits, auth, a server to kill): flags are `serve` options with
  underscores (`max_queries=4` -> `--max-queries 4`, `True` -> bare flag). Returns a started handle
  with `.url`, `.base_url`, `.stop()`, `.restart()` (same port); every server is stopped after the test.
  Handles are `retriever_server.launcher.ServerProcess`es, the launcher the trainer and benches use.
- `build_retriever_index(corpus, kind, out, **flags)`: runs `python -m retriever_server build`.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from retriever_server.launcher import ServerProcess

REPO = Path(__file__).resolve().parents[2]


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


class RetrieverHandle(ServerProcess):
    """The shared launcher (retriever_server.launcher) with test conveniences: serve flags as a dict,
    one torch/faiss thread unless told otherwise, the repo on PYTHONPATH, `.index_dir`, `.corpus_path`."""

    def __init__(self, index_dirs, log_path, flags: dict | None = None, env: dict | None = None,
                 corpus_path: Path | None = None):
        super().__init__(index_dirs, log_path, _flags({"torch_threads": 1, "faiss_threads": 1, **(flags or {})}),
                         env=_env(env), cwd=REPO)
        self.corpus_path = corpus_path

    @property
    def index_dir(self) -> Path:
        return Path(self.index_dirs[0])


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


def dead_url() -> str:
    """A loopback retriever URL nobody listens on (a port bound, then released): connection refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"


def corpus_titles(path, n: int) -> list[str]:
    """The first n distinct titles of a wiki-18 style corpus (an entity has several passages)."""
    titles = {}
    with open(path) as f:
        for line in f:
            titles[json.loads(line)["contents"].split("\n", 1)[0].strip('"')] = None
            if len(titles) == n:
                break
    return list(titles)
