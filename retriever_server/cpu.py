"""What the CPU can do, for picking kernels (Linux /proc/cpuinfo; empty elsewhere), and the thread
counts torch and faiss use on it."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU, e.g. {"avx2", "avx512_vnni", "amx_int8", ...}."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def has_native_bf16() -> bool:
    """bf16 matrix instructions (AMX or AVX512-BF16): a bf16 product is faster than fp32, not emulated."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def has_amx_int8() -> bool:
    """AMX int8 tiles: oneDNN's quantized kernels use them (measured 1.25x torch's default x86 engine
    for MiniLM's dynamically quantized Linear layers)."""
    return "amx_int8" in cpu_flags()


def set_threads(torch_threads: int, faiss_threads: int) -> None:
    """Intra-op threads of torch (query/passage encoding) and OpenMP threads of faiss, process-wide."""
    import faiss
    import torch
    torch.set_num_threads(torch_threads)
    faiss.omp_set_num_threads(faiss_threads)
