"""GRPO advantage, K3 KL, PPO-clip loss: hand-computed cases, then verl 0.9's own functions as the reference."""
import math
import time

import numpy as np
import pytest
import torch

from search_r1 import algos as A


# --------------------------------------------------------------------------- hand-computed


def test_grpo_population_std():
    # group a = [1, 2, 3]: mean 2, deviations -1, 0, 1, population var = 2/3, std = 0.816497
    #   -> A = -1/0.816497 = -1.224745, 0, +1.224745
    # group b = [0, 0]: zero variance -> 0, 0;  group c = [5]: singleton -> 0
    adv = A.compute_grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 5.0]), ["a", "a", "a", "b", "b", "c"])
    expected = torch.tensor([-1.224745, 0.0, 1.224745, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_grpo_unbiased_std_and_none():
    # group [1, 2, 3]: unbiased var = (1 + 0 + 1) / 2 = 1 -> A = -1, 0, 1
    # group [1, 3]:    mean 2, unbiased var = (1 + 1) / 1 = 2, std = 1.414214 -> A = -0.707107, 0.707107
    scores = torch.tensor([1.0, 2.0, 3.0, 1.0, 3.0])
    uids = np.array([7, 7, 7, 9, 9])
    adv = A.compute_grpo_advantages(scores, uids, std="unbiased")
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, -0.707107, 0.707107]), atol=1e-6, rtol=0)
    # population std of [1, 3] = 1 -> A = -1, 1
    adv = A.compute_grpo_advantages(scores, uids, std="population")
    torch.testing.assert_close(adv[3:], torch.tensor([-1.0, 1.0]), atol=1e-6, rtol=0)
    # "none" (Dr. GRPO): r - mean = -1, 0, 1, -1, 1
    adv = A.compute_grpo_advantages(scores, uids, std="none")
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, -1.0, 1.0]))


def test_grpo_zero_variance_is_exactly_zero():
    # 0.1 is not exact in float32: sum/3 may differ from 0.1 by one ulp, and with eps = 1e-8 a
    # naive (r - mean) / (std + eps) can return ~0.4; equal scores must give exactly 0.
    for dtype in (torch.float32, torch.float64):
        scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7], dtype=dtype)
        adv = A.compute_grpo_advantages(scores, [0, 0, 0, 1, 1, 1, 1], eps=1e-8)
        assert adv.dtype == dtype
        assert torch.equal(adv, torch.zeros(7, dtype=dtype))


def test_grpo_uid_kinds_agree():
    scores = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.5, 3.0])
    as_str = ["u1", "u2", "u1", "u2", "u3", "u3"]
    expected = A.compute_grpo_advantages(scores, as_str)
    for uids in (
        np.array(as_str, dtype=object),
        np.array(as_str),
        np.array([1, 2, 1, 2, 3, 3]),
        torch.tensor([1, 2, 1, 2, 3, 3]),
        [("q", 1), ("q", 2), ("q", 1), ("q", 2), ("q", 3), ("q", 3)],
    ):
        torch.testing.assert_close(A.compute_grpo_advantages(scores, uids), expected)
    # int 1 and str "1" are different prompts: two singleton groups -> 0, 0
    assert A.compute_grpo_advantages([1.0, 2.0], [1, "1"]).tolist() == [0.0, 0.0]
    # integer scores are promoted to float32
    assert A.compute_grpo_advantages([0, 1], ["a", "a"]).dtype == torch.float32
    assert A.compute_grpo_advantages(torch.zeros(0), []).shape == (0,)


def test_grpo_bad_input():
    with pytest.raises(ValueError, match=r"unknown std mode 'sample'.*population.*unbiased"):
        A.compute_grpo_advantages([1.0, 2.0], ["a", "a"], std="sample")
    with pytest.raises(ValueError, match="uids must have 2 entries"):
        A.compute_grpo_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="scores must be 1-D"):
        A.compute_grpo_advantages(torch.zeros(2, 3), ["a", "b"])
    with pytest.raises(ValueError, match="hashable"):
        A.compute_grpo_advantages([1.0, 2.0], [["a"], ["a"]])


