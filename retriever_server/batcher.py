"""Cross-request micro-batching: concurrent requests share one index lookup / one encoder call.

Requests arrive on the event loop; their queries are queued. A dispatcher coroutine waits for a free
worker slot, then collects queued work for at most `window_ms` (or until `max_batch` queries) and
runs the searcher on the whole batch in a thread pool, so the event loop keeps accepting requests
while the batch runs. Under load the queue fills while the workers are busy, batches grow by
themselves and the window rarely has to wait; when idle a lone request waits at most `window_ms`.
A request larger than `max_batch` is split into chunks that are batched like separate requests.

With several workers, a collected batch is split over the workers that are idle at that moment
(parts of at least `min_part` queries): one large request, or clients that all send at once (they
all got their answers from the same batch), would otherwise keep one worker busy and the rest idle.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


@dataclass
class _Job:
    queries: list[str]
    k: int
    future: asyncio.Future


@dataclass
class BatchStats:
    """Counters updated on the event loop thread only (no lock needed)."""

    batches: int = 0
    queries: int = 0
    max_batch_queries: int = 0
    search_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"batches": self.batches, "batched_queries": self.queries,
                "mean_batch_queries": round(self.queries / self.batches, 2) if self.batches else 0.0,
                "max_batch_queries": self.max_batch_queries,
                "search_seconds": round(self.search_seconds, 3)}


class MicroBatcher:
    """`await batcher.search(queries, k)` -> [(rows, scores)] per query, batched with other callers."""

    def __init__(self, searcher, window_ms: float = 2.0, max_batch: int = 256, workers: int = 1,
                 min_part: int = 8):
        if max_batch < 1 or workers < 1 or window_ms < 0 or min_part < 1:
            raise ValueError(f"max_batch={max_batch}, workers={workers}, window_ms={window_ms}, "
                             f"min_part={min_part}: need max_batch >= 1, workers >= 1, window_ms >= 0, "
                             "min_part >= 1")
        self.searcher = searcher
        self.min_part = min_part
        self.window = window_ms / 1000.0
        self.max_batch = max_batch
        self.workers = workers
        self.stats = BatchStats()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="search")
        self._queue: asyncio.Queue[_Job] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._task: asyncio.Task | None = None
        self._carry: _Job | None = None
        self._running: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.workers)
        self._task = asyncio.create_task(self._dispatch_forever(), name="micro-batcher")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        loop = asyncio.get_running_loop()
        futures = []
        for start in range(0, len(queries), self.max_batch):
            fut = loop.create_future()
            self._queue.put_nowait(_Job(queries[start:start + self.max_batch], k, fut))
            futures.append(fut)
        parts = await asyncio.gather(*futures)
        return [hit for part in parts for hit in part]

    async def _next_job(self, timeout: float | None) -> _Job | None:
        if self._carry is not None:
            job, self._carry = self._carry, None
            return job
        if timeout is None:
            return await self._queue.get()
        if not self._queue.empty() or timeout <= 0:
            return self._queue.get_nowait() if not self._queue.empty() else None
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return None

    async def _dispatch_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._next_job(None)
            await self._slots.acquire()
            batch, n = [first], len(first.queries)
            deadline = loop.time() + self.window
            while n < self.max_batch:
                job = await self._next_job(deadline - loop.time())
                if job is None:
                    break
                if n + len(job.queries) > self.max_batch:
                    self._carry = job
                    break
                batch.append(job)
                n += len(job.queries)
            parts = 1  # one more part per idle worker, while every part keeps >= min_part queries
            while parts < self.workers and n >= (parts + 1) * self.min_part and not self._slots.locked():
                await self._slots.acquire()  # free: returns at once
                parts += 1
            task = asyncio.create_task(self._run(batch, n, parts))
            self._running.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._running.discard)

    async def _search_part(self, queries: list[str], k: int):
        """One part on one worker thread; frees its worker slot when done."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self.searcher.search, queries, k)
        finally:
            self._slots.release()

    async def _run(self, batch: list[_Job], n: int, parts: int) -> None:
        loop = asyncio.get_running_loop()
        queries = [q for job in batch for q in job.queries]
        k = max(job.k for job in batch)
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        tasks = [asyncio.ensure_future(self._search_part(queries[a:b], k)) for a, b in zip(bounds, bounds[1:])]
        try:
            t0 = loop.time()
            hits = [hit for part in await asyncio.gather(*tasks) for hit in part]
            self.stats.batches += parts
            self.stats.queries += n
            self.stats.max_batch_queries = max(self.stats.max_batch_queries, bounds[1])
            self.stats.search_seconds += loop.time() - t0
            offset = 0
            for job in batch:
                mine = hits[offset:offset + len(job.queries)]
                offset += len(job.queries)
                if not job.future.done():
                    job.future.set_result([(r[:job.k], s[:job.k]) for r, s in mine])
        except Exception as e:  # the searcher failed: every waiting request gets the error
            await asyncio.gather(*tasks, return_exceptions=True)  # every part has freed its slot
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(e)
