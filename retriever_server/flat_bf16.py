"""Exact inner-product top-k over a Flat index, screened with bf16 matrix products.

On CPUs with native bf16 matrix units (Intel AMX, AVX512-BF16) a bf16 matrix product runs ~6x faster
than the fp32 one faiss's Flat search uses; at 100k passages that search otherwise costs a third of
an int8 query encoder's time. Rounding to bf16 moves each score by at most `eps`, so the bf16 scores
only pick candidates; the answer comes from exact fp32 scores, with a certificate:

    S  = bf16(Q) @ bf16(X)^T                          [b, N]   (fp32 accumulation, bf16 output;
                                                               computed as X @ Q^T, [N, b])
    g  = max of S over groups of G rows               [b, N/G]
    C  = the rows of the c = k + margin best groups, then their c best rows by S
    out = top-k of the exact fp32 scores Q @ X[C]^T
    exact iff  out's k-th score > T + eps,  T = the c-th best bf16 score in C

Every row outside C has a bf16 score <= T (a row of an unpicked group is below the c picked groups'
maxima, all of which are in the candidate pool), hence an exact score <= T + eps; when the k-th exact
score clears that bound no row outside C can beat it. Rows whose certificate fails (near-ties around
the k-th score) are flagged for an exact fp32 search by the caller.

The error bound, for bf16 unit roundoff u = 2^-8 (round-to-nearest: |err| <= u/2 per rounding):
each input is rounded once, each product is off by <= (u + u^2/4)|q_i x_i|, summed <= 1.01 u ||q|| ||x||
(Cauchy-Schwarz), plus the output rounding u/2 |s| <= u/2 ||q|| ||x||, plus fp32 accumulation
(<= d 2^-24 ||q|| ||x||, doubled for slack): eps = (1.6 u + d 2^-23) ||q|| max||x||. Measured over
64 queries x 102k MiniLM passages, the largest error was 0.0022, 35% of this eps (0.0063).
"""
from __future__ import annotations

import numpy as np

BF16_UNIT_ROUNDOFF = 2.0 ** -8
GROUP = 16                 # rows per group in the screening max (16: the pool stays small for small k)
SCORE_BUDGET_BYTES = 64 << 20  # bf16 score matrix per query slice: bounds memory for large corpora


class Bf16FlatScreen:
    """Exact inner-product top-k over the fp32 rows `x` [N, d], screened in bf16 (see module doc)."""

    def __init__(self, x: np.ndarray, margin: int = 32):
        import torch
        if x.ndim != 2 or x.dtype != np.float32:
            raise ValueError(f"Bf16FlatScreen needs a float32 [N, d] matrix, got {x.dtype} {x.shape}")
        if margin < 1:  # the c-th candidate would be the k-th itself: no row could ever be certified
            raise ValueError(f"margin={margin}; need margin >= 1 (extra candidates beyond k)")
        self.n, self.dim = x.shape
        self.margin = margin
        self.x = torch.from_numpy(x)                                     # [N, d] fp32, shared, not copied
        pad = -self.n % GROUP
        xb = torch.zeros((self.n + pad, self.dim), dtype=torch.bfloat16)  # [N_pad, d]; zero rows masked below
        xb[:self.n] = self.x.to(torch.bfloat16)
        self.xb = xb
        self.max_norm = float(np.linalg.norm(x, axis=1).max()) if self.n else 0.0

    @property
    def nbytes(self) -> int:
        return self.xb.numel() * 2

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q [B, d] float32 -> (scores [B, k'] float32, ids [B, k'] int64, certified [B] bool), k' = min(k, N),
        scores descending. Rows with certified=False may miss a true top-k row: search them exactly."""
        import torch
        k = min(k, self.n)
        b_all = q.shape[0]
        scores = np.empty((b_all, k), np.float32)
        ids = np.empty((b_all, k), np.int64)
        ok = np.empty(b_all, bool)
        step = max(1, SCORE_BUDGET_BYTES // (2 * self.xb.shape[0]))
        qt = torch.from_numpy(np.require(q, np.float32, ["C", "W"]))  # copies read-only arrays (Ray's)
        with torch.inference_mode():
            for start in range(0, b_all, step):
                s, i, c = self._search_slice(qt[start:start + step], k)
                scores[start:start + step], ids[start:start + step], ok[start:start + step] = s, i, c
        return scores, ids, ok

    def _search_slice(self, q, k: int):
        import torch
        b = q.shape[0]
        n_groups = self.xb.shape[0] // GROUP
        # X @ Q^T, not Q @ X^T: oneDNN runs the [N, d] x [d, b] product ~2x faster at b = 64.
        st = self.xb @ q.to(torch.bfloat16).T                             # [N_pad, b] bf16
        st[self.n:] = float("-inf")                                       # padding rows never win
        c = min(self.n, k + self.margin)
        g = min(n_groups, c)
        # Group j = rows {j, j + n_groups, j + 2 n_groups, ...}: the max over the G slices of
        # n_groups rows is an element-wise max of contiguous memory, 6x faster than over adjacent rows.
        group_max = st.view(GROUP, n_groups, b).amax(0).T                                  # [b, n_groups]
        top_groups = group_max.topk(g, dim=1).indices                                      # [b, g]
        pool = (top_groups.unsqueeze(-1) + n_groups * torch.arange(GROUP)).reshape(b, -1)  # [b, g*G]
        pool_s, pos = st.T.gather(1, pool).topk(c, dim=1)                                  # [b, c] bf16
        cand = pool.gather(1, pos)                                                         # [b, c] row ids
        exact = torch.einsum("bd,bcd->bc", q, self.x[cand])                                # [b, c] fp32
        top_s, j = exact.topk(k, dim=1)                                                    # [b, k]
        top_i = cand.gather(1, j)
        if c == self.n:          # every row was scored exactly
            certified = torch.ones(b, dtype=torch.bool)
        else:
            eps = (1.6 * BF16_UNIT_ROUNDOFF + self.dim * 2.0 ** -23) * q.norm(dim=1) * self.max_norm  # [b]
            certified = top_s[:, -1] > pool_s[:, -1].float() + eps
        return top_s.numpy(), top_i.numpy(), certified.numpy()
