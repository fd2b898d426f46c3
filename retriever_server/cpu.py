"""What the CPU can do, for picking kernels (Linux /proc/cpuinfo; empty elsewhere), and the thread
counts torch and faiss use on it (`auto` in the serve flags)."""
from __future__ import annotations

import os
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


def resolve_auto(args, kinds: list[str]) -> None:
    """Fill in `auto` for --workers / --torch-threads / --faiss-threads / --max-batch (in place).

    With a dense index, `auto` runs one batch per CPU at once, each encoded with one torch thread:
    measured on 2 cores, two single-threaded batches in flight encode 1.1-1.5x the queries of one
    batch on two threads (small matrices scale poorly across threads), and the tokenizing, search
    and HTTP work of one batch overlaps the other's encoding. Dense batches are capped at 64 queries:
    larger ones encode no faster per query, and smaller ones keep the search threads out of step
    (one answers its clients while the other computes; at 100k passages the served share of the
    encoder ceiling went from 79% to 92% fp32, 71% to 86% int8). BM25 search is numpy code that
    mostly holds the GIL: one batch at a time, up to 256 queries (the event loop uses the other core).
    """
    cpus = max(1, (os.cpu_count() or 1) // max(1, args.processes))
    dense = "dense" in kinds
    if args.workers == "auto":
        args.workers = cpus if dense else 1
    per_worker = max(1, cpus // args.workers)
    if args.torch_threads == "auto":
        args.torch_threads = per_worker
    if args.faiss_threads == "auto":
        args.faiss_threads = per_worker
    if args.max_batch == "auto":
        args.max_batch = 64 if dense else 256
