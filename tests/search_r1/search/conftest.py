"""`tiny_retriever`: a minimal loopback HTTP server speaking the /retrieve API, for client unit tests.

The real server (fixture `retriever_server`) covers the happy path and kill/restart; this one makes
failures reproducible that a healthy real server never produces on demand: a 5xx, a hang past the
client's timeout, a malformed body, a bare-document response shape.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class TinyRetriever:
    """Server state the tests steer (`mode`) and inspect (`requests`)."""

    mode: str = "ok"  # ok | bare | 500 | 400 | 401 | slow | garbage | short
    api_key: str | None = None
    delay: float = 0.0
    requests: list[dict] = field(default_factory=list)  # bodies of every POST /retrieve
    auth_headers: list = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        return self.base_url + "/retrieve"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fake_docs(query: str, topk: int) -> list[dict]:
    """Deterministic hits derived from the query text, so tests can check which query got which."""
    return [{"id": f"{query}#{i}", "contents": f"\"T{i} {query}\"\ntext {i} for {query}"} for i in range(topk)]


def _handler(state: TinyRetriever):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn

        def log_message(self, *args):  # keep pytest output clean
            pass

        def _send(self, code: int, body) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append(body)
            state.auth_headers.append(self.headers.get("Authorization"))
            if state.api_key and self.headers.get("Authorization") != f"Bearer {state.api_key}":
                return self._send(401, {"detail": "missing or wrong bearer token"})
            if state.mode == "slow" or state.delay:
                time.sleep(state.delay or 2.0)
            if state.mode == "500":
                return self._send(500, {"detail": "index exploded"})
            if state.mode == "400":
                return self._send(400, {"detail": "queries: at most 2 queries per request"})
            if state.mode == "garbage":
                return self._send(200, b"<html>proxy error</html>")
            queries, topk = body["queries"], body["topk"]
            if state.mode == "short":
                return self._send(200, {"result": []})
            if state.mode == "bare":
                return self._send(200, {"result": [fake_docs(q, topk) for q in queries]})
            return self._send(200, {"result": [[{"document": d, "score": float(topk - i)}
                                                for i, d in enumerate(fake_docs(q, topk))] for q in queries]})

    return Handler


@pytest.fixture
def tiny_retriever():
    """Factory: `tiny_retriever(mode="ok", api_key=None)` -> a running TinyRetriever on 127.0.0.1."""
    started: list[TinyRetriever] = []

    def start(**kwargs) -> TinyRetriever:
        state = TinyRetriever(**kwargs)
        state.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
        state.server.daemon_threads = True
        threading.Thread(target=state.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(state)
        return state

    yield start
    for s in started:
        s.close()


@pytest.fixture
def dead_url():
    """A loopback URL nobody listens on (bind a port, then release it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