def test_grpo_large_batch_is_fast():
    # 100k trajectories, 20k prompts x 5 samples, str uids as DataProto carries them.
    n, g = 100_000, 5
    scores = torch.rand(n)
    uids = np.array([f"uid-{i // g}" for i in range(n)], dtype=object)
    t0 = time.perf_counter()
    adv = A.compute_grpo_advantages(scores, uids)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"{elapsed:.2f}s for 100k rows"
    # each group of 5 sums to 0 (deviations from its own mean)
    assert adv.view(-1, g).sum(dim=1).abs().max() < 1e-4
    # spot check one group against the formula
    r = scores[:g].double()
    ref = (r - r.mean()) / (r.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(adv[:g].double(), ref, atol=1e-5, rtol=0)


def test_broadcast_to_tokens():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert A.broadcast_to_tokens(adv, mask).tolist() == [[2.0, 2.0, 0.0], [-0.0, -1.0, -1.0]]
    with pytest.raises(ValueError, match=r"adv \(N,\) and response_mask \(N, L\)"):
        A.broadcast_to_tokens(adv, mask[:1])


def test_zero_leading_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    out = A.zero_leading_tokens(x, [2, 0, 3])
    assert out.tolist() == [[0.0, 0.0, 3.0], [4.0, 5.0, 6.0], [0.0, 0.0, 0.0]]
    assert x[0, 0] == 1.0  # a copy: the input is left alone
    with pytest.raises(ValueError, match=r"counts must lie in \[0, 3\]"):
        A.zero_leading_tokens(x, [4, 0, 0])
    with pytest.raises(ValueError, match=r"x \(N, L\) and counts \(N,\)"):
        A.zero_leading_tokens(x, [1, 1])


def test_leading_token_values():
    out = A.leading_token_values((3, 4), [1, 0, 4], lead=2.0, rest=0.5)
    assert out.tolist() == [[2.0, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]]
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"counts must lie in \[0, 4\]"):
        A.leading_token_values((3, 4), [5, 0, 0], 1.0, 0.0)
    with pytest.raises(ValueError, match=r"counts \(N,\)"):
        A.leading_token_values((3, 4), [1, 1], 1.0, 0.0)


def test_k3_hand():
    # pi = 0.5, ref = 0.25: d = ln(0.25/0.5) = -0.693147, ratio = 0.5,
    #   k3 = 0.5 - (-0.693147) - 1 = 0.193147
    # pi == ref: k3 = 1 - 0 - 1 = 0
    # pi = 1 (logp 0), ref logp -30: d clamped to -20, k3 = e^-20 + 20 - 1 = 19 -> clamped to 10
    logp = torch.tensor([math.log(0.5), -1.3, 0.0])
    ref = torch.tensor([math.log(0.25), -1.3, -30.0])
    torch.testing.assert_close(A.k3_kl(logp, ref), torch.tensor([0.193147, 0.0, 10.0]), atol=1e-6, rtol=0)
    assert A.k3_kl(logp, ref, clamp=None)[2].item() == pytest.approx(19.0)
    assert (A.k3_kl(torch.randn(50), torch.randn(50)) >= 0).all()  # K3 is never negative
    assert A.get_kl_estimator("low_var_kl") is A.k3_kl
    with pytest.raises(ValueError, match=r"unknown KL estimator.*'k1'.*'k3'"):
        A.get_kl_estimator("k9")


