"""GRPO advantages, KL estimators, the PPO-clip policy loss, the LLDS likelihood-preserving term and the
likelihood diagnostics: pure tensor functions.

Shape legend: B prompts, G samples per prompt (group size), N = B * G trajectories, L response
length (tokens), V vocabulary. `mask` / `response_mask` is (N, L), 1 on tokens the policy generated
and 0 on observation tokens (`<information>` passages, corrective messages) and padding, so those
contribute nothing to any loss or statistic.

References: GRPO, Shao et al. 2024 (arXiv 2402.03300) eq. 3 (outcome supervision); PPO, Schulman
et al. 2017 (arXiv 1707.06347) eq. 7; dual-clip PPO, Ye et al. 2019 (arXiv 1912.09729); K3 KL
estimator, J. Schulman, "Approximating KL divergence" (2020); truncated importance sampling of a
sampler that differs from the trainer, Yao et al. 2025 ("Your efficient RL framework secretly brings
you off-policy RL training"); LLDS, Deng et al. 2025 (arXiv 2512.04220, "On GRPO Collapse in
Search-R1: The Lazy Likelihood-Displacement Death Spiral"). The numbers match verl 0.9's `core_algos` (`kl_penalty(...,
"low_var_kl")`, `compute_policy_loss_vanilla`, `agg_loss`) and, with `std="unbiased", eps=1e-6`
(verl's and upstream Search-R1's settings; our default is `population`, eps 1e-8, from the seed
specification), `compute_grpo_outcome_advantage`; tests/search_r1/test_algos.py checks that.

`KL_ESTIMATORS` maps `algorithm.kl_type` names to estimators (`get_kl_estimator`); `AGG_MODES`,
`STD_MODES`, `ROLLOUT_IS_LEVELS` and `LLDS_GATES` list the other names the config selects from. An unknown name
raises ValueError listing the valid ones. (One advantage estimator and one policy loss: the trainer
calls them directly.)
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

STD_MODES = ("population", "unbiased", "none")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean")


def _lookup(registry: dict[str, Any], kind: str, name: str) -> Any:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {sorted(registry)}")
    return registry[name]


# --------------------------------------------------------------------------- masked reductions


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all if None); values under mask 0 are ignored, even NaN/inf."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (x * mask).sum() if dim is None else (x * mask).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over `dim` (all if None); 0 where the mask is empty.

    Shapes: x and mask broadcastable, e.g. (N, L); result () or x reduced over `dim`.
    """
    denom = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / denom.clamp_min(1e-8)


