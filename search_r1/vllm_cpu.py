"""vLLM's CPU thread binding: the environment every vLLM-on-CPU process of this project gets.

Shared by the embedded trainer's `vllm serve` child (search_r1/rollout/vllm_server.py) and verl's vLLM
server actors on the CPU platform (`verl_ext.cpu.platform.PlatformCPU.rollout_env_vars`), so it lives
here, below both. It imports nothing but `os`.
"""
from __future__ import annotations

import os


def vllm_thread_binding() -> dict[str, str]:
    """`VLLM_CPU_OMP_THREADS_BIND` and `VLLM_CPU_NUM_OF_RESERVED_CPU` for a vLLM process.

    vLLM's CPU worker binds its OpenMP threads to `VLLM_CPU_OMP_THREADS_BIND`. The default, "auto",
    takes one logical CPU per physical core of one NUMA node and keeps
    `VLLM_CPU_NUM_OF_RESERVED_CPU` (1 on x86) of them free for vLLM's scheduler process: on a
    2-core host generation gets one core. In both trainers the training workers wait while the
    rollout generates, so the rollout gets every core this process may run on and none reserved.
    Values set in the environment win (e.g. `0-3|4-7` for tensor parallel 2).
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_list_spec(cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
    }


def cpu_list_spec(cores: list[int]) -> str:
    """Sorted CPU ids -> vLLM's list syntax with ranges: [0, 1, 2, 5] -> "0-2,5"."""
    if not cores:
        raise ValueError("cpu_list_spec: no CPU ids (is the process's CPU affinity empty?)")
    runs = [[cores[0], cores[0]]]
    for core in cores[1:]:
        if core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
