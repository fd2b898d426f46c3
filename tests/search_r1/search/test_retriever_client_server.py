"""RetrieverClient against the real retriever server (subprocess, real BM25 index, real HTTP)."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest

from search_r1.search import RetrieverClient, SearchError, render_passages

DOC_LINE = re.compile(r"^Doc [123]\(Title: .+\) .+$")


def _corpus(path) -> dict[str, str]:
    with open(path) as f:
        return {row["id"]: row["contents"] for row in map(json.loads, f)}


def _single_hop(world, n=24) -> list[dict]:
    with open(world / "test.jsonl") as f:
        rows = [r for r in map(json.loads, f) if r["data_source"] == "synth_nq"]
    return rows[:n]


def test_rendering_matches_corpus_and_upstream_format(retriever_server, synth_world):
    corpus = _corpus(retriever_server.corpus_path)
    qs = _single_hop(synth_world)
    with RetrieverClient(retriever_server.url, topk=3) as client:
        docs = client.batch_retrieve([q["question"] for q in qs])
        texts = client.batch_search([q["question"] for q in qs])
    for q, hits, text in zip(qs, docs, texts):
        assert len(hits) == 3 and all(h["score"] is not None for h in hits)
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        assert all(corpus[h["id"]] == h["contents"] for h in hits)
        assert text == render_passages([corpus[h["id"]] for h in hits])
        # independent of render_passages: the upstream line format built from the raw corpus line
        expected = ""
        for i, h in enumerate(hits, start=1):
            title_line, body = corpus[h["id"]].split("\n", 1)
            expected += f"Doc {i}(Title: {title_line.strip(chr(34))}) {body.strip()}\n"
        assert text == expected
        assert all(DOC_LINE.match(line) for line in text.splitlines())
    # the passage a single-hop question was made from comes back in the top 3 for most questions
    recalled = sum(bool({h["id"] for h in hits} & set(q["gold_doc_ids"])) for q, hits in zip(qs, docs))
    assert recalled >= 0.7 * len(qs)


def test_base_url_and_retrieve_url_are_equivalent(retriever_server):
    a = RetrieverClient(retriever_server.base_url, cache_size=0).batch_search(["river", "company"])
    b = RetrieverClient(retriever_server.url, cache_size=0).batch_search(["river", "company"])
    assert a == b and all(t.startswith("Doc 1(Title: ") for t in a)


def test_one_post_per_batch_and_cache_avoids_requests(retriever_server, synth_world):
    qs = [q["question"] for q in _single_hop(synth_world, 20)]
    client = RetrieverClient(retriever_server.url, topk=3)
    before = retriever_server.health()["counters"]
    first = client.batch_search(qs)
    mid = retriever_server.health()["counters"]
    # the server counts every HTTP request, the /health probe included: one POST + one GET
    assert client.stats.requests == 1
    assert mid["requests"] - before["requests"] == 2
    assert mid["queries"] - before["queries"] == len(set(qs))
    assert client.batch_search(qs[::-1]) == first[::-1]
    assert client.stats.requests == 1 and client.stats.cache_hits == len(set(qs))
    after = retriever_server.health()["counters"]
    assert after["requests"] - mid["requests"] == 1 and after["queries"] == mid["queries"]


def test_killed_server_fails_clearly_then_retry_survives_restart(start_retriever, retriever_server):
    srv = start_retriever([retriever_server.index_dir])
    assert RetrieverClient(srv.url).search("river").startswith("Doc 1(Title: ")
    srv.stop()

    # dead: SearchError after the configured rounds, naming the URL, within the backoff budget
    client = RetrieverClient(srv.url, retries=2, backoff=0.1, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(SearchError) as err:
        client.batch_search(["river"])
    elapsed = time.monotonic() - t0
    assert "3 round(s) over 1 url(s)" in str(err.value) and srv.url in str(err.value)
    assert "ConnectError" in str(err.value) and client.stats.requests == 3
    assert 0.3 <= elapsed < 3.0  # backoff 0.1 + 0.2 (x jitter <= 1.5) plus refused connections

    # restarted while the client is backing off: the later rounds reach it
    client = RetrieverClient(srv.url, cache_size=0, retries=6, backoff=0.25, timeout=5)
    restarter = threading.Timer(0.3, srv.restart)
    restarter.start()
    try:
        # rounds at 0, 0.25, 0.75, 1.75, 3.75, 7.75, 15.75 s (before jitter) outlast a slow restart
        assert client.search("company").startswith("Doc 1(Title: ")
    finally:
        restarter.join()
    assert client.stats.failures >= 1 and client.stats.retry_rounds >= 1


def test_two_urls_one_dead_all_answers_from_live(retriever_server, synth_world, dead_url):
    qs = [q["question"] for q in _single_hop(synth_world, 12)]
    reference = RetrieverClient(retriever_server.url, cache_size=0).batch_search(qs)
    client = RetrieverClient([dead_url, retriever_server.url], cache_size=0, backoff=0.05, retries=1)
    assert [client.search(q) for q in qs] == reference
    assert client.stats.retry_rounds == 0 and client.stats.failures == 1  # then it cools down


def test_all_dead_raises_clear_error_naming_every_url(dead_url):
    import socket

    with socket.socket() as s:  # a second port nobody listens on
        s.bind(("127.0.0.1", 0))
        other = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = RetrieverClient([dead_url, other], retries=1, backoff=0.05, timeout=2)
    with pytest.raises(SearchError) as err:
        client.batch_search(["river"])
    msg = str(err.value)
    assert "2 round(s) over 2 url(s)" in msg and dead_url in msg and other in msg
    assert client.stats.requests == 4  # 2 rounds x 2 urls


def test_auth_on_and_off(start_retriever, retriever_server, monkeypatch):
    monkeypatch.delenv("RETRIEVER_API_KEY", raising=False)
    srv = start_retriever([retriever_server.index_dir], api_key="tok-123")
    with pytest.raises(SearchError, match=r"HTTP 401.*RETRIEVER_API_KEY"):
        RetrieverClient(srv.url, retries=3).search("river")
    with pytest.raises(SearchError, match=r"HTTP 40[13]"):
        RetrieverClient(srv.url, api_key="wrong").search("river")
    assert RetrieverClient(srv.url, api_key="tok-123").search("river").startswith("Doc 1(Title: ")
    monkeypatch.setenv("RETRIEVER_API_KEY", "tok-123")
    assert RetrieverClient(srv.url).search("river").startswith("Doc 1(Title: ")
    # the open server ignores a token it did not ask for
    assert RetrieverClient(retriever_server.url, api_key="tok-123").search("river").startswith("Doc 1")


def test_4xx_is_not_retried_and_carries_server_message(retriever_server, dead_url):
    # topk above the server's --max-topk (100) is the caller's mistake: a 422, not worth retrying
    client = RetrieverClient([retriever_server.url, dead_url], topk=1000, retries=3, backoff=1.0)
    t0 = time.monotonic()
    with pytest.raises(SearchError, match=r"HTTP 422: topk: 1000 is out of bounds") as err:
        client.batch_search(["river"])
    assert time.monotonic() - t0 < 1.0  # no backoff sleep happened
    assert client.stats.requests == 1 and retriever_server.url in str(err.value)


def test_batch_access_reads_whole_documents_by_id(retriever_server):
    corpus = _corpus(retriever_server.corpus_path)
    ids = list(corpus)[:3]
    with RetrieverClient(retriever_server.base_url) as client:
        docs = client.batch_access([ids[2], "no-such-id", ids[0]])
        assert client.stats.requests == 1 and client.stats.queries_sent == 0
    assert docs[1] is None
    assert [d["id"] for d in (docs[0], docs[2])] == [ids[2], ids[0]]
    assert docs[0]["contents"] == corpus[ids[2]] and docs[2]["contents"] == corpus[ids[0]]
    with pytest.raises(ValueError, match=r"ids\[0\] must be a non-empty string"):
        RetrieverClient(retriever_server.url).batch_access([" "])


def test_batch_access_fails_over_like_searches(retriever_server):
    from tests._fixtures.retriever import dead_url

    client = RetrieverClient([dead_url(), retriever_server.url], retries=0)
    assert client.batch_access(["0"])[0]["id"] == "0"
    with pytest.raises(SearchError, match=r"1 ids\)"):
        RetrieverClient(dead_url(), retries=0, timeout=1.0).batch_access(["0"])


def test_render_passages_numbers_from_start():
    text = render_passages(['"A"\nalpha', '"B"\nbeta'], start=4)
    assert text == "Doc 4(Title: A) alpha\nDoc 5(Title: B) beta\n"
