"""RetrieverClient against a tiny loopback HTTP server: batching, cache, failover, errors, auth."""
from __future__ import annotations

import threading
import time

import pytest

from search_r1.search import RetrieverClient, SearchError, render_passages
from search_r1.search.retriever_client import normalize_url, parse_hit


def test_normalize_url_accepts_base_and_full_urls():
    assert normalize_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/retrieve"
    assert normalize_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000/retrieve"
    assert normalize_url("http://127.0.0.1:8000/retrieve") == "http://127.0.0.1:8000/retrieve"
    assert normalize_url("127.0.0.1:8000") == "http://127.0.0.1:8000/retrieve"
    with pytest.raises(ValueError, match="http"):
        normalize_url("ftp://x")
    with pytest.raises(ValueError, match="non-empty"):
        normalize_url("")


def test_parse_hit_both_shapes():
    doc = {"id": "7", "contents": "\"A\"\nb"}
    assert parse_hit({"document": doc, "score": 1.5}) == {"id": "7", "contents": "\"A\"\nb", "score": 1.5}
    assert parse_hit(doc) == {"id": "7", "contents": "\"A\"\nb", "score": None}
    assert parse_hit({"id": 3, "title": "A", "text": "b"})["contents"] == "\"A\"\nb"
    with pytest.raises(ValueError, match="contents"):
        parse_hit({"id": "1"})


@pytest.mark.parametrize("bad", [dict(topk=0), dict(retries=-1), dict(timeout=0), dict(backoff=-1),
                                 dict(cache_size=-1), dict(max_batch_size=0), dict(topk=True)])