def entropy_from_logits(logits: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum(softmax(z) * z).

    Shapes: (..., V) -> (...). Numerically stable for large logits (no log of a softmax). A -inf logit
    (a masked token) has probability 0 and adds nothing to the sum (0 * -inf would make it NaN); a NaN
    logit still gives NaN. With `lse` (..., the logsumexp of these logits, e.g. from
    `token_log_probs`) it is not computed again and softmax(z) is exp(z - lse): one (..., V)
    temporary; for reports, as it is not differentiated through `lse`.
    """
    # The masked case is repaired only where a row's sum came out NaN (a (...) check), so finite
    # logits pay no extra (..., V) pass; a NaN logit stays NaN through logsumexp.
    if lse is None:
        p = torch.softmax(logits, dim=-1)
        pz = (p * logits).sum(dim=-1)
        if pz.isnan().any():  # masked before the product, not after: its backward would meet 0 * -inf
            pz = (p * logits.masked_fill(torch.isneginf(logits), 0.0)).sum(dim=-1)
        return torch.logsumexp(logits, dim=-1) - pz
    p = (logits - lse.unsqueeze(-1)).exp_()
    prod = p.mul_(logits)  # in place: the report's one (..., V) temporary
    pz = prod.sum(dim=-1)
    if pz.isnan().any():  # NaN in p * z only where p is 0 and z is -inf
        pz = prod.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf")).sum(dim=-1)
    return lse - pz


class _TokenLogProb(torch.autograd.Function):
    """log softmax(z)[target] whose backward builds one (..., V) tensor in place:
    d/dz = g * (onehot(target) - exp(z - lse)). Autograd's gather-minus-logsumexp graph computes the
    same products and sums (bit for bit) through five (..., V) temporaries: the difference, its exp,
    the product, the gather's zero-filled scatter and the sum."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor):
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(logits, targets, lse)
        ctx.mark_non_differentiable(lse)
        return logp, lse

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_lse: torch.Tensor | None):
        logits, targets, lse = ctx.saved_tensors
        grad = (logits - lse.unsqueeze(-1)).exp_()  # softmax(z)
        grad.mul_(-grad_logp.unsqueeze(-1))  # the logsumexp branch: -g * softmax, as autograd orders it
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))  # the gather branch: + g
        return grad, None


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits)[targets] and logsumexp(logits), differentiable in `logits` (the first).

        logp = z[target] - logsumexp(z)        grad_z = g * (onehot(target) - softmax(z))

    Shapes: logits (..., V) float, targets (...) int64 -> logp (...), lse (...) (no gradient; pass
    it to `entropy_from_logits` for a report). Same numbers and gradients as
    `z.gather(-1, t[..., None])[..., 0] - z.logsumexp(-1)`, with a backward that allocates one (..., V)
    tensor instead of five: at a policy's vocabulary (49k) the log-prob's backward is a large share of
    an update on CPU (bench/studies/token_log_probs.py).
    """
    return _TokenLogProb.apply(logits, targets)


# --------------------------------------------------------------------------- advantages


def _group_ids(uids: Any, n: int) -> torch.Tensor:
    """Dense group ids (n,) int64 for `uids`: a tensor, a numpy array or a list of hashables."""
    if isinstance(uids, torch.Tensor):
        if uids.dim() != 1 or uids.numel() != n:
            raise ValueError(f"uids must be 1-D with {n} entries (one per score), got shape {tuple(uids.shape)}")
        return torch.unique(uids, return_inverse=True)[1].reshape(-1)
    if isinstance(uids, np.ndarray) and uids.dtype != object:
        if uids.ndim != 1 or uids.shape[0] != n:
            raise ValueError(f"uids must be 1-D with {n} entries (one per score), got shape {uids.shape}")
        inverse = np.unique(uids, return_inverse=True)[1]
    else:  # lists and object arrays (str uids from DataProto): hash once, first-seen numbering
        items = uids.tolist() if isinstance(uids, np.ndarray) else list(uids)
        if len(items) != n:
            raise ValueError(f"uids must have {n} entries (one per score), got {len(items)}")
        first_seen: dict[Any, int] = {}
        try:
            inverse = np.fromiter((first_seen.setdefault(u, len(first_seen)) for u in items), np.int64, n)
        except TypeError as e:
            raise ValueError(f"uids must be hashable (str/int), got {type(items[0]).__name__}: {e}") from None
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.int64)


def compute_grpo_advantages(
    scores: torch.Tensor | Sequence[float],
    uids: Any,
    eps: float = 1e-8,
    std: str = "population",
) -> torch.Tensor:
    """GRPO outcome advantage per trajectory, normalized within its prompt group.

        A_i = (r_i - mean_g) / (std_g + eps)       for i in group g = uid_i

    `std` = "population" (divide the squared deviations by n; the default, from the seed
    specification), "unbiased" (by n - 1, as verl's torch.std and upstream Search-R1, which use
    eps 1e-6: only with those two settings do the numbers equal verl's) or "none" (A_i = r_i - mean_g, Dr. GRPO, arXiv 2503.20783). A group with one member
    gets A = 0 (no baseline to compare with; verl instead uses mean 0, std 1 there), and a group
    whose scores are all equal gets exactly 0 (tested as max == min, so rounding in the mean cannot
    turn into +-1 through a near-zero std).

    Shapes: scores (N,) float, uids (N,) hashables (B distinct values) -> A (N,) in scores' float
    dtype (float32 for integer input). Vectorized: one unique + scatter pass, no loop over rows.
    """
    if std not in STD_MODES:
        raise ValueError(f"unknown std mode {std!r}; valid: {list(STD_MODES)} (algorithm.grpo_std)")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = torch.as_tensor(scores)
    if not r.is_floating_point():
        r = r.float()
    if r.dim() != 1:
        raise ValueError(f"scores must be 1-D (one scalar per trajectory), got shape {tuple(r.shape)}")
    n = r.shape[0]
    gid = _group_ids(uids, n).to(r.device)  # (N,) in [0, n_groups)
    n_groups = int(gid.max()) + 1 if n else 0

    count = torch.bincount(gid, minlength=n_groups).to(r.dtype)  # (n_groups,)
    mean = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, r) / count
    dev = r - mean[gid]  # (N,)
    gmax = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, gid, r, "amax")
    gmin = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, gid, r, "amin")
    constant = (gmax == gmin)[gid] | (count == 1)[gid]  # (N,) rows whose advantage is 0

    if std == "none":
        adv = dev
    else:
        sq = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, dev * dev)
        dof = count - 1 if std == "unbiased" else count
        group_std = (sq / dof.clamp_min(1)).sqrt()  # (n_groups,)
        adv = dev / (group_std[gid] + eps)
    return torch.where(constant, torch.zeros((), dtype=r.dtype, device=r.device), adv)


def broadcast_to_tokens(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level advantages: every generated token of trajectory i gets A_i.

    Shapes: adv (N,), response_mask (N, L) -> (N, L), zero where the mask is 0.
    """
    if adv.dim() != 1 or response_mask.dim() != 2 or adv.shape[0] != response_mask.shape[0]:
        raise ValueError(f"need adv (N,) and response_mask (N, L); got {tuple(adv.shape)} and {tuple(response_mask.shape)}")
    return adv[:, None] * response_mask.to(adv.dtype)  # (N, 1) * (N, L) -> (N, L)


def leading_token_values(shape: tuple[int, int], counts: Any, lead: float, rest: float) -> torch.Tensor:
    """An (N, L) float32 tensor holding `lead` in the first counts[i] columns of row i, `rest` elsewhere.

    A trajectory's first counts[i] response tokens are its first generation round (its plan and first
    query); this marks them, e.g. for a KL coefficient of their own (algorithm.plan_kl_coef).
    Shapes: shape (N, L), counts (N,) ints in [0, L] -> (N, L).
    """
    n, length = shape
    counts = torch.as_tensor(counts, dtype=torch.long)
    if counts.shape != (n,):
        raise ValueError(f"need x (N, L) and counts (N,); got {tuple(shape)} and {tuple(counts.shape)}")
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > length):
        raise ValueError(f"counts must lie in [0, {length}], got {counts.min().item()}..{counts.max().item()}")
    leading = torch.arange(length)[None, :] < counts[:, None]  # (N, L)
    return torch.where(leading, torch.tensor(float(lead)), torch.tensor(float(rest)))


