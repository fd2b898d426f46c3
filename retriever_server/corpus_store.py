"""Memory-mapped document store: the corpus the indexes point into, without a dict per document.

Layout of a store directory (written once by `CorpusWriter`, read by `DocStore`):

    contents.bin          utf-8 `contents` of every document, concatenated in row order
    contents_offsets.npy  int64 [N+1]; document r is contents.bin[off[r]:off[r+1]]
    ids.bin               utf-8 ids, concatenated in row order
    ids_offsets.npy       int64 [N+1]
    id_hash.npy           uint64 [N], 64-bit blake2b of each id, sorted ascending
    id_hash_rows.npy      int64 [N], the row of each entry of id_hash.npy

`import` references a jsonl corpus in place instead (`JsonlStore`: line offsets and id hashes only,
documents parsed from the file on access), so a 14 GB wiki-18.jsonl is not copied.

Everything is opened with mmap, so a server's private memory does not grow with the corpus; the
page cache holds what is hot and is shared between processes serving the same index. Looking an id
up is a binary search over the sorted hashes followed by a check of the stored id (collisions are
resolved by that check, so they cost a few comparisons and never a wrong answer).
"""
from __future__ import annotations

import hashlib
import json
import mmap
from array import array
from pathlib import Path
from typing import Iterator

import numpy as np

try:  # orjson parses a 1M-line corpus about 3x faster than json; fall back when it is missing.
    import orjson as _fastjson

    def _loads(line: bytes):
        return _fastjson.loads(line)
except ImportError:  # pragma: no cover - depends on the environment
    def _loads(line: bytes):
        return json.loads(line)