def test_bad_arguments_raise_value_error(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RetrieverClient("http://127.0.0.1:1", **bad)
    with pytest.raises(ValueError, match="at least one url"):
        RetrieverClient([])


def test_rendering_and_one_post_per_batch(tiny_retriever):
    srv = tiny_retriever()
    with RetrieverClient(srv.base_url, topk=2) as client:
        out = client.batch_search(["alpha", "beta", "alpha"])
    assert len(srv.requests) == 1
    # duplicates inside a call are sent once; the request carries the upstream fields
    assert srv.requests[0] == {"queries": ["alpha", "beta"], "topk": 2, "return_scores": True}
    assert out[0] == "Doc 1(Title: T0 alpha) text 0 for alpha\nDoc 2(Title: T1 alpha) text 1 for alpha\n"
    assert out[2] == out[0]
    assert out[1].startswith("Doc 1(Title: T0 beta) text 0 for beta\n")


def test_batch_retrieve_raw_docs_and_bare_shape(tiny_retriever):
    for mode, score in (("ok", 3.0), ("bare", None)):
        srv = tiny_retriever(mode=mode)
        with RetrieverClient(srv.url, topk=3) as client:
            docs = client.batch_retrieve(["q"])
        assert [d["id"] for d in docs[0]] == ["q#0", "q#1", "q#2"]
        assert docs[0][0]["score"] == score
        assert docs[0][0]["contents"] == "\"T0 q\"\ntext 0 for q"


def test_cache_hits_avoid_requests(tiny_retriever):
    srv = tiny_retriever()
    client = RetrieverClient(srv.url, topk=2, cache_size=2)
    first = client.batch_search(["a", "b"])
    assert client.batch_search(["b", "a"]) == first[::-1]
    assert len(srv.requests) == 1 and client.stats.cache_hits == 2
    client.batch_search(["a", "c"])  # only c is new
    assert srv.requests[-1]["queries"] == ["c"]
    client.batch_search(["b"])  # capacity 2: b was evicted (LRU order a, c)
    assert srv.requests[-1]["queries"] == ["b"] and len(srv.requests) == 3
    # mutating a returned doc must not poison the cache
    client.batch_retrieve(["b"])[0][0]["contents"] = "changed"
    assert client.batch_retrieve(["b"])[0][0]["contents"] != "changed"
    no_cache = RetrieverClient(srv.url, topk=2, cache_size=0)
    no_cache.batch_search(["a"]), no_cache.batch_search(["a"])
    assert len(srv.requests) == 5


def test_large_calls_split_by_max_batch_size(tiny_retriever):
    srv = tiny_retriever()
    client = RetrieverClient(srv.url, max_batch_size=4)
    out = client.batch_search([f"q{i}" for i in range(10)])
    assert [len(r["queries"]) for r in srv.requests] == [4, 4, 2]
    assert all(o.startswith(f"Doc 1(Title: T0 q{i})") for i, o in enumerate(out))
    assert client.batch_search([]) == [] and len(srv.requests) == 3


def test_blank_queries_get_no_documents_without_failing_the_batch(tiny_retriever):
    srv = tiny_retriever()
    client = RetrieverClient(srv.url, topk=1)
    out = client.batch_search(["", "x", "   "])
    assert out == ["", "Doc 1(Title: T0 x) text 0 for x\n", ""]
    assert srv.requests == [{"queries": ["x"], "topk": 1, "return_scores": True}]
    assert client.batch_search(["  "]) == [""] and len(srv.requests) == 1


def test_round_robin_across_healthy_urls(tiny_retriever):
    a, b = tiny_retriever(), tiny_retriever()
    client = RetrieverClient([a.base_url, b.url], cache_size=0)
    for i in range(6):
        client.batch_search([f"q{i}"])
    assert len(a.requests) == 3 and len(b.requests) == 3


def test_failover_dead_url_answers_from_live_one(tiny_retriever, dead_url):
    live = tiny_retriever()
    client = RetrieverClient([dead_url, live.url], cache_size=0, backoff=0)
    out = [client.batch_search([f"q{i}"])[0] for i in range(6)]
    assert all(o.startswith(f"Doc 1(Title: T0 q{i})") for i, o in enumerate(out))
    assert len(live.requests) == 6
    # the dead URL is tried once, then cools down behind the live one
    assert client.stats.failures == 1 and client.stats.retry_rounds == 0


def test_5xx_fails_over_and_4xx_is_not_retried(tiny_retriever):
    broken, good = tiny_retriever(mode="500"), tiny_retriever()
    client = RetrieverClient([broken.url, good.url], backoff=0)
    assert client.search("x").startswith("Doc 1(Title: T0 x)")
    assert len(broken.requests) == 1 and len(good.requests) == 1

    bad = tiny_retriever(mode="400")
    client = RetrieverClient([bad.url, good.url], retries=3, backoff=0)
    with pytest.raises(SearchError, match="HTTP 400: queries: at most 2 queries per request"):
        client.search("y")
    assert len(bad.requests) == 1 and len(good.requests) == 1  # no failover, no retry


@pytest.mark.parametrize("mode", ["500", "garbage", "short"])
def test_all_failing_raises_after_retries_naming_urls(tiny_retriever, dead_url, mode):
    srv = tiny_retriever(mode=mode)
    client = RetrieverClient([srv.url, dead_url], retries=2, backoff=0.05)
    t0 = time.monotonic()
    with pytest.raises(SearchError) as err:
        client.batch_search(["a", "b"])
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert "3 round(s)" in msg and srv.url in msg and normalize_url(dead_url) in msg
    assert {"500": "HTTP 500: index exploded", "garbage": "malformed", "short": "0 entries for 2"}[mode] in msg
    assert "ConnectError" in msg
    assert len(srv.requests) == 3  # one per round
    # backoff 0.05 * (1 + 2) * [1, 1.5] = 0.15 .. 0.225 s of sleeping, plus fast failures
    assert 0.15 <= elapsed < 2.0


def test_timeout_fails_over(tiny_retriever):
    slow, fast = tiny_retriever(mode="slow", delay=1.0), tiny_retriever()
    client = RetrieverClient([slow.url, fast.url], timeout=0.2, backoff=0)
    t0 = time.monotonic()
    assert client.search("z").startswith("Doc 1(Title: T0 z)")
    assert time.monotonic() - t0 < 0.9
    client2 = RetrieverClient(slow.url, timeout=0.2, retries=0)
    with pytest.raises(SearchError, match="timeout after 0.2s"):
        client2.search("z")


def test_recovered_url_rejoins_after_cooldown(tiny_retriever):
    a, b = tiny_retriever(mode="500"), tiny_retriever()
    client = RetrieverClient([a.url, b.url], cache_size=0, backoff=0, health_cooldown=0.2)
    client.search("q0")
    a.mode = "ok"
    for i in range(4):
        client.search(f"q{i}")
    assert len(a.requests) == 1  # still cooling down: all traffic on b
    time.sleep(0.25)
    for i in range(4):
        client.search(f"r{i}")
    assert len(a.requests) == 3  # back in the rotation


def test_auth_header_from_arg_and_env(tiny_retriever, monkeypatch):
    srv = tiny_retriever(api_key="s3cret")
    with pytest.raises(SearchError, match="HTTP 401.*RETRIEVER_API_KEY"):
        RetrieverClient(srv.url).search("q")
    assert len(srv.requests) == 1  # 401 is not retried
    assert RetrieverClient(srv.url, api_key="s3cret").search("q").startswith("Doc 1")
    monkeypatch.setenv("RETRIEVER_API_KEY", "s3cret")
    assert RetrieverClient(srv.url).search("q2").startswith("Doc 1")
    assert srv.auth_headers[-1] == "Bearer s3cret"
    open_srv = tiny_retriever()
    monkeypatch.delenv("RETRIEVER_API_KEY")
    RetrieverClient(open_srv.url).search("q")
    assert open_srv.auth_headers == [None]


def test_thread_safe_under_concurrency(tiny_retriever):
    a, b = tiny_retriever(), tiny_retriever()
    client = RetrieverClient([a.url, b.url], cache_size=64)
    errors, outs = [], {}

    def work(t):
        try:
            for i in range(20):
                q = f"t{t % 4}-{i % 10}"
                outs[(t, i)] = (q, client.search(q))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    [t.start() for t in threads], [t.join() for t in threads]
    assert not errors
    assert all(out == render_passages([f"\"T{i} {q}\"\ntext {i} for {q}" for i in range(3)])
               for q, out in outs.values())
    assert len(client._cache) <= 64
