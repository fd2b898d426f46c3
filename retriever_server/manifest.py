"""The index manifest: what an index directory holds and how it was built.

Every index directory has `manifest.json`; the server reads it to pick the index kind and to check
that a BM25 and a dense index given together were built over the same corpus (hybrid fusion works
on row numbers, so the rows must mean the same documents).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
KINDS = ("bm25", "dense")
MANIFEST = "manifest.json"
STORE_SUBDIR = "docs"


@dataclass
class Manifest:
    kind: str                       # "bm25" | "dense"
    corpus_path: str                # the jsonl the index was built from (informational)
    corpus_size: int                # number of documents = rows of the store
    corpus_sha256: str              # fingerprint of the corpus file; equal for fusable indexes
    params: dict = field(default_factory=dict)   # kind-specific build parameters
    build_seconds: float = 0.0
    built_at: str = ""
    format_version: int = FORMAT_VERSION

    def write(self, index_dir: str | Path) -> None:
        path = Path(index_dir) / MANIFEST
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)  # the manifest appears last and atomically: its presence = index complete


def publish_index(tmp: Path, out: Path) -> None:
    """Move the finished index directory `tmp` to `out`, replacing an index there.

    The old index is renamed aside, not deleted, until the new one is in place (and put back if the
    move fails), so a crash or a failed rename never leaves the user with no index at all.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_manifest(index_dir: str | Path) -> Manifest:
    """Read `DIR/manifest.json`.

    Raises:
        FileNotFoundError / ValueError: naming the directory and how to build an index there.
    """
    path = Path(index_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(
            f"{index_dir} is not an index directory (no {MANIFEST}); build one with "
            f"`python -m retriever_server build --corpus corpus.jsonl --kind bm25 --out {index_dir}`")
    data = json.loads(path.read_text())
    if data.get("kind") not in KINDS:
        raise ValueError(f"{path}: kind={data.get('kind')!r}; allowed kinds are {list(KINDS)}")
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version={data.get('format_version')!r}, this server reads "
                         f"version {FORMAT_VERSION}; rebuild the index")
    known = set(Manifest.__dataclass_fields__)
    return Manifest(**{k: v for k, v in data.items() if k in known})


def index_matches_corpus(index_dir: str | Path, corpus: str | Path) -> bool:
    """True when `index_dir` holds a readable index built from exactly this corpus file (a corpus
    regenerated since, e.g. with another seed, needs a new index)."""
    try:
        return read_manifest(index_dir).corpus_sha256 == file_sha256(corpus)
    except (FileNotFoundError, ValueError):
        return False


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
