"""How much of a freed 100 MB buffer a process keeps, before and after `release_memory` (MB).

    memory_kept("reuse")   # runs `python -m tests._fixtures.memory_kept reuse` in a child process

A child process because glibc's settings are process-wide. `reuse` calls `reuse_freed_memory`;
`worker` / `worker-off` build a PolicyWorker (tiny model) with `WorkerSpec.reuse_freed_memory` on / off.
Prints two numbers: RSS growth after the buffer is freed, and after `release_memory`.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def memory_kept(mode: str) -> list[float]:
    """[RSS growth (MB) after the buffer is freed, after release_memory] in a child process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "tests._fixtures.memory_kept", mode], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [float(x) for x in out.stdout.split()[-2:]]


def main(mode: str) -> None:
    import torch

    from search_r1.models import release_memory, reuse_freed_memory
    from search_r1.procmem import tree_memory

    def rss_mb() -> float:
        return tree_memory(os.getpid(), "rss") / 1e6

    if mode == "reuse":
        assert reuse_freed_memory()
    elif mode in ("worker", "worker-off"):
        from search_r1.trainer.workers import WorkerSpec, in_process_worker

        in_process_worker(WorkerSpec(model_name="tiny-random-qwen3", reuse_freed_memory=mode == "worker"))
    release_memory()
    start = rss_mb()
    torch.ones(25_000_000).sum()  # 100 MB touched and freed (a micro-batch's fp32 logits are 98 MB)
    after_free = rss_mb()
    release_memory()
    print(after_free - start, rss_mb() - start)


if __name__ == "__main__":
    main(sys.argv[1])