def _ppo_case():
    # row 0: 3 valid tokens, row 1: 1 valid token; masked slots hold wild values that must not matter.
    #   tok  A   ratio  l1=-A*r  l2=-A*clip(r,.8,1.2)  max   dual clip (A<0: min(., 3))
    #   r0t0 +1  1.5    -1.5     -1.2                  -1.2  -           clipped (l2 > l1)
    #   r0t1 -1  0.5     0.5      0.8                   0.8  0.8         clipped (l2 > l1)
    #   r0t2 +1  1.0    -1.0     -1.0                  -1.0  -
    #   r1t0 -1  4.0     4.0      1.2                   4.0  3.0         dual-clipped (lower)
    ratio = torch.tensor([[1.5, 0.5, 1.0], [4.0, 50.0, 1e-6]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]])
    logp = (old + ratio.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 7.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return logp, old, adv, mask


@pytest.mark.parametrize(
    "agg,expected",
    [
        ("token-mean", (-1.2 + 0.8 - 1.0 + 3.0) / 4),  # 1.6 / 4 = 0.4
        ("token-sum", 1.6),
        ("seq-mean-token-mean", ((-1.2 + 0.8 - 1.0) / 3 + 3.0) / 2),  # (-0.466667 + 3) / 2 = 1.266667
        ("seq-mean", ((-1.2 + 0.8 - 1.0) / 3 + 3.0) / 2),
        ("seq-mean-token-sum", ((-1.2 + 0.8 - 1.0) + 3.0) / 2),  # 0.8
    ],
)
def test_ppo_clip_hand(agg, expected):
    logp, old, adv, mask = _ppo_case()
    loss, stats = A.ppo_clip_loss(logp, old, adv, mask, clip=0.2, agg=agg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert stats["actor/pg_clipfrac"] == pytest.approx(2 / 4)  # r0t0, r0t1
    assert stats["actor/pg_clipfrac_lower"] == pytest.approx(1 / 4)  # r1t0
    # ppo_kl = mean(-ln r) = -(ln 1.5 + ln 0.5 + ln 1 + ln 4) / 4 = -1.098612 / 4
    assert stats["actor/ppo_kl"] == pytest.approx(-1.098612 / 4, abs=1e-6)
    assert all(isinstance(v, float) for v in stats.values())


def test_ppo_clip_without_dual_clip_and_clip_high():
    logp, old, adv, mask = _ppo_case()
    # no dual clip: r1t0 keeps 4.0 -> (-1.2 + 0.8 - 1.0 + 4.0) / 4 = 0.65
    loss, _ = A.ppo_clip_loss(logp, old, adv, mask, clip_ratio_c=None)
    assert loss.item() == pytest.approx(0.65, abs=1e-6)
    # clip_high 0.6: r0t0 -> max(-1.5, -clip(1.5, .8, 1.6)) = -1.5 -> (-1.5 + 0.8 - 1.0 + 3.0) / 4 = 0.325
    loss, stats = A.ppo_clip_loss(logp, old, adv, mask, clip_high=0.6)
    assert loss.item() == pytest.approx(0.325, abs=1e-6)
    assert stats["actor/pg_clipfrac"] == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        A.ppo_clip_loss(logp, old, adv, mask, clip_ratio_c=0.5)


def test_masked_tokens_get_no_gradient_and_change_nothing():
    logp, old, adv, mask = _ppo_case()
    loss, _ = A.ppo_clip_loss(logp, old, adv, mask)
    loss.backward()
    # masked slots: 0; clipped r0t0, r0t1 and dual-clipped r1t0 are constants: 0;
    # r0t2 is unclipped with A = +1, ratio 1: d/dlogp (-ratio / 4) = -ratio / 4 = -0.25
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -0.25], [0.0, 0.0, 0.0]]))
    # perturbing the observation slots (logp, old logp, advantage) leaves the loss unchanged
    logp2 = logp.detach().clone()
    logp2[mask == 0] += 123.0
    adv2 = adv.clone()
    adv2[mask == 0] = -1e4
    loss2, _ = A.ppo_clip_loss(logp2, old, adv2, mask)
    assert loss2.item() == loss.item()


def test_agg_loss_hand_and_errors():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row empty: counts for nothing
    assert A.agg_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert A.agg_loss(loss, mask, "token-mean", normalizer=7.0).item() == pytest.approx(1.0)
    # per-sequence means 1.5 and 4 over the 2 non-empty rows
    assert A.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert A.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert A.agg_loss(loss, torch.zeros_like(mask), "token-mean").item() == 0.0  # not NaN
    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'mean'.*token-mean.*seq-mean-token-sum"):
        A.agg_loss(loss, mask, "mean")


