"""Index directories as a library: build one, find or build the default one, check several belong together.

`python -m retriever_server build` and `serve` use these, and so do the evaluation CLI, the agents,
scripts and tests that need an index without going through the command line. An index directory holds
`manifest.json` (manifest.py), the corpus store and the BM25 or faiss files.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def default_synth_dir() -> Path:
    """`$SEARCH_R1_HOME/synth/default` (default home ~/.cache/search-r1), as search_r1.paths says;
    repeated here because the retriever service imports nothing from search_r1."""
    home = Path(os.environ.get("SEARCH_R1_HOME", Path.home() / ".cache" / "search-r1")).expanduser()
    return home / "synth" / "default"


def ensure_default_index() -> Path:
    """Generate the default synthetic world if it is missing, and (re)build its BM25 index unless it
    was built from this corpus.jsonl; returns the index dir."""
    from .manifest import index_matches_corpus

    world = default_synth_dir()
    corpus = world / "corpus.jsonl"
    if not corpus.exists():
        print(f"[retriever] generating the default synthetic corpus in {world} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "search_r1.data.synth", "--out", str(world)], check=True)
    index_dir = world / "index_bm25"
    if not index_matches_corpus(index_dir, corpus):
        print(f"[retriever] building the BM25 index {index_dir} ...", file=sys.stderr)
        build_index(corpus, "bm25", index_dir, force=True)
    return index_dir


def build_index(corpus: Path, kind: str, out: Path, force: bool = False, **kw) -> Path:
    """Build into a temporary sibling directory and rename it into place, so that a crashed or
    concurrent build never leaves a half-written index behind a valid-looking path."""
    from .bm25_index import build_bm25
    from .corpus_store import build_store
    from .dense_index import build_dense
    from .manifest import STORE_SUBDIR, Manifest, file_sha256, now_iso, publish_index

    corpus, out = Path(corpus), Path(out)
    if kind not in ("bm25", "dense"):
        raise ValueError(f"--kind {kind!r}; allowed values are ['bm25', 'dense']")
    if not corpus.is_file():
        raise FileNotFoundError(f"--corpus {corpus}: no such file (a jsonl of "
                                '{"id": ..., "contents": "\\"Title\\"\\ntext"} lines)')
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"--out {out} exists and is not empty; pass --force to replace it")
        if not (out / "manifest.json").exists():
            raise FileExistsError(f"--out {out} is not an index directory (no manifest.json); "
                                  "refusing to delete it, choose another --out")
    t0 = time.time()
    with open(corpus, "rb") as f:
        n_docs = sum(1 for line in f if line.strip())
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        docs = build_store(corpus, tmp / STORE_SUBDIR)
        if kind == "bm25":
            params = build_bm25(docs, tmp, n_docs=n_docs, **kw)
        else:
            params = build_dense(docs, tmp, n_docs=n_docs, **kw)
        Manifest(kind=kind, corpus_path=str(corpus.resolve()), corpus_size=n_docs,
                 corpus_sha256=file_sha256(corpus), params=params,
                 build_seconds=round(time.time() - t0, 2), built_at=now_iso()).write(tmp)
        publish_index(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[retriever] built {kind} index over {n_docs} passages in {time.time() - t0:.1f}s -> {out}",
          file=sys.stderr)
    return out


def check_indexes(index_dirs: list[Path]) -> list:
    """Read the manifests; several indexes must come from the same corpus file (same rows)."""
    from .manifest import read_manifest

    manifests = [read_manifest(d) for d in index_dirs]
    if len({m.corpus_sha256 for m in manifests}) > 1:
        raise ValueError("the --index directories were built from different corpora ("
                         + ", ".join(f"{d}: {m.corpus_path}" for d, m in zip(index_dirs, manifests))
                         + "); hybrid fusion needs the same corpus.jsonl for every index")
    return manifests
