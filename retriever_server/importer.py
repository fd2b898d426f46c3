"""`python -m retriever_server import`: serve a faiss index and jsonl corpus that exist already.

    python -m retriever_server import --faiss e5_Flat.index --corpus wiki-18.jsonl \\
        --model /models/e5-base-v2 --out idx_wiki18_e5

writes `idx_wiki18_e5/manifest.json` and `idx_wiki18_e5/docs/` (line offsets and id hashes of the
corpus: ~24 bytes per passage). The faiss file and the jsonl stay where they are and are referenced
by absolute path: nothing is copied and no passage is re-encoded (a 61 GB Flat index imports in the
time it takes to read the corpus once).

Checks, each failing with both numbers and the fix:
- the index holds as many vectors as the corpus has rows (faiss row i = corpus line i);
- the index's dimension is the encoder's;
- `--verify N` (default 8) re-encodes N passages spread over the corpus with the resolved convention
  and compares them with the stored vectors (Flat/HNSW: relative difference; other types: the
  passage must come back among its own top 10). This catches a wrong model or a wrong convention
  (a missing "passage: " prefix, CLS instead of mean pooling, normalization) before anything is
  served with it.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from .conventions import EncoderConvention, read_st_layout, resolve_convention

# Relative difference |v - stored| / |stored| accepted by --verify: an index encoded in fp16 on a GPU
# (upstream's builder uses fp16) differs from our fp32 re-encoding by ~1e-3; a wrong prefix or pooling
# moves a passage vector by 0.1-0.5.
VERIFY_TOLERANCE = 0.03


def import_index(faiss_path: Path, corpus: Path, out: Path, model: str | None, convention: str = "auto",
                 pooling: str | None = None, query_prefix: str | None = None,
                 passage_prefix: str | None = None, normalize: bool | None = None,
                 max_seq_length: int = 256, verify: int = 8, force: bool = False) -> Path:
    """Write the manifest and the referenced document store for an existing index (module doc)."""
    from .corpus_store import write_jsonl_refs
    from .dense_index import model_params, resolve_model
    from .manifest import STORE_SUBDIR, Manifest, now_iso, publish_index
    from .shards import describe_faiss, read_faiss

    faiss_path, corpus, out = Path(faiss_path).resolve(), Path(corpus).resolve(), Path(out)
    if not faiss_path.is_file():
        raise FileNotFoundError(f"--faiss {faiss_path}: no such file (a faiss index written with "
                                "faiss.write_index, e.g. upstream's e5_Flat.index)")
    if not corpus.is_file():
        raise FileNotFoundError(f"--corpus {corpus}: no such file (the jsonl the index was built from, "
                                'one {"id", "contents"} object per line, in index order)')
    _check_out(out)
    t0 = time.time()
    model_path = resolve_model(model)
    conv = resolve_convention(model_path, convention, pooling, query_prefix, passage_prefix, normalize)
    dim = encoder_dim(model_path)
    index = read_faiss(faiss_path, mmap=True)     # header and a mapping only, not 61 GB of RAM
    if index.d != dim:
        raise ValueError(f"--faiss {faiss_path} holds {index.d}-dimensional vectors but the encoder "
                         f"{model_path} makes {dim}-dimensional ones; import with the --model the index "
                         "was built with (wiki-18's e5_Flat.index: e5-base-v2, 768)")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        n_rows, sha = write_jsonl_refs(corpus, tmp / STORE_SUBDIR)
        if index.ntotal != n_rows:
            raise ValueError(f"--faiss {faiss_path} holds {index.ntotal} vectors but --corpus {corpus} has "
                             f"{n_rows} rows; they must be the same passages in the same order (was the index "
                             "built from another corpus file, or the corpus cut or appended to?)")
        import faiss
        metric = "inner_product" if index.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"
        if metric == "l2" and index.metric_type != faiss.METRIC_L2:
            raise ValueError(f"--faiss {faiss_path}: metric {index.metric_type} is not supported; "
                             "inner product and L2 are")
        if verify:
            from .corpus_store import JsonlStore
            store = JsonlStore(tmp / STORE_SUBDIR)
            try:
                verify_vectors(index, store, model_path, conv, max_seq_length, verify)
            finally:
                store.close()
        stat = faiss_path.stat()
        params = {**model_params(model, model_path), "dim": dim, "faiss": describe_faiss(index),
                  "metric": metric, "normalized": conv.normalize, "encoder": conv.as_dict(),
                  "max_seq_length": max_seq_length, "n_vectors": n_rows, "imported": True,
                  "faiss_file": {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
                  "slices": [{"path": str(faiss_path), "start": 0, "end": n_rows}]}
        Manifest(kind="dense", corpus_path=str(corpus), corpus_size=n_rows, corpus_sha256=sha,
                 params=params, build_seconds=round(time.time() - t0, 2), built_at=now_iso()).write(tmp)
        publish_index(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[retriever] imported {describe_faiss(index)} index ({n_rows} x {dim}, {conv.name} convention) "
          f"over {corpus} in {time.time() - t0:.1f}s -> {out}", file=sys.stderr)
    return out


def _check_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / "manifest.json").exists():
        raise FileExistsError(f"--out {out} is not an index directory (no manifest.json); "
                              "refusing to replace it, choose another --out")


def encoder_dim(model_path: Path) -> int:
    """The encoder's output dimension from its config (no weights loaded)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(read_st_layout(model_path)[0]), local_files_only=True)
    for name in ("hidden_size", "d_model", "dim"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    raise ValueError(f"--model {model_path}: config.json names no hidden size (hidden_size/d_model/dim)")


def verify_vectors(index, store, model_path: Path, conv: EncoderConvention, max_seq_length: int,
                   n: int) -> None:
    """Re-encode `n` passages spread over the corpus and compare them with the index (module doc).

    Raises:
        ValueError: naming the worst row, the measured difference and the flags to check.
    """
    from .encoder import TextEncoder
    from .shards import describe_faiss

    rows = np.unique(np.linspace(0, index.ntotal - 1, min(n, index.ntotal)).astype(np.int64))
    encoder = TextEncoder(model_path, max_seq_length=max_seq_length, convention=conv)
    mine = encoder.encode_passages([store.contents(int(r)) for r in rows])           # [n, d]
    hint = (f"passages re-encoded with the {conv.name} convention (passage prefix "
            f"{conv.passage_prefix!r}, {conv.pooling} pooling, normalize={conv.normalize}, max "
            f"{max_seq_length} tokens)")
    fix = ("the index was built with another model, convention or corpus order: check --model, "
           "--convention, --pooling, --passage-prefix, --normalize/--no-normalize and --max-seq-length "
           "(or skip this check with --verify 0)")
    try:
        stored = np.stack([index.reconstruct(int(r)) for r in rows])                  # [n, d]
    except RuntimeError:  # the type cannot give vectors back (e.g. IVF without a direct map)
        stored = None
    if stored is not None and describe_faiss(index) in ("flat", "hnsw"):
        err = np.linalg.norm(mine - stored, axis=1) / np.maximum(np.linalg.norm(stored, axis=1), 1e-12)
        worst = int(err.argmax())
        if err[worst] > VERIFY_TOLERANCE:
            raise ValueError(f"--verify: {hint} differ from the stored vectors (row {rows[worst]}: relative "
                             f"difference {err[worst]:.3f}, tolerance {VERIFY_TOLERANCE}); {fix}")
        return
    _, found = index.search(mine, 10)                                                 # [n, 10]
    missing = [int(r) for r, f in zip(rows, found) if r not in f]
    if len(missing) > len(rows) // 4:
        raise ValueError(f"--verify: {hint} do not find themselves among their top 10 in the index "
                         f"(rows {missing[:5]}, {len(missing)} of {len(rows)}); {fix}")
