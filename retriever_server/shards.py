"""Index slices: one faiss index over a contiguous range of corpus rows, and the exact merge of the
top-k lists of several slices.

A dense index directory holds one slice (`dense.faiss`) or K (`build --shards K`:
`dense.shard-k-of-K.faiss`, rows [start_k, end_k)). Imported indexes are referenced by absolute
path. The manifest lists them in `params["slices"]` as {"path", "start", "end"}; a slice's rows are
local (0..end-start) inside its faiss file and global (+start) outside it.

Merge: every slice returns its own top-k, so the global top-k is among the K*k candidates:

    scores, rows = concat over slices            [B, K*k]
    order        = sort by (-score, row)          best first; ties by the smaller row, as faiss
    top-k        = first k of order               [B, k]

which equals one search over all rows of the same index type when each slice scores a row as the
whole index would (Flat: always; IVF: slices share the trained quantizer, `build --shards` trains
once). For an L2 index "best" is the smallest distance.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FAISS_FILE = "dense.faiss"
BF16_SCREEN_RAM_SHARE = 0.25   # `flat_search=auto` builds the bf16 copy only up to this share of RAM


def total_ram() -> int:
    """Physical memory in bytes (Linux; 0 elsewhere, which turns the automatic bf16 screen off)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def slice_file(k: int, n_shards: int) -> str:
    return FAISS_FILE if n_shards == 1 else f"dense.shard-{k}-of-{n_shards}.faiss"


def slice_bounds(n: int, n_shards: int) -> list[tuple[int, int]]:
    """K contiguous row ranges covering 0..n, sizes differing by at most one."""
    if n_shards < 1:
        raise ValueError(f"--shards {n_shards}; need at least 1")
    if n_shards > max(1, n):
        raise ValueError(f"--shards {n_shards} is more than the {n} passages; use at most {max(1, n)}")
    cuts = [round(i * n / n_shards) for i in range(n_shards + 1)]
    return list(zip(cuts, cuts[1:]))


@dataclass(frozen=True)
class SliceRef:
    """Where a slice lives and which corpus rows it holds."""
    path: str     # absolute, or relative to the index directory
    start: int    # first global row
    end: int      # one past the last global row

    def resolve(self, index_dir: Path) -> Path:
        p = Path(self.path)
        return p if p.is_absolute() else Path(index_dir) / p


def slices_of(params: dict) -> list[SliceRef]:
    """The manifest's slices; indexes built before slices were recorded hold one `dense.faiss`."""
    raw = params.get("slices")
    if not raw:
        n = params.get("n_vectors")
        return [SliceRef(FAISS_FILE, 0, -1 if n is None else int(n))]
    return [SliceRef(str(s["path"]), int(s["start"]), int(s["end"])) for s in raw]


def merge_topk(parts: list[tuple[np.ndarray, np.ndarray]], k: int, larger_is_better: bool = True
               ) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of several slices' top-k lists (module doc).

    Args:
        parts: per slice (scores [B, k_i] float32, global rows [B, k_i] int64; row -1 = no hit).
        k: results per query.
        larger_is_better: inner product (True) or L2 distance (False).
    Returns:
        scores [B, k'] and rows [B, k'], k' = min(k, sum k_i), best first; missing hits have row -1.
    """
    scores = np.concatenate([s for s, _ in parts], axis=1).astype(np.float32)   # [B, K*k]
    rows = np.concatenate([r for _, r in parts], axis=1).astype(np.int64)       # [B, K*k]
    key = -scores if larger_is_better else scores.copy()                         # smaller key = better
    key[rows < 0] = np.inf                                                       # no hit: last
    order = np.lexsort((rows, key), axis=1)[:, :k]                               # [B, k'] by key, then row
    return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)


class SliceSearcher:
    """Search one slice with query vectors; returns global rows.

    `flat_search` picks how a Flat inner-product slice is searched: `faiss` (fp32 BLAS), `bf16` (the
    exact bf16-screened search of flat_bf16.py, faiss for the queries it cannot certify) or `auto`
    (bf16 when the CPU has native bf16 matrix instructions, the slice is not memory-mapped and its
    bf16 copy, 2*d bytes per passage, takes at most a quarter of the machine's RAM: the screen keeps
    that copy beside the fp32 vectors; for wiki-18 with e5 it would be 32 GB).
    """

    def __init__(self, index, start: int, flat_search: str = "auto", mmap: bool = False):
        import faiss

        from .cpu import has_native_bf16
        from .flat_bf16 import Bf16FlatScreen

        self.index, self.start = index, start
        self.n = int(index.ntotal)
        self.larger_is_better = index.metric_type == faiss.METRIC_INNER_PRODUCT
        self.screen = None
        is_flat_ip = isinstance(index, faiss.IndexFlat) and self.larger_is_better
        if flat_search == "bf16" and not is_flat_ip:
            raise ValueError(f"flat_search=bf16 needs a Flat inner-product index, this one is "
                             f"{describe_faiss(index)!r}; use flat_search=auto or faiss")
        use_screen = flat_search == "bf16" or (flat_search == "auto" and has_native_bf16() and not mmap
                                                and 2 * self.n * index.d <= BF16_SCREEN_RAM_SHARE * total_ram())
        if is_flat_ip and self.n and use_screen:
            # A view of faiss's own fp32 storage (no copy); the index object keeps it alive.
            xb = faiss.rev_swig_ptr(index.get_xb(), self.n * index.d)
            self.screen = Bf16FlatScreen(np.asarray(xb).reshape(self.n, index.d))

    @property
    def flat_search(self) -> str:
        return "bf16" if self.screen is not None else "faiss"

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """q [B, d] float32 -> (scores [B, k'], global rows [B, k']), k' = min(k, slice size)."""
        k = min(k, self.n)
        if k == 0:
            return np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), np.int64)
        if self.screen is not None:
            scores, rows, certified = self.screen.search(q, k)     # [B, k], [B, k], [B]
            redo = np.flatnonzero(~certified)
            if redo.size:  # near-ties at the k-th score: exact fp32 search for those queries
                scores[redo], rows[redo] = self.index.search(q[redo], k)
        else:
            scores, rows = self.index.search(q, k)                 # [B, k] each; row -1 = no hit
        rows = rows.astype(np.int64)
        return scores.astype(np.float32), np.where(rows >= 0, rows + self.start, -1)


