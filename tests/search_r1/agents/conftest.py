"""Fixtures of the agent tests: a single-hop test question of the synthetic world, a client of the real
retriever server, and a factory of vLLM-shaped fake chat servers (stopped after each test)."""
from __future__ import annotations

import json

import pytest

from search_r1.search import RetrieverClient
from tests.search_r1.agents.fake_chat_server import FakeChatServer


@pytest.fixture(scope="module")
def question(synth_world):
    """The first single-hop (synth_nq) test question: {"question", "golden_answers", "gold_doc_ids", ...}."""
    with open(synth_world / "test.jsonl") as f:
        return next(r for r in map(json.loads, f) if r["data_source"] == "synth_nq")


@pytest.fixture
def client(retriever_server):
    with RetrieverClient(retriever_server.url, topk=3) as c:
        yield c


@pytest.fixture
def chat_server():
    """Factory: `chat_server(respond, api_key=None)` -> a running FakeChatServer."""
    servers = []

    def start(respond, **kw):
        servers.append(FakeChatServer(respond, **kw))
        return servers[-1]
    yield start
    for s in servers:
        s.close()
