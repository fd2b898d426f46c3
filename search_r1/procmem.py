"""Memory of a process tree (a trainer with its Ray workers, a server with its worker processes).

`tree_memory(pid, "rss")` sums resident memory over the process and all its descendants; "pss"
splits shared pages (torch libraries, Ray's object store) among the processes that map them, so the
sum is the memory the tree really holds, where summed RSS counts shared pages once per process.
`PeakTreeMemory` samples that sum in a thread and keeps the peak (benchmarks, end-to-end tests).
"""
from __future__ import annotations

import threading

import psutil

METRICS = ("rss", "pss")


def tree_memory(pid: int, metric: str = "rss") -> int:
    """Bytes of `metric` summed over process `pid` and its descendants (processes that exit while
    being read are skipped)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info() if metric == "pss" else proc.memory_info()
            total += getattr(info, metric)
        except psutil.Error:
            pass
    return total


class PeakTreeMemory:
    """Peak of `tree_memory(pid, metric)`, sampled every `every` seconds in a daemon thread until
    `stop()`, which returns the peak in GiB."""

    def __init__(self, pid: int, metric: str = "rss", every: float = 0.5):
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        self.pid, self.metric, self.every, self.peak = pid, metric, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, tree_memory(self.pid, self.metric))
            except psutil.Error:  # the root exited
                return
            self._stop.wait(self.every)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30
