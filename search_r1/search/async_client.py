"""Async search for per-trajectory rollouts: many coroutines, few batched `/retrieve` requests.

verl's agent-loop worker runs hundreds of trajectories as coroutines on one event loop; each reaches
its search at its own moment. `CoalescingSearch` gathers the queries that arrive within a short
window (or until `max_batch` are waiting) and sends them as one `batch_search` call of the wrapped
engine, run in a thread so the event loop keeps serving the other trajectories meanwhile. Wrapping
a `RetrieverClient` keeps everything it does (URL normalisation, retries with backoff, failover
across URLs, timeouts, the LRU cache, `SearchError`); this module only adds the coalescing.

    search = CoalescingSearch(RetrieverClient(["http://node1:8000", "http://node2:8000"], topk=3))
    passages = await search.search("who founded Veltra")     # rendered `Doc i(Title: ..)` lines

A failed batch raises `SearchError` in every coroutine that waited on it (each one then shows the
policy the "search failed" observation); a later batch tries again.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from search_r1.search.base import SearchEngine


@dataclass
class CoalescingStats:
    """Counters: `batches` engine calls made, `queries` searched through them, `largest` batch,
    `failed_batches` calls that raised."""

    batches: int = 0
    queries: int = 0
    largest: int = 0
    failed_batches: int = 0


class CoalescingSearch:
    """Coalesces concurrent `await search(query)` calls into batched `engine.batch_search` calls.

    Args:
        engine: any `SearchEngine` (thread-safe, as `RetrieverClient` is; its `batch_search` runs in
            a worker thread).
        window_s: how long the first query of a batch waits for company (seconds, >= 0). A few
            milliseconds cost nothing beside a generation turn and turn 64 round trips into one.
        max_batch: a batch is sent as soon as this many queries wait (>= 1).

    One instance belongs to one event loop (the agent-loop worker's); verl_ext.agent_loop.shared_search
    hands out one per (event loop, retriever settings).
    """

    def __init__(self, engine: SearchEngine, window_s: float = 0.01, max_batch: int = 64):
        if not isinstance(window_s, (int, float)) or window_s < 0:
            raise ValueError(f"CoalescingSearch window_s must be a number >= 0 (seconds), got {window_s!r}")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"CoalescingSearch max_batch must be an int >= 1, got {max_batch!r}")
        self.engine, self.window_s, self.max_batch = engine, float(window_s), max_batch
        self.stats = CoalescingStats()
        self._waiting: list[tuple[str, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._in_flight: set[asyncio.Task] = set()  # strong refs: a bare task may be collected

    async def search(self, query: str) -> str:
        """Rendered passages for `query`; raises `SearchError` when the engine failed."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((query, future))
        if len(self._waiting) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await future

    def _flush(self) -> None:
        """Send everything waiting now as one batch (called by the timer or by a full batch)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting = self._waiting, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _send(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        queries = [q for q, _ in batch]
        self.stats.batches += 1
        self.stats.queries += len(queries)
        self.stats.largest = max(self.stats.largest, len(queries))
        try:
            results = await asyncio.to_thread(self.engine.batch_search, queries)
            if len(results) != len(queries):
                raise ValueError(f"search engine returned {len(results)} results for {len(queries)} queries")
        except Exception as err:  # every waiter gets the failure; SearchError is the expected one
            self.stats.failed_batches += 1
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), text in zip(batch, results):
            if not future.done():  # the waiting coroutine may have been cancelled
                future.set_result(text)

    async def aclose(self) -> None:
        """Wait for batches in flight, then close the engine."""
        if self._waiting:
            self._flush()
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        self.engine.close()