def test_entropy_and_masked_mean_hand():
    # uniform over 4: H = ln 4 = 1.386294; p = (1/4, 3/4): H = .25 ln 4 + .75 ln(4/3) = 0.562335
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]])
    torch.testing.assert_close(A.entropy_from_logits(logits), torch.tensor([1.386294, 0.562335]), atol=1e-6, rtol=0)
    assert A.entropy_from_logits(torch.tensor([1000.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    m = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert A.masked_mean(x, m).item() == pytest.approx(3.0)  # (1 + 3 + 5) / 3; NaN is masked out
    assert A.masked_mean(x, m, dim=1).tolist() == [1.0, 4.0]
    assert A.masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_token_log_probs_by_hand_and_gradcheck():
    # z = (0, ln 3), target 1: p = (1/4, 3/4), logp = ln(3/4), lse = ln 4; d logp / dz = onehot - p
    z = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    logp, lse = A.token_log_probs(z, torch.tensor([1]))
    assert logp.item() == pytest.approx(math.log(0.75)) and lse.item() == pytest.approx(math.log(4.0))
    assert not lse.requires_grad
    logp.sum().backward()
    torch.testing.assert_close(z.grad, torch.tensor([[-0.25, 0.25]]))
    # the backward against finite differences (float64), targets repeated within a row's batch
    g = torch.Generator().manual_seed(3)
    z64 = (torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = torch.randint(0, 11, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: A.token_log_probs(x, t)[0], (z64,))


def test_token_log_probs_is_autograd_graph_to_the_bit():
    """The fused backward must give the very numbers of gather - logsumexp (the worker's path before it),
    so switching changes no training run: logits at a real vocabulary, a -inf (top-k filtered) column,
    and zero upstream gradients (response padding)."""
    g = torch.Generator().manual_seed(5)
    z0 = torch.randn(3, 17, 4099, generator=g) * 4
    z0[:, :, 7] = float("-inf")
    t = torch.randint(8, 4099, (3, 17), generator=g)
    w = torch.randn(3, 17, generator=g)
    w[1, 5:] = 0.0
    z_ref, z_new = z0.clone().requires_grad_(), z0.clone().requires_grad_()
    ref = z_ref.gather(-1, t.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z_ref, dim=-1)
    (ref * w).sum().backward()
    new, lse = A.token_log_probs(z_new, t)
    (new * w).sum().backward()
    assert torch.equal(new, ref) and torch.equal(z_new.grad, z_ref.grad)
    assert torch.equal(lse, torch.logsumexp(z0, dim=-1))
    # the entropy from the same lse: within float32 rounding of the float64 entropy (the -inf column
    # is test_entropy_of_masked_logits' case)
    z0[:, :, 7] = 0.0
    e64 = A.entropy_from_logits(z0.double())
    torch.testing.assert_close(A.entropy_from_logits(z0, torch.logsumexp(z0, dim=-1)).double(), e64,
                               atol=2e-5, rtol=0)


def test_entropy_of_masked_logits():
    """A -inf logit (a masked token) has probability 0: the entropy, with or without a given lse, and
    its gradient are those of the same logits without that column, not NaN (0 * -inf)."""
    torch.manual_seed(0)
    z = torch.randn(3, 6) * 3
    keep = [0, 1, 3, 4]
    masked = z.clone()
    masked[:, [2, 5]] = float("-inf")
    masked[1, 0] = float("-inf")  # rows masked differently
    want = torch.stack([A.entropy_from_logits(z[0, keep]), A.entropy_from_logits(z[1, [1, 3, 4]]),
                        A.entropy_from_logits(z[2, keep])])
    torch.testing.assert_close(A.entropy_from_logits(masked), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(A.entropy_from_logits(masked, torch.logsumexp(masked, dim=-1)), want,
                               atol=1e-6, rtol=0)
    # the differentiable form: finite gradient, 0 on masked tokens, the unmasked logits' gradient elsewhere
    zm = masked.clone().requires_grad_()
    A.entropy_from_logits(zm).sum().backward()
    assert torch.isfinite(zm.grad).all()
    assert (zm.grad[torch.isneginf(masked)] == 0).all()
    z2 = z[2, keep].clone().requires_grad_()
    A.entropy_from_logits(z2).backward()
    torch.testing.assert_close(zm.grad[2, keep], z2.grad, atol=1e-6, rtol=0)
    # a NaN logit is not hidden
    bad = z.clone()
    bad[0, 1] = float("nan")
    assert torch.isnan(A.entropy_from_logits(bad, torch.logsumexp(bad, dim=-1))[0])
    assert torch.isnan(A.entropy_from_logits(bad)[0])


def test_kl_registry_names_the_valid_estimators():
    assert A.get_kl_estimator("low_var_kl") is A.k3_kl
    with pytest.raises(ValueError, match=r"unknown KL estimator.*'k3'"):
        A.get_kl_estimator("k4")


def test_truncated_is_weights_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    # row 0: ratios e^1, e^-1, 1 ; row 1: e^-0.5 twice, third token masked
    rollout = torch.tensor([[-1.0, 0.0, -2.0], [-0.5, -0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    tok = A.truncated_is_weights(old, rollout, mask, "token", threshold=2.0)
    torch.testing.assert_close(tok, torch.tensor([[2.0, math.exp(-1), 1.0], [math.exp(-0.5)] * 2 + [0.0]]))
    # sequence: row 0 sums to 0 -> 1; row 1 sums to -1 -> e^-1 (the masked 9.0 does not count)
    seq = A.truncated_is_weights(old, rollout, mask, "sequence", threshold=2.0)
    torch.testing.assert_close(seq, torch.tensor([[1.0, 1.0, 1.0], [math.exp(-1)] * 2 + [0.0]]))
    with pytest.raises(ValueError, match="rollout_is"):
        A.truncated_is_weights(old, rollout, mask, "geo")


def test_rollout_mismatch_sums_by_hand():
    old = torch.tensor([[0.0, -1.0], [-2.0, -3.0], [0.0, 0.0]])
    rollout = torch.tensor([[-0.5, -1.0], [-2.0, 5.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # row 2 has no generated token
    s = A.rollout_mismatch_sums(old, rollout, mask)
    assert s["tokens"] == 3 and s["sequences"] == 2
    assert s["logp_diff_sum"] == pytest.approx(0.5) and s["logp_diff_max"] == pytest.approx(0.5)
    assert s["prob_diff_sum"] == pytest.approx(1 - math.exp(-0.5))  # |e^0 - e^-0.5|
    assert s["seq_ratio_sum"] == pytest.approx(math.exp(0.5) + 1.0)  # rows 0 (e^0.5) and 1 (1)
    assert s["seq_ratio_max"] == pytest.approx(math.exp(0.5))


def test_policy_loss_with_rollout_is_weights_scales_each_token():
    logp = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = A.ppo_clip_loss(logp, logp, adv, mask, rollout_is_weights=w)
    assert loss.item() == pytest.approx((-1.0 * 2.0 + 1.0 * 0.5) / 2)  # -A * ratio(=1) * w, token mean


# --------------------------------------------------------------------------- verl as the reference


@pytest.fixture(scope="module")
def verl_algos():
    from verl.trainer.ppo import core_algos
    from verl.utils import torch_functional as verl_F
    from verl.workers.config.actor import ActorConfig

    return core_algos, verl_F, ActorConfig


def _random_batch(seed, n=48, length=12, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)  # (N, L) right-padded
    return g, mask, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grpo_matches_verl(verl_algos, dtype):
    core_algos, _, _ = verl_algos
    g, mask, lengths = _random_batch(0, dtype=dtype)
    n = mask.shape[0]
    # groups of size 2..6 (verl differs on singletons by design: mean 0, std 1 there)
    sizes, total = [], 0
    while total < n:
        s = min(int(torch.randint(2, 7, (1,), generator=g)), n - total)
        if n - total - s == 1:
            s += 1
        sizes.append(s)
        total += s
    uids = np.array([f"p{i}" for i, s in enumerate(sizes) for _ in range(s)], dtype=object)
    perm = torch.randperm(n, generator=g).numpy()
    uids = uids[perm]  # group members scattered through the batch
    scores = (torch.randn(n, generator=g) * 2).to(dtype)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(n), lengths - 1] = scores  # reward on the last generated token

    ref, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, uids, epsilon=1e-6)
    ours = A.broadcast_to_tokens(A.compute_grpo_advantages(scores, uids, eps=1e-6, std="unbiased"), mask)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    ref_none, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, uids, norm_adv_by_std_in_grpo=False)
    ours_none = A.broadcast_to_tokens(A.compute_grpo_advantages(scores, uids, std="none"), mask)
    torch.testing.assert_close(ours_none, ref_none, atol=1e-6, rtol=0)


def test_k3_matches_verl(verl_algos):
    core_algos, _, _ = verl_algos
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(32, 16, generator=g) * 4  # wide spread so both clamps are exercised
    ref = torch.randn(32, 16, generator=g) * 4
    expected = core_algos.kl_penalty(logp, ref, "low_var_kl")
    assert (expected == 10.0).any()
    torch.testing.assert_close(A.k3_kl(logp, ref), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(A.get_kl_estimator("k1")(logp, ref), core_algos.kl_penalty(logp, ref, "k1"))
    torch.testing.assert_close(A.get_kl_estimator("k2")(logp, ref), core_algos.kl_penalty(logp, ref, "k2"))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ppo_clip_matches_verl(verl_algos, agg):
    core_algos, _, ActorConfig = verl_algos
    g, mask, _ = _random_batch(2)
    mask[3] = 0  # a fully masked row
    n, length = mask.shape
    old = -torch.rand(n, length, generator=g) * 3
    logp = old + torch.randn(n, length, generator=g) * 0.7  # ratios from ~0.1 to ~8: all clip branches
    adv = (torch.randn(n, generator=g) * 1.5)[:, None].expand(n, length)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, loss_agg_mode=agg)
    ref_loss, ref_stats = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, loss_agg_mode=agg, config=config)
    loss, stats = A.ppo_clip_loss(logp, old, adv, mask, clip=0.2, agg=agg)
    assert ref_stats["actor/pg_clipfrac"] > 0 and ref_stats["actor/pg_clipfrac_lower"] > 0
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        assert stats[key] == pytest.approx(ref_stats[key], abs=1e-6), key


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_agg_loss_matches_verl(verl_algos, mode):
    core_algos, _, _ = verl_algos
    g, mask, _ = _random_batch(3)
    mask[5] = 0
    loss_mat = torch.randn(mask.shape, generator=g)
    expected = core_algos.agg_loss(loss_mat, mask, mode)
    assert A.agg_loss(loss_mat, mask, mode).item() == pytest.approx(expected.item(), abs=1e-6)
    if mode == "token-mean":
        # a micro-batch normalized by the global token count of 2 data-parallel ranks
        expected = core_algos.agg_loss(loss_mat, mask, mode, dp_size=2, batch_num_tokens=1000)
        assert A.agg_loss(loss_mat, mask, mode, normalizer=1000 / 2).item() == pytest.approx(expected.item(), abs=1e-6)


def test_entropy_and_masked_mean_match_verl(verl_algos):
    _, verl_F, _ = verl_algos
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 7, 50, generator=g) * 5  # (N, L, V)
    torch.testing.assert_close(A.entropy_from_logits(logits), verl_F.entropy_from_logits(logits), atol=1e-6, rtol=0)
    x = torch.randn(6, 9, generator=g)
    m = (torch.rand(6, 9, generator=g) > 0.4).float()
    torch.testing.assert_close(A.masked_mean(x, m), verl_F.masked_mean(x, m), atol=1e-6, rtol=0)
    torch.testing.assert_close(A.masked_mean(x, m, dim=1), verl_F.masked_mean(x, m, axis=1), atol=1e-6, rtol=0)


def test_signal_group_rows_keeps_informative_groups_and_pads_with_flat_ones_to_split():
    # groups a (flat), b (informative), c (flat), d (informative, one row at 0 stays with its group)
    adv = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.7])
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert A.signal_group_rows(adv, uids).tolist() == [2, 3, 6, 7]
    assert A.signal_group_rows(adv, uids, multiple=4).tolist() == [2, 3, 6, 7]
    # 2 informative rows, 4 needed per split: the first flat group (a) is added
    assert A.signal_group_rows(adv[:6], uids[:6], multiple=4).tolist() == [0, 1, 2, 3]
    # whole groups of 2 reach a multiple of 3 only at all 6 rows
    assert A.signal_group_rows(adv[:6], uids[:6], multiple=3).tolist() == [0, 1, 2, 3, 4, 5]
    # no group carries a signal: nothing to train on
    assert A.signal_group_rows(torch.zeros(4), [1, 1, 2, 2]).numel() == 0
    with pytest.raises(ValueError, match="multiple"):
        A.signal_group_rows(adv, uids, multiple=0)


# --------------------------------------------------------------------------- LLDS (arXiv 2512.04220)


def _llds(logp, old, adv, mask, gate="response"):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    loss, stats = A.llds_loss(logp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                              torch.tensor(mask, dtype=torch.float64), gate=gate)
    loss.backward()
    return loss.item(), stats, logp.grad


def test_llds_gate_closed_when_likelihood_rose():
    # d = logp - old = [-0.1, +0.3, -0.1]: sum +0.1 >= 0, the response's likelihood rose -> no penalty,
    # even though tokens 0 and 2 fell individually
    loss, stats, grad = _llds([[-1.1, -0.7, -2.1]], [[-1.0, -1.0, -2.0]], [1.0], [[1, 1, 1]])
    assert loss == 0.0 and stats["actor/llds_gated_token_frac"] == 0.0
    assert torch.equal(grad, torch.zeros(1, 3, dtype=torch.float64))


def test_llds_gate_open_on_the_falling_tokens_only():
    # d = [-0.5, +0.2, -0.1, 0]: sum -0.4 < 0, advantage 0.5 >= 0 -> gate open on tokens 0 and 2 (d < 0)
    # penalty = [0.5, 0, 0.1, 0]; token-mean over the 4 generated tokens = 0.6 / 4 = 0.15
    # gradient d loss / d logp_t = -1/4 on gated tokens, 0 elsewhere
    loss, stats, grad = _llds([[-1.5, -0.8, -2.1, -3.0]], [[-1.0, -1.0, -2.0, -3.0]], [0.5], [[1, 1, 1, 1]])
    assert loss == pytest.approx(0.15)
    assert stats["actor/llds_loss"] == pytest.approx(0.15)
    assert stats["actor/llds_gated_token_frac"] == pytest.approx(2 / 4)
    assert stats["actor/llds_gated_response_frac"] == 1.0
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 0.0, -0.25, 0.0]], dtype=torch.float64))