def zero_leading_tokens(x: torch.Tensor, counts: Any) -> torch.Tensor:
    """A copy of x with the first counts[i] columns of row i set to 0.

    Used to keep a trajectory's first generation round (its plan and first query) out of the
    policy-gradient term: with A = 0 on a token, PPO-clip gives it no gradient, while the KL term,
    which does not read the advantages, still holds it near the reference.

    Shapes: x (N, L), counts (N,) ints in [0, L] -> (N, L).
    """
    if x.dim() != 2:
        raise ValueError(f"need x (N, L) and counts (N,); got {tuple(x.shape)}")
    return x * leading_token_values(tuple(x.shape), counts, lead=0.0, rest=1.0).to(x.dtype)


def signal_group_rows(adv: torch.Tensor, uids: Any, multiple: int = 1) -> torch.Tensor:
    """Rows of the groups that carry a learning signal, for an update that drops flat groups.

    A group is flat when every advantage in it is 0 (all its samples scored alike): its only
    gradient would be the KL term's. Returned: the ascending row indices of every group with a
    non-zero advantage, plus the first flat groups (in row order) needed to make the count a
    multiple of `multiple` (mini-batches x data-parallel workers must divide it; a flat group adds
    only KL to the loss). Empty when no group has a signal. When no subset of whole groups reaches
    a multiple, every row is returned (the full batch divides by construction).

    This is DAPO's group filter (Yu et al. 2025, arXiv 2503.14476, "dynamic sampling") without the
    refill: the step trains on fewer trajectories instead of sampling more.

    Shapes: adv (N,), uids (N,) hashables -> (K,) int64 row indices, K <= N.
    """
    n = adv.shape[0]
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    gid = _group_ids(uids, n)
    n_groups = int(gid.max()) + 1 if n else 0
    signal = torch.zeros(n_groups, dtype=torch.int64).index_add_(0, gid, (adv.cpu() != 0).long()) > 0  # (G,)
    if not bool(signal.any()):
        return torch.zeros(0, dtype=torch.int64)
    size = torch.bincount(gid, minlength=n_groups)
    keep = signal.clone()
    rows = int(size[keep].sum())
    for g in range(n_groups):  # pad with flat groups until the mini-batch split works
        if rows % multiple == 0:
            break
        if not keep[g]:
            keep[g] = True
            rows += int(size[g])
    if rows % multiple:
        keep[:] = True
    return keep[gid].nonzero().flatten()