def id_hash(doc_id: str) -> int:
    """64-bit hash of a document id (stable across processes and Python versions)."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")


def parse_record(line: bytes, row: int, where: str) -> tuple[str, str]:
    """`(id, contents)` of one jsonl line (see `iter_corpus`); `where` names the file and line."""
    try:
        rec = _loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e}); expected one "
                         '{"id": ..., "contents": ...} object per line') from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    contents = rec.get("contents")
    if contents is None and ("text" in rec or "title" in rec):
        contents = f"\"{rec.get('title', '')}\"\n{rec.get('text', '')}"
    if not isinstance(contents, str):
        raise ValueError(f"{where}: field 'contents' must be a string "
                         f"(or give 'title' and 'text'); got {contents!r:.80}")
    return str(rec.get("id", row)), contents


def iter_corpus(path: str | Path) -> Iterator[tuple[str, str]]:
    """Yield `(id, contents)` from a jsonl corpus in the wiki-18 format upstream Search-R1 uses.

    Lines are `{"id": str, "contents": "\"Title\"\\ntext"}`. A line without `contents` but with
    `title`/`text` is converted to that form; a line without `id` gets its 0-based row number.
    Blank lines are skipped (they are not rows).

    Raises:
        ValueError: naming the file and line when a line is not a JSON object or has no text.
    """
    path = Path(path)
    with open(path, "rb") as f:
        row = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield parse_record(line, row, f"{path}:{lineno}")
            row += 1


class CorpusWriter:
    """Streams documents into a store directory; `close()` writes the offset and id-hash arrays."""

    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._contents = open(self.dir / "contents.bin", "wb")
        self._ids = open(self.dir / "ids.bin", "wb")
        self._c_off = array("q", [0])
        self._i_off = array("q", [0])
        self._hashes = array("Q")

    def add(self, doc_id: str, contents: str) -> None:
        c = contents.encode("utf-8")
        i = doc_id.encode("utf-8")
        self._contents.write(c)
        self._ids.write(i)
        self._c_off.append(self._c_off[-1] + len(c))
        self._i_off.append(self._i_off[-1] + len(i))
        self._hashes.append(int.from_bytes(hashlib.blake2b(i, digest_size=8).digest(), "little"))

    def __len__(self) -> int:
        return len(self._hashes)

    def close(self) -> int:
        """Finish the store; returns the number of documents.

        Raises:
            ValueError: when the corpus is empty or two documents share an id.
        """
        self._contents.close()
        self._ids.close()
        n = len(self._hashes)
        if n == 0:
            raise ValueError("the corpus has no documents; give a jsonl file with one "
                             '{"id": ..., "contents": ...} object per line')
        c_off = np.frombuffer(self._c_off, dtype=np.int64)
        i_off = np.frombuffer(self._i_off, dtype=np.int64)
        hashes = np.frombuffer(self._hashes, dtype=np.uint64)
        order = np.argsort(hashes, kind="stable")
        sorted_hashes = hashes[order]
        np.save(self.dir / "contents_offsets.npy", c_off)
        np.save(self.dir / "ids_offsets.npy", i_off)
        np.save(self.dir / "id_hash.npy", sorted_hashes)
        np.save(self.dir / "id_hash_rows.npy", order.astype(np.int64))
        self._check_unique_ids(sorted_hashes, order)
        return n

    def _check_unique_ids(self, sorted_hashes: np.ndarray, order: np.ndarray) -> None:
        if not np.any(sorted_hashes[1:] == sorted_hashes[:-1]):
            return
        store = DocStore(self.dir)
        try:
            _check_unique(store, sorted_hashes, order)
        finally:
            store.close()


def _mmap_file(path: Path) -> mmap.mmap | bytes:
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return b""  # mmap cannot map an empty file (a corpus of empty strings)
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class DocStore:
    """Read-only, memory-mapped view of a store directory written by `CorpusWriter`."""

    def __init__(self, store_dir: str | Path):
        self.dir = Path(store_dir)
        if not (self.dir / "contents_offsets.npy").exists():
            raise FileNotFoundError(f"{self.dir} is not a document store (no contents_offsets.npy); "
                                    "build the index with `python -m retriever_server build`")
        self._contents = _mmap_file(self.dir / "contents.bin")
        self._ids = _mmap_file(self.dir / "ids.bin")
        self._c_off = np.load(self.dir / "contents_offsets.npy", mmap_mode="r")
        self._i_off = np.load(self.dir / "ids_offsets.npy", mmap_mode="r")
        self._hash = np.load(self.dir / "id_hash.npy", mmap_mode="r")
        self._hash_rows = np.load(self.dir / "id_hash_rows.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self._c_off) - 1

    def contents(self, row: int) -> str:
        return self._contents[int(self._c_off[row]):int(self._c_off[row + 1])].decode("utf-8")

    def doc_id(self, row: int) -> str:
        return self._ids[int(self._i_off[row]):int(self._i_off[row + 1])].decode("utf-8")

    def document(self, row: int) -> dict:
        """The document at `row` as upstream returns it: `{"id": str, "contents": str}`."""
        return {"id": self.doc_id(row), "contents": self.contents(row)}

    def row_of(self, doc_id: str) -> int | None:
        """Row of the document with this id, or None when the corpus has no such id."""
        h = np.uint64(id_hash(doc_id))
        lo = int(np.searchsorted(self._hash, h, side="left"))
        while lo < len(self._hash) and self._hash[lo] == h:
            row = int(self._hash_rows[lo])
            if self.doc_id(row) == doc_id:
                return row
            lo += 1
        return None

    def close(self) -> None:
        for m in (self._contents, self._ids):
            if isinstance(m, mmap.mmap):
                m.close()


def build_store(corpus_path: str | Path, out_dir: str | Path) -> Iterator[tuple[str, str]]:
    """Write the store while yielding `(id, contents)`, so an index builder reads the corpus once.

    The store is finalised when the generator is exhausted (and raises there on empty corpora or
    duplicate ids).
    """
    writer = CorpusWriter(out_dir)
    for doc_id, contents in iter_corpus(corpus_path):
        writer.add(doc_id, contents)
        yield doc_id, contents
    writer.close()


# ---------------------------------------------------------------- a jsonl corpus referenced in place

SOURCE_JSON = "source.json"   # the referenced jsonl: path, size, mtime_ns, sha256
LINE_STARTS = "line_starts.npy"


def write_jsonl_refs(corpus_path: str | Path, out_dir: str | Path, block: int = 16 << 20) -> tuple[int, str]:
    """Index a jsonl corpus where it lies (`import`): the byte offset of every row's line and the
    sorted id hashes, in one pass that also computes the file's sha256. Returns (rows, sha256).

    For wiki-18 (21M passages, ~14 GB) this writes ~500 MB (three int64/uint64 arrays of N) instead
    of a second copy of the text. `JsonlStore` reads documents from the file itself.

    Raises:
        ValueError: for an empty corpus, a malformed line (file and line named) or duplicate ids.
    """
    from tqdm.auto import tqdm

    corpus_path, out = Path(corpus_path).resolve(), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stat = corpus_path.stat()
    sha = hashlib.sha256()
    starts, hashes = array("q"), array("Q")
    pos, lineno, carry = 0, 0, b""
    bar = tqdm(total=stat.st_size, desc="import: index corpus lines", unit="B", unit_scale=True)
    with open(corpus_path, "rb") as f:
        while True:
            data = f.read(block)
            sha.update(data)
            bar.update(len(data))
            offset = pos - len(carry)              # file offset of buf[0]
            lines = (carry + data).split(b"\n")
            carry = lines.pop() if data else b""   # an unterminated last line waits for more data
            for line in lines:
                lineno += 1
                if line.strip():
                    doc_id, _ = parse_record(line, len(starts), f"{corpus_path}:{lineno}")
                    starts.append(offset)
                    hashes.append(int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8)
                                                 .digest(), "little"))
                offset += len(line) + 1
            pos += len(data)
            if not data:
                break
    bar.close()
    n = len(starts)
    if n == 0:
        raise ValueError(f"{corpus_path}: the corpus has no documents; give a jsonl file with one "
                         '{"id": ..., "contents": ...} object per line')
    hashes_np = np.frombuffer(hashes, dtype=np.uint64)
    order = np.argsort(hashes_np, kind="stable")
    np.save(out / LINE_STARTS, np.frombuffer(starts, dtype=np.int64))
    np.save(out / "id_hash.npy", hashes_np[order])
    np.save(out / "id_hash_rows.npy", order.astype(np.int64))
    digest = sha.hexdigest()
    (out / SOURCE_JSON).write_text(json.dumps({"path": str(corpus_path), "size": stat.st_size,
                                               "mtime_ns": stat.st_mtime_ns, "sha256": digest}, indent=2))
    store = JsonlStore(out)
    try:
        _check_unique(store, hashes_np[order], order)
    finally:
        store.close()
    return n, digest


def _check_unique(store, sorted_hashes: np.ndarray, order: np.ndarray) -> None:
    same = np.nonzero(sorted_hashes[1:] == sorted_hashes[:-1])[0]
    dups = [a for j in same[:1000]
            if (a := store.doc_id(int(order[j]))) == store.doc_id(int(order[j + 1]))]
    if dups:
        raise ValueError(f"the corpus has duplicate document ids (e.g. {dups[:5]}); "
                         "ids must be unique so that /access can return one document per id")


class JsonlStore:
    """Documents read from the referenced jsonl file (memory-mapped) by row: the `DocStore` interface
    over `write_jsonl_refs`' arrays. A document costs one JSON parse of its line (a few us)."""

    def __init__(self, store_dir: str | Path):
        self.dir = Path(store_dir)
        src = json.loads((self.dir / SOURCE_JSON).read_text())
        self.path = Path(src["path"])
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.dir}: the corpus {self.path} it references is gone; put it back "
                                    "or re-run `python -m retriever_server import`")
        stat = self.path.stat()
        if (stat.st_size, stat.st_mtime_ns) != (src["size"], src["mtime_ns"]):
            raise ValueError(f"{self.path} changed since it was imported (size {src['size']} -> {stat.st_size} "
                             "bytes or a new modification time); its rows may no longer match the index: "
                             "re-run `python -m retriever_server import`")
        self._mm = _mmap_file(self.path)
        self._starts = np.load(self.dir / LINE_STARTS, mmap_mode="r")
        self._hash = np.load(self.dir / "id_hash.npy", mmap_mode="r")
        self._hash_rows = np.load(self.dir / "id_hash_rows.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self._starts)

    def _line(self, row: int) -> bytes:
        start = int(self._starts[row])
        end = self._mm.find(b"\n", start)
        return self._mm[start:end if end >= 0 else len(self._mm)]

    def document(self, row: int) -> dict:
        doc_id, contents = parse_record(self._line(row), row, f"{self.path} row {row}")
        return {"id": doc_id, "contents": contents}

    def contents(self, row: int) -> str:
        return self.document(row)["contents"]

    def doc_id(self, row: int) -> str:
        return self.document(row)["id"]

    row_of = DocStore.row_of

    def close(self) -> None:
        if isinstance(self._mm, mmap.mmap):
            self._mm.close()


def open_store(store_dir: str | Path):
    """The store of an index: a `JsonlStore` for an imported corpus, else a `DocStore`."""
    store_dir = Path(store_dir)
    return JsonlStore(store_dir) if (store_dir / SOURCE_JSON).exists() else DocStore(store_dir)