def test_llds_action_gate_differs_from_response_gate():
    # two turns separated by an observation (mask 0):  turn 1 = tokens 0-1, obs = 2-3, turn 2 = 4-5
    # d = [-0.2, -0.2 | obs | +0.5, +0.1]: turn 1 fell (-0.4), turn 2 rose (+0.6), response sum +0.2
    logp = [[-1.2, -1.2, -9.0, -9.0, -0.5, -0.9]]
    old = [[-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]]
    mask = [[1, 1, 0, 0, 1, 1]]
    # response gate: the response rose -> nothing
    loss, stats, _ = _llds(logp, old, [1.0], mask, gate="response")
    assert loss == 0.0 and stats["actor/llds_gated_response_frac"] == 0.0
    # action gate: turn 1 fell -> its tokens 0, 1 (d < 0) penalised: (0.2 + 0.2) / 4 generated tokens = 0.1
    loss, stats, grad = _llds(logp, old, [1.0], mask, gate="action")
    assert loss == pytest.approx(0.1)
    assert stats["actor/llds_gated_token_frac"] == pytest.approx(2 / 4)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25, 0, 0, 0, 0]], dtype=torch.float64))


def test_llds_observation_tokens_never_penalised():
    # observation tokens 1-2 have log-ratio -8 (pi_theta says they are unlikely), but mask 0: they
    # neither open the gate (the generated tokens' sum is -0.1 + 0.0 = -0.1, the response did fall)
    # nor get a penalty; only token 0 (d = -0.1) is penalised: 0.1 / 2 generated tokens = 0.05
    logp = [[-1.1, -9.0, -9.0, -1.0]]
    old = [[-1.0, -1.0, -1.0, -1.0]]
    for gate in ("response", "action"):
        loss, stats, grad = _llds(logp, old, [1.0], [[1, 0, 0, 1]], gate=gate)
        assert loss == pytest.approx(0.05)
        assert grad[0, 1] == 0 and grad[0, 2] == 0
    # mask 0 everywhere with a large negative ratio: zero loss, zero gradient
    loss, stats, grad = _llds([[-9.0, -9.0]], [[-1.0, -1.0]], [1.0], [[0, 0]])
    assert loss == 0.0 and torch.equal(grad, torch.zeros(1, 2, dtype=torch.float64))
    assert stats["actor/llds_gated_response_frac"] == 0.0