# --------------------------------------------------------------------------- KL estimators


def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """K1 = logp - ref_logp (unbiased per-token KL(pi || ref) sample, high variance). Shapes (N, L)."""
    return logp - ref_logp


def k2_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """K2 = 0.5 * (logp - ref_logp)^2. Shapes (N, L)."""
    return 0.5 * (logp - ref_logp).square()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float | None = 10.0) -> torch.Tensor:
    """K3 (verl's `low_var_kl`): per-token estimate of KL(pi || ref), always >= 0.

        d = clamp(ref_logp - logp, -20, 20)      (exp stays finite)
        ratio = exp(d) = ref / pi
        k3 = ratio - log(ratio) - 1 = exp(d) - d - 1, then clamped to [-clamp, clamp]

    The clamps are verl's (20 on the log-ratio, 10 on the result); `clamp=None` skips the second.
    Shapes: logp, ref_logp (N, L) -> (N, L).
    """
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    k3 = torch.exp(d) - d - 1
    return k3 if clamp is None else k3.clamp(-clamp, clamp)


KL_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "k1": k1_kl,
    "k2": k2_kl,
    "k3": k3_kl,
    "low_var_kl": k3_kl,  # verl's name for K3
}


def get_kl_estimator(name: str) -> Callable[..., torch.Tensor]:
    """The KL estimator `fn(logp, ref_logp) -> (N, L)` registered as `name`."""
    return _lookup(KL_ESTIMATORS, "KL estimator (algorithm.kl_type)", name)


