"""Run `python -m retriever_server serve` as a child process and wait until it answers.

The one place that starts a server subprocess: the trainer's `retriever.url=auto`, the test fixtures
and the benchmarks all use it.

    server = ServerProcess(["idx_bm25"], log_path=Path("retriever.log"), flags=["--max-batch", "128"])
    server.start()             # launch + wait for GET /health; raises with the log's tail on failure
    server.url                 # http://127.0.0.1:PORT/retrieve
    server.stop()

Standard library only (the service's own dependencies are not needed to launch it).
"""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_STARTUP_TIMEOUT_S = 120.0


class ServerStartError(RuntimeError):
    """The server exited during start-up or did not answer /health in time (message has the log tail)."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `retriever_server serve` child on 127.0.0.1; `port=None` picks a free one (kept on restart)."""

    def __init__(self, index_dirs: list, log_path: str | Path, flags: list[str] | None = None,
                 port: int | None = None, env: dict | None = None, cwd: str | Path | None = None):
        self.index_dirs = [str(d) for d in index_dirs]
        self.log_path = Path(log_path)
        self.flags = list(flags or [])
        self.port = port or free_port()
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base_url + "/retrieve"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "retriever_server", "serve",
                *[a for d in self.index_dirs for a in ("--index", d)],
                "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    def launch(self) -> "ServerProcess":
        """Start the child without waiting (see `wait_healthy`), so that callers can start several."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command, cwd=self.cwd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        return self

    def wait_healthy(self, timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise ServerStartError(f"the retriever server exited with code {code} during start-up; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            try:
                self.health(timeout=2.0)
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(
                        f"the retriever server did not answer {self.base_url}/health within {timeout:g} s "
                        f"(a busy machine may need a longer start-up timeout); log {self.log_path}:\n"
                        f"{self.log_tail()}") from None
                time.sleep(0.1)

    def start(self, timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> "ServerProcess":
        return self.launch().wait_healthy(timeout)

    def health(self, timeout: float = 5.0) -> dict:
        """GET /health as a dict; OSError (connection refused, timeout, non-200) when not answering."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            body = resp.read()
        except (http.client.HTTPException, OSError) as exc:
            raise OSError(f"GET {self.base_url}/health: {exc}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise OSError(f"GET {self.base_url}/health returned {resp.status}")
        return json.loads(body)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> "ServerProcess":
        """Stop and start again on the same port (uvicorn sets SO_REUSEADDR)."""
        self.stop()
        return self.start(timeout)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