def test_llds_negative_advantage_responses_excluded():
    # row 0: A = -1 (outside the preserving set), its likelihood fell by 0.5 -> not penalised
    # row 1: A = 0 (in the set: non-negative), fell by 0.3 on token 0 -> 0.3
    # token-mean over 4 generated tokens: 0.3 / 4 = 0.075; 1 of 2 responses gated
    logp = [[-1.5, -1.0], [-1.3, -1.0]]
    old = [[-1.0, -1.0], [-1.0, -1.0]]
    loss, stats, _ = _llds(logp, old, [-1.0, 0.0], [[1, 1], [1, 1]])
    assert loss == pytest.approx(0.075)
    assert stats["actor/llds_gated_response_frac"] == pytest.approx(0.5)
    # token-level advantages (N, L) give the same: row 0 has a negative advantage on a generated token
    loss2, _, _ = _llds(logp, old, [[-1.0, -1.0], [0.0, 0.0]], [[1, 1], [1, 1]])
    assert loss2 == pytest.approx(loss)


def test_llds_on_policy_is_zero_and_bad_gate_names_the_key():
    x = torch.tensor([[-1.0, -2.0]])
    loss, _ = A.llds_loss(x, x.clone(), torch.tensor([1.0]), torch.ones(1, 2))
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match=r"\['response', 'action'\] \(algorithm.llds_gate\)"):
        A.llds_loss(x, x, torch.tensor([1.0]), torch.ones(1, 2), gate="turn")


