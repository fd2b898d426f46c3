"""MicroBatcher: coalescing, splitting over idle workers, per-request k, and errors."""
import asyncio
import threading
import time

import numpy as np
import pytest

from retriever_server.batcher import MicroBatcher


class RecordingSearcher:
    """Row ids derived from the query text ("q17" -> 17, 18, ...), so a misrouted answer shows."""

    def __init__(self, seconds: float = 0.05, fail_on: str | None = None):
        self.seconds, self.fail_on = seconds, fail_on
        self.calls: list[tuple[int, float, float]] = []   # (queries, start, end)
        self._lock = threading.Lock()

    def search(self, queries, k):
        start = time.perf_counter()
        if self.fail_on in queries:
            raise RuntimeError("index exploded")
        time.sleep(self.seconds)
        with self._lock:
            self.calls.append((len(queries), start, time.perf_counter()))
        out = []
        for q in queries:
            base = int(q[1:])
            out.append((np.arange(base, base + k, dtype=np.int64), -np.arange(k, dtype=np.float32)))
        return out


def _run(coro):
    return asyncio.run(coro)


async def _with_batcher(searcher, fn, **kw):
    batcher = MicroBatcher(searcher, **kw)
    await batcher.start()
    try:
        return await fn(batcher), batcher
    finally:
        await batcher.stop()


def _check(result, queries, k):
    assert len(result) == len(queries)
    for q, (rows, scores) in zip(queries, result):
        assert rows.tolist() == list(range(int(q[1:]), int(q[1:]) + k)) and len(scores) == k


def test_concurrent_requests_share_batches_and_get_their_own_answers():
    searcher = RecordingSearcher()
    requests = [[f"q{100 * r + i}" for i in range(4)] for r in range(8)]

    async def go(b):
        return await asyncio.gather(*(b.search(qs, 3) for qs in requests))

    results, batcher = _run(_with_batcher(searcher, go, workers=1, window_ms=20))
    for qs, res in zip(requests, results):
        _check(res, qs, 3)
    assert len(searcher.calls) < 8 and sum(n for n, _, _ in searcher.calls) == 32
    assert batcher.stats.queries == 32 and batcher.stats.max_batch_queries > 4


def test_one_large_request_is_split_over_idle_workers():
    searcher = RecordingSearcher(seconds=0.2)
    queries = [f"q{i}" for i in range(64)]
    result, _ = _run(_with_batcher(searcher, lambda b: b.search(queries, 2), workers=2, window_ms=1))
    _check(result, queries, 2)
    assert sorted(n for n, _, _ in searcher.calls) == [32, 32]
    (_, s1, e1), (_, s2, e2) = searcher.calls
    assert max(s1, s2) < min(e1, e2)  # the two parts ran at the same time


def test_small_batches_and_single_worker_are_not_split():
    for workers, n, want in [(2, 15, [15]), (2, 16, [8, 8]), (1, 64, [64])]:
        searcher = RecordingSearcher(seconds=0.01)
        queries = [f"q{i}" for i in range(n)]
        result, _ = _run(_with_batcher(searcher, lambda b: b.search(queries, 1), workers=workers,
                                       window_ms=1, min_part=8))
        _check(result, queries, 1)
        assert sorted(c for c, _, _ in searcher.calls) == want, (workers, n)


def test_requests_with_different_k_in_one_batch():
    searcher = RecordingSearcher()

    async def go(b):
        return await asyncio.gather(b.search(["q1", "q2"], 1), b.search(["q10"], 5), b.search(["q20"], 3))

    (a, b5, c), _ = _run(_with_batcher(searcher, go, workers=1, window_ms=20))
    _check(a, ["q1", "q2"], 1)
    _check(b5, ["q10"], 5)
    _check(c, ["q20"], 3)


def test_a_failing_search_fails_its_requests_and_frees_the_workers():
    searcher = RecordingSearcher(seconds=0.01, fail_on="q13")

    async def go(b):
        with pytest.raises(RuntimeError, match="exploded"):
            await b.search([f"q{i}" for i in range(32)], 1)  # split in two; one part fails
        # both worker slots are free again: later requests are answered
        return await asyncio.wait_for(b.search([f"q{i}" for i in range(40, 72)], 1), timeout=5)

    result, _ = _run(_with_batcher(searcher, go, workers=2, window_ms=1))
    _check(result, [f"q{i}" for i in range(40, 72)], 1)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_part"):
        MicroBatcher(RecordingSearcher(), min_part=0)