def describe_faiss(index) -> str:
    """flat / hnsw / ivf / ivfpq for the types `build` makes, else faiss's class name."""
    import faiss
    if isinstance(index, faiss.IndexFlat):
        return "flat"
    if isinstance(index, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(index, faiss.IndexIVFPQ):
        return "ivfpq"
    if isinstance(index, faiss.IndexIVFFlat):
        return "ivf"
    return type(index).__name__


def read_faiss(path: Path, mmap: bool = False):
    """faiss.read_index, memory-mapped when asked: the vectors (Flat, HNSW storage) or inverted lists
    (IVF) stay in the page cache, shared by every process serving the file, instead of private RAM."""
    import faiss
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such faiss index file (moved? re-run `import` or `build`)")
    if not mmap:
        return faiss.read_index(str(path))
    for flag in (faiss.IO_FLAG_MMAP_IFC, faiss.IO_FLAG_MMAP):
        try:
            return faiss.read_index(str(path), flag | faiss.IO_FLAG_READ_ONLY)
        except RuntimeError as exc:  # this index type cannot be mapped with this flag
            log.info("mmap flag %s failed for %s: %s", flag, path, exc)
    log.warning("%s: this faiss index type cannot be memory-mapped; reading it into memory", path)
    return faiss.read_index(str(path))


def flat_rows(index, start: int, end: int):
    """A Flat index over rows [start, end) of a Flat index (a copy of that slice's vectors): how a
    single Flat file is split over shard replicas at serve time."""
    import faiss
    if not isinstance(index, faiss.IndexFlat):
        raise ValueError(f"splitting one index into shards at serve time needs a Flat index, this one is "
                         f"{describe_faiss(index)!r}; write K slices with `build --shards K` instead")
    xb = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d)
    out = faiss.IndexFlat(index.d, index.metric_type)
    out.add(np.asarray(xb).reshape(index.ntotal, index.d)[start:end])
    return out


def to_gpus(index):
    """The index on every visible GPU, sharded over them (faiss's GPU build only).

    Raises:
        ValueError: when this faiss has no GPU support or sees no GPU.
    """
    import faiss
    n_gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if not hasattr(faiss, "StandardGpuResources") or n_gpus == 0:
        raise ValueError(
            f"--faiss-gpu: this faiss ({faiss.__version__}, "
            f"{'no GPU support' if not hasattr(faiss, 'StandardGpuResources') else 'no visible GPU'}) cannot "
            "put the index on GPUs; on a CUDA node install faiss's GPU build (`pip install faiss-gpu-cu12` "
            "in place of faiss-cpu, or conda's faiss-gpu) and check CUDA_VISIBLE_DEVICES, or drop --faiss-gpu")
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True        # each GPU holds 1/n of the vectors (not a full copy)
    options.useFloat16 = True   # half the GPU memory; scores differ from fp32 in the 4th digit
    return faiss.index_cpu_to_all_gpus(index, co=options)