# --------------------------------------------------------------------------- loss aggregation


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss (N, L) to a scalar over the tokens where `mask` is 1.

        token-mean           sum_{i,t} m l / T                     T = sum(m) (tokens)
        token-sum            sum_{i,t} m l
        seq-mean-token-mean  sum_i [sum_t m l / sum_t m] / S         S = #rows with sum_t m > 0
        seq-mean-token-sum   sum_i [sum_t m l] / S
        seq-mean             alias of seq-mean-token-mean (GRPO paper's per-sequence mean)

    `normalizer` replaces T (token-mean) or S (seq-mean-*) when the loss of a micro-batch must be
    normalized by the count of the whole mini-batch (gradient accumulation) or of all data-parallel
    ranks; verl's `dp_size`/`batch_num_tokens` equal `normalizer = batch_num_tokens / dp_size`.
    Rows with an empty mask count for nothing. Shapes: loss_mat, mask (N, L) -> ().
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {list(AGG_MODES)} (algorithm.loss_agg)")
    if mode == "token-mean":
        denom = mask.sum().clamp_min(1e-8) if normalizer is None else normalizer  # empty mask -> 0, not NaN
        return masked_sum(loss_mat, mask) / denom
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    tokens = mask.sum(dim=-1)  # (N,)
    seq_loss = masked_sum(loss_mat, mask, dim=-1)  # (N,)
    if mode in ("seq-mean-token-mean", "seq-mean"):
        seq_loss = seq_loss / (tokens + 1e-8)  # (N,) per-sequence token mean; empty rows stay 0
    denom = (tokens > 0).sum().clamp_min(1) if normalizer is None else normalizer
    return seq_loss.sum() / denom


# --------------------------------------------------------------------------- policy loss


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    agg: str = "token-mean",
    clip_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    normalizer: float | torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (eq. 7 of arXiv 1707.06347) with dual clip for A < 0, as verl's vanilla loss.

        ratio = exp(clamp(logp - old_logp, -20, 20))
        l1 = -A * ratio,  l2 = -A * clip(ratio, 1 - clip, 1 + clip_high)
        l = max(l1, l2)                                    (pessimistic bound)
        l = min(l, -A * clip_ratio_c)   where A < 0        (dual clip; clip_ratio_c=None disables)
        l = l * w                       w = rollout_is_weights (detached), when given, as verl
        loss = agg_loss(l, mask, agg)

    `clip_high` defaults to `clip` (set it higher for DAPO's clip-higher). Observation tokens carry
    mask 0 and add nothing to the loss or its gradient.

    Shapes: logp, old_logp, mask (N, L); adv (N, L) or (N,) (broadcast over tokens) -> loss ().
    Returns (loss, stats) with detached floats: `actor/pg_loss`, `actor/pg_clipfrac` (share of
    tokens where the clipped term is larger), `actor/pg_clipfrac_lower` (share cut by the dual
    clip), `actor/ppo_kl` (masked mean of old_logp - logp).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound) or None, got {clip_ratio_c}")
    if adv.dim() == 1:
        adv = adv[:, None]  # (N,) -> (N, 1), broadcast over L
    clip_high = clip if clip_high is None else clip_high
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # (N, L)
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio  # (N, L)
    l2 = -adv * ratio.clamp(1 - clip, 1 + clip_high)  # (N, L)
    clipped = torch.maximum(l1, l2)
    if clip_ratio_c is not None:
        l3 = -adv * clip_ratio_c
        lower = (adv < 0) & (clipped > l3)  # (N, L) tokens the dual clip bounds
        losses = torch.where(adv < 0, torch.minimum(clipped, l3), clipped)
    else:
        lower = torch.zeros_like(clipped, dtype=torch.bool)
        losses = clipped
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()  # (N, L): a change of measure, not of the objective
    loss = agg_loss(losses, mask, agg, normalizer)
    with torch.no_grad():
        stats = {
            "actor/pg_loss": loss.item(),
            "actor/pg_clipfrac": masked_mean((l2 > l1).to(losses.dtype), mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(lower.to(losses.dtype), mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, stats


# --------------------------------------------------------------------------- sampler vs trainer

ROLLOUT_IS_LEVELS = ("none", "token", "sequence")


def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       level: str = "token", threshold: float = 2.0) -> torch.Tensor:
    """Truncated importance weights pi_old / pi_rollout for a sampler that is not the trainer (TIS).

        token:     w_t = min(exp(old_t - rollout_t), threshold)
        sequence:  w_t = min(exp(sum_t' m_t' (old_t' - rollout_t')), threshold)   (same for every t)

    verl's `compute_rollout_correction_weights` with a single upper threshold (log-ratios clamped
    to [-20, 20] before exp, as there). Shapes: (N, L) each -> (N, L), detached, 0 where mask is 0.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown rollout IS level {level!r}; valid: ['token', 'sequence'] (algorithm.rollout_is)")
    log_ratio = (old_logp - rollout_logp).detach()  # (N, L)
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(old_logp)  # (N, 1) -> (N, L)
    w = torch.exp(log_ratio.clamp(-20.0, 20.0)).clamp(max=threshold)
    return w * mask.to(w.dtype)


def rollout_mismatch_sums(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                          mask: torch.Tensor) -> dict[str, float]:
    """Sums and maxima of how far the sampler's log-probs are from the trainer's (one micro-batch).

        d_t = |old_t - rollout_t|                    over tokens with mask 1
        p_t = |exp(old_t) - exp(rollout_t)|          (verl's `rollout_probs_diff`, on probabilities)
        rho_i = exp(sum_t m_t (old_t - rollout_t))   sequence importance ratio, rows with a token

    Returns float sums `logp_diff_sum`, `prob_diff_sum`, `tokens`, `seq_ratio_sum`, `sequences` and
    maxima `logp_diff_max`, `prob_diff_max`, `seq_ratio_max`, so micro-batches and ranks combine
    by summing / taking the max. Shapes: (N, L) each.
    """
    m = mask.bool()
    old, roll = old_logp.detach().double(), rollout_logp.detach().double()
    d = (old - roll).abs()[m]
    p = (old.exp() - roll.exp()).abs()[m]
    has = m.any(dim=-1)  # (N,)
    rho = torch.exp(masked_sum(old - roll, mask.double(), dim=-1).clamp(-20.0, 20.0))[has]  # (n_seq,)
    return {"logp_diff_sum": float(d.sum()), "prob_diff_sum": float(p.sum()), "tokens": float(m.sum()),
            "seq_ratio_sum": float(rho.sum()), "sequences": float(has.sum()),
            "logp_diff_max": float(d.max()) if d.numel() else 0.0,
            "prob_diff_max": float(p.max()) if p.numel() else 0.0,
            "seq_ratio_max": float(rho.max()) if rho.numel() else 0.0}


# --------------------------------------------------------------------------- likelihood preservation

LLDS_GATES = ("response", "action")


def action_ids(response_mask: torch.Tensor) -> torch.Tensor:
    """Number each action (generation turn) of every response: k = 1, 2, ... on the tokens of the k-th
    maximal run of response_mask == 1 in the row, 0 under mask 0 (observations, padding).

    A multi-turn Search-R1 response is [turn 1 | <information> (mask 0) | turn 2 | ...], so the runs
    of generated tokens between observations are its actions. Shapes: (N, L) -> (N, L) int64.
    """
    m = response_mask.bool()
    prev = torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)  # (N, L): mask of the token before
    starts = m & ~prev  # (N, L) first token of each run
    return torch.cumsum(starts.long(), dim=1) * m.long()  # (N, L) run number, 0 outside runs


def llds_penalty(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, gate: str = "response") -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token LLDS penalty (Lazy Likelihood-Displacement regularisation, Deng et al. 2025,
    arXiv 2512.04220, "On GRPO Collapse in Search-R1"), before aggregation.

        d_t   = log pi_theta(y_t) - log pi_old(y_t)                 per-token log-ratio
        P_i   = 1[A_i,t >= 0 on every generated token of i]         preserving set (non-negative advantage)
        U(t)  = the unit holding token t: the whole response (gate="response") or its action, the
                maximal run of generated tokens between observations (gate="action", `action_ids`)
        F(t)  = 1[sum_{t' in U(t)} m_t' d_t' < 0]                   the unit's likelihood fell
        g_t   = m_t * P_i * F(t) * 1[d_t < 0]                       the tokens responsible
        p_t   = g_t * max(0, log pi_old(y_t) - log pi_theta(y_t))   = g_t * relu(-d_t)

    The gate g is computed without gradient; the gradient flows through log pi_theta only (old is
    detached), and pushes the gated tokens' likelihood back up to pi_old's. Observation tokens
    (mask 0) are never in a unit and never penalised. With pi_theta == pi_old (the first update on
    a batch) every d_t is 0 and the penalty is 0: LLDS acts from the second update on a rollout
    batch (more mini-batches or PPO epochs).

    Shapes: log_probs, old_log_probs, response_mask (N, L); advantages (N, L) or (N,) -> penalty
    (N, L), zero off the gate. Stats (detached floats): `actor/llds_gated_token_frac` (gated tokens /
    generated tokens) and `actor/llds_gated_response_frac` (responses with a gated token / responses
    with a generated token).
    """
    if gate not in LLDS_GATES:
        raise ValueError(f"unknown LLDS gate {gate!r}; valid: {list(LLDS_GATES)} (algorithm.llds_gate)")
    m = response_mask.bool()  # (N, L)
    with torch.no_grad():
        d = torch.where(m, log_probs.detach() - old_log_probs.detach(), torch.zeros((), dtype=log_probs.dtype))
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(d)  # (N,) -> (N, L)
        lowest = torch.where(m, adv.to(d.dtype), torch.full((), math.inf, dtype=d.dtype)).amin(dim=-1)  # (N,)
        preserve = lowest >= 0  # (N,) rows with no negative advantage on a generated token
        if gate == "response":
            fell = (d.sum(dim=-1) < 0)[:, None].expand_as(m)  # (N,) -> (N, L)
        else:
            ids = action_ids(m)  # (N, L) 0 = no action
            unit_sum = torch.zeros(d.shape[0], d.shape[1] + 1, dtype=d.dtype).scatter_add_(1, ids, d)  # (N, L + 1)
            fell = (unit_sum < 0).gather(1, ids)  # (N, L) the sum of the token's own action
        g = m & preserve[:, None] & fell & (d < 0)  # (N, L)
        rows = m.any(dim=-1)  # (N,)
        stats = {
            "actor/llds_gated_token_frac": float(g.sum()) / max(float(m.sum()), 1.0),
            "actor/llds_gated_response_frac": float((g.any(dim=-1) & rows).sum()) / max(float(rows.sum()), 1.0),
        }
    penalty = (old_log_probs.detach() - log_probs).clamp_min(0.0)  # (N, L) relu(-d), differentiable in log_probs
    return torch.where(g, penalty, torch.zeros((), dtype=penalty.dtype)), stats


def llds_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, gate: str = "response", agg: str = "token-mean",
              normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The LLDS loss term: `agg_loss(llds_penalty(...), response_mask, agg, normalizer)`.

        L_LLDS = sum_{i,t} g_t * relu(log pi_old(y_t) - log pi_theta(y_t)) / T     (token-mean, T = sum m)

    aggregated exactly as the policy loss (same mask, mode and normalizer: the denominator counts
    every generated token, gated or not, so micro-batch terms add up to the mini-batch's and the
    term's scale does not jump when few tokens are gated). The trainer adds `llds_coef * L_LLDS` to
    the PPO-clip loss. Shapes as `llds_penalty` -> loss (). Stats: `llds_penalty`'s plus
    `actor/llds_loss` (L_LLDS, without the coefficient).
    """
    penalty, stats = llds_penalty(log_probs, old_log_probs, advantages, response_mask, gate)
    loss = agg_loss(penalty, response_mask, agg, normalizer)
    stats["actor/llds_loss"] = float(loss.detach())
    return loss, stats


LIKELIHOOD_SUMS = ("correct_new", "correct_old", "correct_tokens", "incorrect_new", "incorrect_old",
                   "incorrect_tokens", "preserved", "preserved_fell")


def likelihood_sums(log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor,
                    correct: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
    """Sums behind the likelihood diagnostics of arXiv 2512.04220 (one micro-batch; add the dicts of
    several, then `likelihood_metrics`).

        correct_new   = sum_{i correct, t} m_t log pi_theta(y_t)     correct_tokens = sum_{i correct, t} m_t
        correct_old   = sum_{i correct, t} m_t log pi_old(y_t)       (incorrect_*: the same over i not correct)
        preserved     = #{i : A_i >= 0 on every generated token, sum_t m_t > 0}
        preserved_fell = #{i preserved : sum_t m_t (log pi_theta - log pi_old) < 0}

    `correct` is the caller's notion of a correct response (the trainers use EM > 0). Shapes:
    log_probs, old_log_probs, response_mask (N, L); correct (N,) bool; advantages (N, L) or (N,).
    """
    m = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float64)
    new = torch.where(m, log_probs.detach().double(), zero)  # (N, L)
    old = torch.where(m, old_log_probs.detach().double(), zero)  # (N, L)
    tokens = m.sum(dim=-1).double()  # (N,)
    ok = correct.bool().to(m.device)  # (N,)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(new)  # (N,) -> (N, L)
    preserve = (torch.where(m, adv.double(), torch.full((), math.inf, dtype=torch.float64)).amin(dim=-1) >= 0) \
        & (tokens > 0)  # (N,)
    fell = (new - old).sum(dim=-1) < 0  # (N,)
    return {"correct_new": float(new.sum(-1)[ok].sum()), "correct_old": float(old.sum(-1)[ok].sum()),
            "correct_tokens": float(tokens[ok].sum()),
            "incorrect_new": float(new.sum(-1)[~ok].sum()), "incorrect_old": float(old.sum(-1)[~ok].sum()),
            "incorrect_tokens": float(tokens[~ok].sum()),
            "preserved": float(preserve.sum()), "preserved_fell": float((preserve & fell).sum())}


def likelihood_metrics(sums: dict[str, float], new: str = "new", old: str = "old") -> dict[str, float]:
    """Per-token means from `likelihood_sums` (summed over micro-batches and ranks):

        likelihood/correct_logp_{new}   = correct_new / correct_tokens      (mean log pi_theta per token)
        likelihood/correct_logp_{old}   = correct_old / correct_tokens      (mean log pi_old per token)
        likelihood/incorrect_logp_{new|old}   the same over incorrect responses
        likelihood/preserved_fell_frac  = preserved_fell / preserved

    A group with no token (no correct response in the batch) is left out rather than logged as 0.
    `new` / `old` name the two policies in the keys; with other names than the defaults the last key
    is `likelihood/preserved_fell_frac_{new}_vs_{old}` (e.g. "old" / "rollout": the trainer's pi_old
    against the sampler's log-probs).
    """
    out: dict[str, float] = {}
    for kind in ("correct", "incorrect"):
        if sums[f"{kind}_tokens"] > 0:
            out[f"likelihood/{kind}_logp_{new}"] = sums[f"{kind}_new"] / sums[f"{kind}_tokens"]
            out[f"likelihood/{kind}_logp_{old}"] = sums[f"{kind}_old"] / sums[f"{kind}_tokens"]
    if sums["preserved"] > 0:
        key = "preserved_fell_frac" if (new, old) == ("new", "old") else f"preserved_fell_frac_{new}_vs_{old}"
        out[f"likelihood/{key}"] = sums["preserved_fell"] / sums["preserved"]
    return out
