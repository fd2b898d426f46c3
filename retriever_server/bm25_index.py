"""BM25 index: built and stored with bm25s, searched in batches with one sparse product.

Build: bm25s's `Tokenizer` (lowercase, `\\w\\w+` words, English stopwords, PyStemmer English stems)
streams the corpus to token ids; `bm25s.BM25.index` computes the eager score matrix; `BM25.save`
writes it (`DIR/bm25/`), with the tokenizer vocabulary beside it.

Search: bm25s stores S, the BM25 weight of token t in document d, as a sparse matrix with one row
per vocabulary token (CSC over [N docs x V tokens] = CSR over [V x N]). The score of query q is

    score(q, d) = sum_{t in q} S[t, d]          (bm25s `get_scores`, duplicated tokens counted twice)

so for a batch of B queries, scores = Q @ S with Q the [B x V] matrix of query-token counts. scipy
computes that product in C in one call per batch, touching only the posting lists of the query
tokens; bm25s's own `retrieve` loops in Python per query and allocates a dense [N] score vector per
query, which is what would make 1M passages slow. Only documents sharing a token with the query get
a score, so a query with no known token returns no documents (upstream BM25 also returns fewer hits
than asked when fewer match).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np
import scipy.sparse as sp

SUBDIR = "bm25"
TERM_MAX = "term_max.npy"   # [V] float32: the largest weight in each token's posting list
QUERY_VOCAB = "query_vocab.json"  # stem -> token id, all a query needs (see `query_vocab`)
TOKEN_PATTERN = r"(?u)\b\w\w+\b"
DEFAULT_PARAMS = {"k1": 1.5, "b": 0.75, "method": "lucene", "stemmer": "english", "stopwords": "en"}


def _stemmer(language: str | None):
    if not language:
        return None
    import Stemmer  # PyStemmer
    return Stemmer.Stemmer(language)


def build_bm25(docs: Iterable[tuple[str, str]], out_dir: str | Path, n_docs: int | None = None,
               k1: float = 1.5, b: float = 0.75, method: str = "lucene",
               stemmer: str | None = "english", stopwords: str | None = "en") -> dict:
    """Tokenize `docs` ((id, contents) pairs, streamed) and save a bm25s index to `out_dir/bm25`.

    Returns the build parameters for the manifest.
    """
    import bm25s
    from tqdm.auto import tqdm

    tokenizer = bm25s.tokenization.Tokenizer(splitter=TOKEN_PATTERN, stopwords=stopwords,
                                             stemmer=_stemmer(stemmer))
    texts = (contents for _, contents in tqdm(docs, total=n_docs, desc="bm25: tokenize", unit="doc"))
    corpus_ids = list(tokenizer.streaming_tokenize(texts, update_vocab=True))
    vocab = tokenizer.get_vocab_dict()
    model = bm25s.BM25(k1=k1, b=b, method=method)
    model.index((corpus_ids, vocab), show_progress=True)
    del corpus_ids
    save_dir = Path(out_dir) / SUBDIR
    model.save(save_dir, show_progress=False)
    tokenizer.save_vocab(save_dir)
    tokenizer.save_stopwords(save_dir)
    (save_dir / QUERY_VOCAB).write_text(json.dumps(query_vocab(tokenizer), ensure_ascii=False),
                                        encoding="utf-8")
    data, indices, indptr = model.scores["data"], model.scores["indices"], model.scores["indptr"]
    np.save(save_dir / TERM_MAX, term_max_scores(data, indptr))
    return {"sorted_postings": postings_sorted(indices, indptr),
            "k1": k1, "b": b, "method": method, "stemmer": stemmer, "stopwords": stopwords,
            "token_pattern": TOKEN_PATTERN, "vocab_size": len(vocab),
            "nnz": int(model.scores["data"].shape[0])}


def term_max_scores(data: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """ub[t] = max_d S[t, d] over token t's posting list (0 for an empty list); [V] float32."""
    lengths = np.diff(indptr)
    ub = np.zeros(len(lengths), dtype=np.float32)
    nonempty = lengths > 0
    if len(data):
        ub[nonempty] = np.maximum.reduceat(data, indptr[:-1][nonempty])
    return ub


def postings_sorted(indices: np.ndarray, indptr: np.ndarray) -> bool:
    """True when every posting list holds strictly increasing doc ids (needed by the pruned search)."""
    steps = np.diff(indices.astype(np.int64)) > 0
    boundaries = indptr[1:-1] - 1          # the step from one list's last entry to the next list
    steps[boundaries[(boundaries >= 0) & (boundaries < len(steps))]] = True
    return bool(steps.all())