def test_action_ids_number_runs_between_observations():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0]])
    assert A.action_ids(mask).tolist() == [[1, 1, 0, 0, 2, 0, 3, 3], [0, 1, 1, 1, 0, 0, 0, 0]]


def test_likelihood_diagnostics():
    # row 0 correct, 2 tokens: new [-1, -2] (sum -3), old [-1, -1] (sum -2); A = +1, fell (-1 < 0)
    # row 1 incorrect, 1 token (2nd masked): new -4, old -5; A = -1 (not preserved)
    # row 2 incorrect, 2 tokens: new [-1, -1], old [-1, -1]; A = 0, preserved, did not fall (sum 0)
    new = torch.tensor([[-1.0, -2.0], [-4.0, -50.0], [-1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0], [-5.0, -60.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    sums = A.likelihood_sums(new, old, mask, torch.tensor([True, False, False]), torch.tensor([1.0, -1.0, 0.0]))
    m = A.likelihood_metrics(sums)
    assert m["likelihood/correct_logp_new"] == pytest.approx(-3 / 2)
    assert m["likelihood/correct_logp_old"] == pytest.approx(-2 / 2)
    # incorrect: new (-4 - 1 - 1) / 3 tokens = -2, old (-5 - 1 - 1) / 3 = -7/3
    assert m["likelihood/incorrect_logp_new"] == pytest.approx(-2.0)
    assert m["likelihood/incorrect_logp_old"] == pytest.approx(-7 / 3)
    # preserving set = rows 0 and 2; row 0 fell -> 1/2
    assert m["likelihood/preserved_fell_frac"] == pytest.approx(0.5)
    # no correct response: its keys are left out, not logged as 0; other names for the two policies
    sums = A.likelihood_sums(new, old, mask, torch.tensor([False, False, False]), torch.tensor([1.0, -1.0, 0.0]))
    m = A.likelihood_metrics(sums, new="old", old="rollout")
    assert "likelihood/correct_logp_old" not in m and "likelihood/incorrect_logp_rollout" in m
    assert m["likelihood/preserved_fell_frac_old_vs_rollout"] == pytest.approx(0.5)
