"""Hybrid retrieval: reciprocal-rank fusion (RRF) of a BM25 and a dense ranking.

RRF (Cormack, Clarke, Buettcher, SIGIR 2009):

    rrf(d) = sum_{rankings r containing d} 1 / (k + rank_r(d))      rank starts at 1, k default 60

Scores of the two retrievers live on different scales (BM25 unbounded, cosine in [-1, 1]); ranks
do not, which is why fusion uses ranks only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def rrf_fuse(rankings: Sequence[Sequence[int]], k: float = 60.0, topk: int | None = None
             ) -> list[tuple[int, float]]:
    """Fuse rankings (each a list of doc rows, best first) into [(row, rrf score)], best first.

    Ties (equal fused score) keep the order in which documents were first met, scanning the
    rankings rank by rank (rank 1 of every ranking, then rank 2, ...), so the result is
    deterministic and favours documents that appear early anywhere.
    """
    if k < 0:
        raise ValueError(f"rrf k={k}; it must be >= 0 (60 is the usual value)")
    score: dict[int, float] = {}
    first_seen: dict[int, int] = {}
    depth = max((len(r) for r in rankings), default=0)
    for rank in range(depth):
        for ranking in rankings:
            if rank < len(ranking):
                doc = int(ranking[rank])
                score[doc] = score.get(doc, 0.0) + 1.0 / (k + rank + 1)
                first_seen.setdefault(doc, len(first_seen))
    fused = sorted(score.items(), key=lambda item: (-item[1], first_seen[item[0]]))
    return fused[:topk] if topk is not None else fused


class HybridSearcher:
    """Runs both searchers on the batch, fetches `depth` candidates from each, fuses per query."""

    kind = "hybrid"

    def __init__(self, searchers: Sequence, rrf_k: float = 60.0, depth: int = 50):
        if rrf_k < 0 or depth < 1:
            raise ValueError(f"--rrf-k {rrf_k} / --rrf-depth {depth}: need rrf_k >= 0 (60 is usual) "
                             "and depth >= 1")
        self.searchers = list(searchers)
        self.rrf_k = rrf_k
        self.depth = depth
        self.n_docs = self.searchers[0].n_docs

    def search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        depth = max(k, self.depth)
        per_searcher = [s.search(queries, depth) for s in self.searchers]
        out = []
        for i in range(len(queries)):
            fused = rrf_fuse([res[i][0] for res in per_searcher], self.rrf_k, topk=k)
            out.append((np.array([d for d, _ in fused], dtype=np.int64),
                        np.array([s for _, s in fused], dtype=np.float32)))
        return out
