"""CoalescingSearch (search_r1/search/async_client.py) against the real retriever server: concurrent
coroutines' queries become few batched /retrieve requests, with RetrieverClient's failover, cache and
SearchError underneath; and verl_ext shares one client per event loop."""
from __future__ import annotations

import asyncio

import pytest

from search_r1.search import RetrieverClient, SearchError
from search_r1.search.async_client import CoalescingSearch
from verl_ext.agent_loop import RetrieverSettings, shared_search

from tests._fixtures.retriever import corpus_titles, dead_url


async def gather_searches(search: CoalescingSearch, queries, stagger_s: float = 0.0):
    async def one(i, q):
        await asyncio.sleep(stagger_s * i)
        return await search.search(q)
    return await asyncio.gather(*(one(i, q) for i, q in enumerate(queries)), return_exceptions=True)


def test_concurrent_searches_coalesce_into_one_request(retriever_server):
    queries = corpus_titles(retriever_server.corpus_path, 10)
    engine = RetrieverClient(retriever_server.url, topk=2, cache_size=0)
    search = CoalescingSearch(engine, window_s=0.2, max_batch=64)
    got = asyncio.run(gather_searches(search, queries, stagger_s=0.005))
    want = RetrieverClient(retriever_server.url, topk=2).batch_search(queries)
    assert got == want  # same passages, in each caller's order
    assert (search.stats.batches, search.stats.queries, search.stats.largest) == (1, 10, 10)
    assert engine.stats.requests == 1


def test_max_batch_caps_a_request(retriever_server):
    queries = corpus_titles(retriever_server.corpus_path, 10)
    engine = RetrieverClient(retriever_server.url, topk=1, cache_size=0)
    search = CoalescingSearch(engine, window_s=0.5, max_batch=4)
    got = asyncio.run(asyncio.wait_for(gather_searches(search, queries), timeout=30))
    assert got == RetrieverClient(retriever_server.url, topk=1).batch_search(queries)
    # two full batches of 4 go out at once, the last 2 when the window expires
    assert search.stats.largest == 4 and search.stats.batches == 3 and engine.stats.requests == 3


def test_failover_and_failure_reach_every_waiter(retriever_server):
    queries = corpus_titles(retriever_server.corpus_path, 3)
    # a dead URL first, the live one second: RetrieverClient fails over inside the one batch
    engine = RetrieverClient([dead_url(), retriever_server.url], topk=1, retries=0, timeout=2.0)
    search = CoalescingSearch(engine, window_s=0.05)
    got = asyncio.run(gather_searches(search, queries))
    assert got == RetrieverClient(retriever_server.url, topk=1).batch_search(queries)
    assert engine.stats.failures >= 1 and search.stats.failed_batches == 0
    # every URL dead: each waiting coroutine gets the SearchError, the next batch tries again
    down = CoalescingSearch(RetrieverClient(dead_url(), retries=1, backoff=0.01, timeout=1.0), window_s=0.05)
    results = asyncio.run(gather_searches(down, ["a", "b", "c"]))
    assert all(isinstance(r, SearchError) for r in results) and down.stats.failed_batches == 1


def test_bad_arguments_name_the_problem():
    engine = RetrieverClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="window_s must be a number >= 0"):
        CoalescingSearch(engine, window_s=-1)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        CoalescingSearch(engine, max_batch=0)
    with pytest.raises(ValueError, match="search_r1.retriever.urls is empty"):
        RetrieverSettings(urls=[])


def test_one_shared_client_per_event_loop_and_settings(retriever_server):
    settings = RetrieverSettings(urls=(retriever_server.url,), topk=2)

    async def two_lookups():
        return shared_search(settings), shared_search(settings), shared_search(RetrieverSettings(urls=(retriever_server.url,), topk=3))

    a, b, c = asyncio.run(two_lookups())
    assert a is b and a is not c
    (d, _, _) = asyncio.run(two_lookups())  # another event loop: another client
    assert d is not a