def _union_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted union of two sorted int arrays (np.union1d's hashing is slow on small inputs)."""
    if len(a) == 0:
        return b
    c = np.concatenate((a, b))
    c.sort(kind="stable")
    keep = np.empty(len(c), dtype=bool)
    keep[0] = True
    np.not_equal(c[1:], c[:-1], out=keep[1:])
    return c[keep]


def query_vocab(tokenizer) -> dict[str, int]:
    """The one mapping a query needs: stem -> token id (word -> token id without a stemmer).

    bm25s's tokenizer keeps three dictionaries (word->stem, stem->id, word->id); with a stemmer,
    word->id[w] is always stem->id[stem(w)], so a server needs only the stem one, a third of the
    memory on a 1M-passage vocabulary.
    """
    return tokenizer.stem_to_sid if tokenizer.stemmer is not None else tokenizer.word_to_id


class QueryTokenizer:
    """Maps query text to index token ids exactly as bm25s's Tokenizer maps documents, read-only.

    bm25s's `Tokenizer.tokenize(update_vocab=False)` still records every unseen query word in its
    dictionaries, so a long-running server would grow without bound on arbitrary queries; this
    class only reads the saved vocabulary (QUERY_VOCAB, written at build time) and keeps a bounded
    stem cache.
    """

    def __init__(self, save_dir: str | Path, stemmer: str | None, cache_size: int = 100_000):
        save_dir = Path(save_dir)
        stem = _stemmer(stemmer)
        if not (save_dir / QUERY_VOCAB).exists():
            raise ValueError(f"{save_dir} has no {QUERY_VOCAB}: the BM25 index was built by an older "
                             "version of this project; rebuild it with `python -m retriever_server build "
                             "--corpus CORPUS.jsonl --kind bm25 --out DIR`")
        self._vocab: dict[str, int] = json.loads((save_dir / QUERY_VOCAB).read_text(encoding="utf-8"))
        stopwords = json.loads((save_dir / "stopwords.tokenizer.json").read_text(encoding="utf-8"))
        self._stop = frozenset(stopwords or ())
        self._split = re.compile(TOKEN_PATTERN).findall
        self._stem = lru_cache(maxsize=cache_size)(stem.stemWord) if stem else None

    def ids(self, text: str) -> list[int]:
        out = []
        vocab, stop, stem = self._vocab, self._stop, self._stem
        for word in self._split(text.lower()):
            if word in stop:
                continue
            tid = vocab.get(stem(word) if stem else word)
            if tid is not None:
                out.append(tid)
        return out


def top_k_rows(matrix: sp.csr_matrix, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of a sparse score matrix [B x N], the k best columns by score, best first.

    Returns B pairs (cols int64 [<=k], scores float32 [<=k]); rows with fewer than k stored entries
    return all of them. Ties are broken by column id (ascending) so results are deterministic.
    """
    out = []
    indptr, indices, data = matrix.indptr, matrix.indices, matrix.data
    for i in range(matrix.shape[0]):
        a, b = indptr[i], indptr[i + 1]
        s, c = data[a:b], indices[a:b]
        if b - a > k:
            # argpartition finds a superset of the top k in O(n); only those k are sorted.
            part = np.argpartition(-s, k - 1)[:k]
            s, c = s[part], c[part]
        order = np.lexsort((c, -s))
        out.append((c[order].astype(np.int64), s[order].astype(np.float32)))
    return out


class BM25Searcher:
    """Batched BM25 search over an index directory built by `build_bm25`.

    Exact top-k with safe pruning (the MaxScore idea, vectorized per query): query tokens are taken
    rarest first; documents of their posting lists become candidates C and get their full score
    (every query token is looked up in C by binary search in its sorted posting list). With theta
    the k-th best candidate score and ub[t] the largest weight of token t, a document holding none
    of the tokens taken so far scores at most bound = sum(ub of the tokens not yet taken); once
    bound < theta the candidates' top k is exact. A later token's posting list only contributes the
    documents whose weight w satisfies count * w + bound >= theta (the others cannot reach the top k).
    Entity queries (a rare name + common words) touch a few hundred postings instead of the common
    words' long lists.
    Queries the bound cannot settle within `max_candidates` go through the exhaustive sparse
    product Q @ S, batched.
    """

    kind = "bm25"

    def __init__(self, index_dir: str | Path, params: dict, mmap: bool = True,
                 max_candidates: int = 20_000):
        import bm25s
        save_dir = Path(index_dir) / SUBDIR
        model = bm25s.BM25.load(save_dir, mmap=mmap, load_vocab=False, show_progress=False)
        scores = model.scores
        self.n_docs = int(scores["num_docs"])
        data, indices, indptr = scores["data"], scores["indices"], scores["indptr"]
        # scipy upcasts both index arrays when their dtypes differ, which would copy the (large,
        # memory-mapped) `indices`; cast the small `indptr` [V+1] instead.
        if indptr.dtype != indices.dtype and indptr[-1] < np.iinfo(indices.dtype).max:
            indptr = np.asarray(indptr, dtype=indices.dtype)
        # Plain ndarray views of the memory maps: same pages, without np.memmap's per-slice
        # Python overhead, which dominated the pruned search's small slices.
        self.data, self.indices = data.view(np.ndarray), indices.view(np.ndarray)
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.n_vocab = len(indptr) - 1
        self.matrix = sp.csr_matrix((self.data, self.indices, indptr), shape=(self.n_vocab, self.n_docs),
                                    copy=False)
        self.tokenizer = QueryTokenizer(save_dir, params.get("stemmer"))
        self.prune = bool(params.get("sorted_postings")) and (save_dir / TERM_MAX).exists()
        self.term_max = np.load(save_dir / TERM_MAX) if self.prune else None
        self.max_candidates = max_candidates

    def query_matrix(self, token_ids: list[list[int]]) -> sp.csr_matrix:
        """Q [B x V]: Q[i, t] = how often index token t occurs in query i."""
        rows = [i for i, ids in enumerate(token_ids) for _ in ids]
        cols = [t for ids in token_ids for t in ids]
        ones = np.ones(len(cols), dtype=self.matrix.dtype)
        # COO -> CSR sums repeated (row, token) pairs into counts.
        return sp.coo_matrix((ones, (rows, cols)), shape=(len(token_ids), self.n_vocab)).tocsr()

    def search_exhaustive(self, token_ids: list[list[int]], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        scores = self.query_matrix(token_ids) @ self.matrix  # [B x V] @ [V x N] -> [B x N] sparse
        return top_k_rows(scores.tocsr(), k)

    def _full_scores(self, cand: np.ndarray, terms, counts, starts, ends) -> np.ndarray:
        """score(q, d) for every d in `cand` (sorted doc ids) -> [|cand|] float32."""
        total = np.zeros(len(cand), dtype=np.float32)
        for t_count, a, b in zip(counts, starts, ends):
            if a == b:
                continue
            post = self.indices[a:b]
            pos = post.searchsorted(cand)
            pos[pos == b - a] = b - a - 1
            weight = self.data[a:b][pos]
            weight[post[pos] != cand] = 0.0
            total += weight if t_count == 1 else weight * t_count
        return total

    def search_pruned(self, ids: list[int], k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Exact top-k for one query, or None when pruning cannot settle it cheaply."""
        if not ids:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        # Small Python structures here: numpy's per-call overhead would dominate 3-10 query tokens.
        counts_by_term = Counter(ids)
        indptr = self.indptr
        spans = sorted((int(indptr[t + 1] - indptr[t]), t) for t in counts_by_term)  # rarest first
        terms = [t for _, t in spans]
        counts = [counts_by_term[t] for t in terms]
        starts = [int(indptr[t]) for t in terms]
        ends = [a + n for a, (n, _) in zip(starts, spans)]
        ub = [float(self.term_max[t]) * c for t, c in zip(terms, counts)]
        bound_after = [sum(ub[j + 1:]) for j in range(len(ub))]
        cand = np.zeros(0, dtype=self.indices.dtype)
        theta = -np.inf
        for j in range(len(terms)):
            post = self.indices[starts[j]:ends[j]]
            if theta > -np.inf:
                # A document first met here holds none of the rarer tokens (those it holds were
                # filtered below theta already), so it scores at most count * w + bound_after[j].
                post = post[self.data[starts[j]:ends[j]] * counts[j] >= theta - bound_after[j]]
            cand = _union_sorted(cand, post)
            if len(cand) > self.max_candidates:
                return None
            last = j == len(terms) - 1
            if len(cand) < k and not last:
                continue
            scores = self._full_scores(cand, terms, counts, starts, ends)
            if len(cand) >= k:
                theta = float(np.partition(scores, len(scores) - k)[len(scores) - k])
            if last or bound_after[j] < theta:
                take = np.lexsort((cand, -scores))[:k]
                return cand[take].astype(np.int64), scores[take]
        return None

    def search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-k (rows, scores) per query, best first."""
        token_ids = [self.tokenizer.ids(q) for q in queries]
        out: list = [None] * len(queries)
        if self.prune:
            for i, ids in enumerate(token_ids):
                out[i] = self.search_pruned(ids, k)
        rest = [i for i, hit in enumerate(out) if hit is None]
        if rest:
            for i, hit in zip(rest, self.search_exhaustive([token_ids[i] for i in rest], k)):
                out[i] = hit
        return out
