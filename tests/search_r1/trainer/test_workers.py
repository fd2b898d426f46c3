"""PolicyWorker: log-probs against an unpadded reference forward, the update lowers the surrogate
loss, observation tokens get no gradient, and DP=2 equals DP=1 on the same global batch with
identical replicas. Model: tiny-random-qwen3 (3M parameters)."""
import dataclasses

import pytest
import torch
from verl import DataProto

from search_r1.trainer.workers import WorkerSpec, arrange_for_dp

MODEL = "tiny-random-qwen3"


def fixed_batch(n=4, p=6, r=5, seed=0) -> DataProto:
    """Left-padded prompts + right-padded responses; response column 1 is an 'observation' (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (n, p + r), generator=g)
    attn = torch.ones(n, p + r, dtype=torch.long)
    attn[0, :2] = 0  # prompt padding
    attn[1, -2:] = 0  # response padding
    if n > 2:
        attn[2, :1] = 0
        attn[2, -1:] = 0
    pos = torch.clip(attn.cumsum(-1) - 1, min=0)
    response_mask = attn[:, p:].clone()
    response_mask[:, 1] = 0  # an observation token inside every response
    return DataProto.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": pos,
                                "responses": ids[:, p:], "response_mask": response_mask})


def with_targets(worker, batch: DataProto, adv_per_row) -> DataProto:
    batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["ref_log_prob"] = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
    batch.batch["rollout_log_probs"] = batch.batch["old_log_probs"].clone()  # an exact sampler
    batch.batch["advantages"] = torch.tensor(adv_per_row)[:, None] * batch.batch["response_mask"]
    return batch


def test_log_probs_match_unpadded_forward(local_worker_factory):
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2))
    batch = fixed_batch()
    ids, attn, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    p = ids.shape[1] - batch.batch["responses"].shape[1]
    logp = w.compute_log_prob(batch).batch["old_log_probs"]
    for i in range(len(batch)):
        keep = attn[i].bool()
        x = ids[i][keep][None]
        with torch.no_grad():
            lg = w.model(input_ids=x, position_ids=pos[i][keep][None]).logits[0].log_softmax(-1)
        n_prompt, n_resp = int(attn[i, :p].sum()), int(attn[i, p:].sum())
        # logits at position t score token t + 1: response tokens by positions n_prompt-1 ...
        expected = lg[n_prompt - 1:n_prompt - 1 + n_resp].gather(-1, x[0, n_prompt:, None]).squeeze(-1)
        torch.testing.assert_close(logp[i, :n_resp], expected, atol=1e-5, rtol=1e-5)
        assert (logp[i, n_resp:] == 0).all()
    # the reference model starts equal to the policy
    torch.testing.assert_close(w.compute_ref_log_prob(batch).batch["ref_log_prob"], logp)


def grouped_batch(seed=0) -> DataProto:
    """Six rows as a GRPO batch arrives: rows 0-2 share a left-padded prompt (its padding ids differ
    row to row), rows 3-4 share another, row 5 has its own; responses differ, some padded, with an
    observation token."""
    g = torch.Generator().manual_seed(seed)
    p, r = 7, 6
    prompts = [torch.randint(3, 1000, (p,), generator=g) for _ in range(3)]
    ids = torch.stack([prompts[k] for k in (0, 0, 0, 1, 1, 2)])
    ids = torch.cat([ids, torch.randint(3, 1000, (6, r), generator=g)], dim=1)
    attn = torch.ones(6, p + r, dtype=torch.long)
    attn[:3, :2] = 0
    ids[1, :2] = torch.tensor([0, 5])  # padding ids are not part of the prompt
    attn[1, -2:] = 0
    attn[5, -3:] = 0
    pos = torch.clip(attn.cumsum(-1) - 1, min=0)
    response_mask = attn[:, p:].clone()
    response_mask[:, 2] = 0
    return DataProto.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": pos,
                                "responses": ids[:, p:], "response_mask": response_mask})


def test_shared_prompt_rows_groups_rows_by_their_live_prompt_tokens():
    from search_r1.rollout.tensor_helper import shared_prompt_rows

    b = grouped_batch()
    p = b.batch["input_ids"].shape[1] - b.batch["responses"].shape[1]
    first, inverse = shared_prompt_rows(*(b.batch[k][:, :p] for k in ("input_ids", "attention_mask", "position_ids")))
    assert first[inverse].tolist() == [0, 0, 0, 3, 3, 5]
    # a prompt that differs in one live token is its own group
    b.batch["input_ids"][2, 4] += 1
    first, inverse = shared_prompt_rows(*(b.batch[k][:, :p] for k in ("input_ids", "attention_mask", "position_ids")))
    assert first[inverse].tolist() == [0, 0, 2, 3, 3, 5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prompt_forward_equals_one_forward_per_row(local_worker_factory, dtype):
    """Log-probs, entropy and gradients with each group's prompt run once (micro-batch of 6) equal
    those of rows run one at a time (micro-batch of 1: nothing shared)."""
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=6, compute_dtype=dtype))
    batch = grouped_batch()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 0.05, "rtol": 0.05}

    def run(micro):
        w.spec = dataclasses.replace(w.spec, micro_batch_size=micro)
        logp = w.compute_log_prob(batch).batch["old_log_probs"]
        with torch.enable_grad():
            _, ent = w._forward_logprobs(w.model, batch, slice(0, 6), with_entropy=True) if micro == 6 else (
                None, torch.cat([w._forward_logprobs(w.model, batch, slice(i, i + 1), with_entropy=True)[1]
                                 for i in range(6)]))
        b = with_targets(w, DataProto.from_dict({k: v.clone() for k, v in batch.batch.items()}),
                         [1.0, -1.0, 0.5, 2.0, -2.0, 0.25])
        w.optimizer.zero_grad(set_to_none=False)
        w.accumulate_grads(b, norm=float(b.batch["response_mask"].sum()))
        return logp, ent.detach(), torch.cat([q.grad.reshape(-1).clone() for q in w.params])

    shared, single = run(6), run(1)
    assert shared[0].abs().sum() > 0 and shared[2].abs().sum() > 0
    for a, b in zip(shared, single):
        torch.testing.assert_close(a, b, **tol)
    # the padded response columns stay zero
    assert (shared[0][1, -2:] == 0).all() and (shared[0][5, -3:] == 0).all()


def test_bf16_log_prob_pass_casts_each_weight_once_and_changes_no_log_prob(local_worker_factory):
    """The reference pass in bf16 casts each frozen weight once (autocast's cache), not once per
    forward call, gives bit-identical log-probs, and leaves the reference frozen, even after an error."""
    from tests._fixtures.weight_casts import WeightCasts

    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2, compute_dtype="bfloat16"))
    batch = grouped_batch()

    with WeightCasts(w.ref_model) as once:
        ref = w.compute_ref_log_prob(batch).batch["ref_log_prob"]
    with WeightCasts(w.ref_model) as per_call, torch.no_grad():  # what each forward did on its own before
        expected = torch.cat([w._forward_logprobs(w.ref_model, batch, slice(i, i + 2), with_entropy=False)[0]
                              for i in range(0, 6, 2)])
    assert torch.equal(ref, expected)
    assert set(once.count) == once.weights and set(once.count.values()) == {1}
    assert min(per_call.count.values()) >= 4  # 3 micro-batches, the first with its shared prompt: 2 calls
    assert not any(p.requires_grad for p in w.ref_model.parameters())
    with pytest.raises(KeyError), torch.no_grad(), w._weights_cast_once(w.ref_model):
        raise KeyError("a failing forward")
    assert not any(p.requires_grad for p in w.ref_model.parameters())
    with w._weights_cast_once(w.ref_model):  # grad enabled: a frozen weight is not made trainable
        assert not any(p.requires_grad for p in w.ref_model.parameters())


def test_bf16_update_with_weights_cast_once_moves_the_weights_exactly_as_before(local_worker_factory):
    """Two mini-batches in one update_actor call, bf16: the weights end bit-identical to an update
    whose every micro-batch casts the weights itself. A cast cached across the optimizer step would
    give the second mini-batch the first one's weights and fail this."""
    import contextlib

    spec = WorkerSpec(model_name=MODEL, lr=1e-3, warmup_steps=0, micro_batch_size=2, compute_dtype="bfloat16")
    ends = []
    for cast_per_call in (False, True):
        w = local_worker_factory(spec)
        if cast_per_call:
            w._weights_cast_once = lambda model: contextlib.nullcontext()
        batch = with_targets(w, grouped_batch(), [1.0, -1.0, 0.5, 2.0, -2.0, 0.25])
        batch.meta_info["n_mini_batches"] = 2
        w.update_actor(batch)
        ends.append(torch.cat([p.detach().reshape(-1).clone() for p in w.params]))
    start = torch.cat([p.detach().reshape(-1) for p in local_worker_factory(spec).params])
    assert not torch.equal(ends[0], start)
    assert torch.equal(ends[0], ends[1])


def test_reported_entropy_row_by_row_equals_the_entropy_in_the_loss(local_worker_factory):
    """The report-only entropy (entropy_coef 0) is computed row by row under no_grad to bound its
    softmax temporaries; it must equal the batched entropy that joins the loss, and softmax's."""
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=4))
    batch = fixed_batch()
    rows = slice(0, len(batch))
    with torch.enable_grad():
        _, in_loss = w._forward_logprobs(w.model, batch, rows, with_entropy=True, entropy_grad=True)
        _, report = w._forward_logprobs(w.model, batch, rows, with_entropy=True, entropy_grad=False)
    assert in_loss.requires_grad and not report.requires_grad
    torch.testing.assert_close(report, in_loss.detach(), atol=1e-6, rtol=1e-6)
    ids, attn, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    p = ids.shape[1] - batch.batch["responses"].shape[1]
    for i in range(len(batch)):
        keep = attn[i].bool()
        with torch.no_grad():
            lg = w.model(input_ids=ids[i][keep][None], position_ids=pos[i][keep][None]).logits[0]
        n_prompt, n_resp = int(attn[i, :p].sum()), int(attn[i, p:].sum())
        probs = lg[n_prompt - 1:n_prompt - 1 + n_resp].softmax(-1)
        expected = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(report[i, :n_resp], expected, atol=1e-4, rtol=1e-4)
        assert (report[i, n_resp:] == 0).all()


def test_update_on_fixed_batch_lowers_the_loss(local_worker_factory):
    w = local_worker_factory(WorkerSpec(model_name=MODEL, lr=1e-3, warmup_steps=0, micro_batch_size=2))
    batch = with_targets(w, fixed_batch(), [1.0, -1.0, 0.5, -0.5])
    batch.meta_info["n_mini_batches"] = 1
    m1 = w.update_actor(batch)
    # on-policy the ratio is exactly 1, so the first loss is -token_mean(A) over generated tokens
    mask = batch.batch["response_mask"].float()
    expected = -float((batch.batch["advantages"] * mask).sum() / mask.sum())
    assert m1["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert m1["actor/pg_clipfrac"] == 0.0 and m1["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9)
    m2 = w.update_actor(batch)  # same batch, same old log-probs: the surrogate went down
    assert m2["actor/pg_loss"] < m1["actor/pg_loss"] - 1e-4
    assert m2["actor/kl_loss"] > 0  # the policy moved away from the reference
    for k in ("actor/entropy", "actor/grad_norm", "actor/lr", "actor/ppo_kl"):
        assert torch.isfinite(torch.tensor(m2[k]))


def test_observation_tokens_get_zero_gradient(local_worker_factory):
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2))
    base = with_targets(w, fixed_batch(), [1.0, -1.0, 0.5, -0.5])
    mask = base.batch["response_mask"].bool()

    def grads(batch):
        w.optimizer.zero_grad(set_to_none=False)
        w.accumulate_grads(batch, norm=float(batch.batch["response_mask"].sum()))
        return torch.cat([p.grad.reshape(-1).clone() for p in w.params])

    g0 = grads(base)
    assert g0.abs().sum() > 0
    perturbed = DataProto.from_dict({k: v.clone() for k, v in base.batch.items()})
    noise = torch.randn(mask.shape) * 50
    for key in ("advantages", "old_log_probs", "ref_log_prob", "rollout_log_probs"):
        perturbed.batch[key] = torch.where(mask, perturbed.batch[key], noise)  # only masked positions change
    torch.testing.assert_close(grads(perturbed), g0, atol=0, rtol=0)
    # control: the same perturbation on one generated token does change the gradient
    control = DataProto.from_dict({k: v.clone() for k, v in base.batch.items()})
    control.batch["advantages"][0, 0] += 5.0
    assert not torch.equal(grads(control), g0)


def test_kl_weights_scale_each_tokens_kl_term(local_worker_factory):
    """Per-token KL coefficients (algorithm.plan_kl_coef): constant weights equal kl_coef's loss; a
    weight on the leading tokens only makes the gradient blind to the reference elsewhere and
    linear in that weight."""
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2, kl_coef=0.05))
    base = with_targets(w, fixed_batch(), [0.0, 0.0, 0.0, 0.0])  # no policy gradient: KL alone
    mask = base.batch["response_mask"].bool()
    base.batch["ref_log_prob"] = base.batch["ref_log_prob"] + torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))

    def grads(batch, weights=None):
        b = DataProto.from_dict({k: v.clone() for k, v in batch.batch.items()})
        if weights is not None:
            b.batch["kl_weights"] = weights
        w.optimizer.zero_grad(set_to_none=False)
        w.accumulate_grads(b, norm=float(b.batch["response_mask"].sum()))
        return torch.cat([p.grad.reshape(-1).clone() for p in w.params])

    g_spec = grads(base)
    assert g_spec.abs().sum() > 0
    torch.testing.assert_close(grads(base, torch.full(mask.shape, 0.05)), g_spec)
    lead = (torch.arange(mask.shape[1])[None, :] < 1).float().expand_as(mask)  # first response token
    g1 = grads(base, lead * 1.0)
    torch.testing.assert_close(grads(base, lead * 3.0), 3.0 * g1)
    later = DataProto.from_dict({k: v.clone() for k, v in base.batch.items()})
    later.batch["ref_log_prob"][:, 2:] += 5.0  # a different reference on the unweighted tokens
    torch.testing.assert_close(grads(later, lead), g1, atol=0, rtol=0)
    # control: the same change on the weighted token does change the gradient
    first = DataProto.from_dict({k: v.clone() for k, v in base.batch.items()})
    first.batch["ref_log_prob"][:, 0] += 5.0
    assert not torch.allclose(grads(first, lead), g1)


def test_arrange_for_dp_puts_each_global_minibatch_across_ranks():
    batch = DataProto.from_dict({"x": torch.arange(8)})
    arranged = arrange_for_dp(batch, n_mini_batches=2, world_size=2).batch["x"].tolist()
    # rank 0 gets [0, 1 | 4, 5], rank 1 gets [2, 3 | 6, 7]: mini-batch 0 = {0..3}, 1 = {4..7}
    assert arranged == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="n_workers"):
        arrange_for_dp(DataProto.from_dict({"x": torch.arange(6)}), 2, 2)


@pytest.mark.slow
def test_dp2_equals_dp1_and_replicas_stay_identical(ray_session):
    from search_r1.trainer.workers import create_worker_group, shutdown_worker_group

    spec = WorkerSpec(model_name=MODEL, lr=1e-3, warmup_steps=0, micro_batch_size=2, threads=1)
    g1, p1 = create_worker_group(spec, 1)
    g2, p2 = create_worker_group(spec, 2)
    try:
        batch = fixed_batch(n=8, p=6, r=5, seed=1)
        for call in (g1.compute_log_prob, g1.compute_ref_log_prob):
            out = call(batch)
            assert out.meta_info["metrics"]["worker_s"][0] > 0  # workers report their compute time
            out.meta_info.pop("metrics")
            batch = batch.union(out)
        # log-probs computed on 2 ranks equal those on 1 rank
        torch.testing.assert_close(g2.compute_log_prob(batch).batch["old_log_probs"],
                                   batch.batch["old_log_probs"], atol=1e-6, rtol=0)
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
        batch.batch["advantages"] = adv[:, None] * batch.batch["response_mask"]
        # a sampler off by a known amount: the mismatch maxima and sums must combine across ranks
        batch.batch["rollout_log_probs"] = batch.batch["old_log_probs"] - 0.01 * torch.arange(8.0)[:, None]
        metrics = []
        for group in (g1, g2):
            for _ in range(2):  # two steps, two mini-batches each
                b = arrange_for_dp(batch, 2, group.world_size)
                b.meta_info["n_mini_batches"] = 2
                out = group.update_actor(b)
            metrics.append(out)
        m1, m2 = metrics[0][0], metrics[1]
        actor = [{k: v for k, v in m.items() if k.startswith("actor/")} for m in m2]
        assert actor[0] == actor[1]  # every rank reports the same all-reduced metrics
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert m2[0][k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
        for k in ("training/rollout_log_probs_diff_mean", "training/rollout_log_probs_diff_max",
                  "rollout_corr/rollout_is_seq_max"):
            assert m2[0][k] == pytest.approx(m1[k], rel=1e-6), k
        assert m1["training/rollout_log_probs_diff_max"] == pytest.approx(0.07, abs=1e-6)  # row 7: 7 * 0.01 (float32)
        d0, d1 = g2.weights_digest()
        assert d0 == d1  # replicas bit-identical after every update
        w1 = g1.state_dict_copy()[0]
        w2 = g2.state_dict_copy()[0]
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
    finally:
        shutdown_worker_group(g1, p1)
        shutdown_worker_group(g2, p2)


def test_on_policy_update_without_old_pass_equals_the_recomputed_one(local_worker_factory):
    spec = WorkerSpec(model_name=MODEL, lr=1e-3, warmup_steps=0, micro_batch_size=2)
    w1, w2 = local_worker_factory(spec), local_worker_factory(spec)
    recomputed = with_targets(w1, fixed_batch(), [1.0, -1.0, 0.5, -0.5])
    recomputed.meta_info["n_mini_batches"] = 1
    shortcut = DataProto.from_dict({k: v.clone() for k, v in recomputed.batch.items()},
                                   meta_info={"n_mini_batches": 1, "old_is_current": True})
    shortcut.batch["old_log_probs"].fill_(123.0)  # must not be read
    m1, m2 = w1.update_actor(recomputed), w2.update_actor(shortcut)
    assert {k: v for k, v in m1.items() if k.startswith("actor/")} == \
        {k: v for k, v in m2.items() if k.startswith("actor/")}
    s1, s2 = w1.model.state_dict(), w2.model.state_dict()
    for k in s1:
        torch.testing.assert_close(s2[k], s1[k], atol=0, rtol=0)


@pytest.mark.parametrize("skip", [True, False])
def test_all_zero_advantage_step_is_skipped_not_replayed_by_adam_momentum(local_worker_factory, skip):
    """After an informative update, a mini-batch whose advantages are all 0 carries no reward signal.
    Without the skip AdamW still moves every weight (momentum of the last step, KL noise, weight
    decay) by a step as large as the informative one; with it the weights and the warmup stand still."""
    spec = WorkerSpec(model_name=MODEL, lr=1e-3, warmup_steps=2, micro_batch_size=2, kl_coef=0.01,
                      skip_zero_advantage=skip)
    w = local_worker_factory(spec)
    batch = with_targets(w, fixed_batch(), [1.0, -1.0, 0.5, -0.5])
    batch.meta_info["n_mini_batches"] = 1
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    m1 = w.update_actor(batch)
    after_first = {k: v.clone() for k, v in w.model.state_dict().items()}
    first_step = max(float((after_first[k] - before[k]).abs().max()) for k in before)
    flat = with_targets(w, fixed_batch(seed=1), [0.0, 0.0, 0.0, 0.0])
    flat.meta_info["n_mini_batches"] = 1
    m2 = w.update_actor(flat)
    moved = max(float((w.model.state_dict()[k] - after_first[k]).abs().max()) for k in before)
    assert m1["actor/skipped_updates"] == 0.0 and "actor/grad_norm" in m1
    if skip:
        assert moved == 0.0 and m2["actor/skipped_updates"] == 1.0 and "actor/grad_norm" not in m2
        assert w.scheduler.get_last_lr()[0] == m2["actor/lr"]  # the warmup did not advance
    else:
        assert moved > 0.5 * first_step  # a full-size step that no reward asked for
        assert m2["actor/skipped_updates"] == 0.0


def test_only_the_mini_batches_without_signal_are_skipped(local_worker_factory):
    w = local_worker_factory(WorkerSpec(model_name=MODEL, lr=1e-3, micro_batch_size=2, skip_zero_advantage=True))
    batch = with_targets(w, fixed_batch(), [0.0, 0.0, 1.0, -1.0])  # mini-batch 0 flat, mini-batch 1 not
    batch.meta_info["n_mini_batches"] = 2
    m = w.update_actor(batch)
    assert m["actor/skipped_updates"] == 0.5
    mask = batch.batch["response_mask"][2:].float()
    # the one update is mini-batch 1's: on-policy its loss is -token_mean(A) over its own tokens
    expected = -float((batch.batch["advantages"][2:] * mask).sum() / mask.sum())
    assert m["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)


def anchor_pool(seed=0):
    """Three demonstrations of different lengths; loss_mask 0 on a prompt and an 'observation' span."""
    from search_r1.trainer.warmstart import Demo

    g = torch.Generator().manual_seed(seed)
    demos = []
    for n, prompt in ((9, 3), (14, 4), (6, 2)):
        ids = torch.randint(3, 1000, (n,), generator=g).tolist()
        mask = [0] * prompt + [1] * (n - prompt)
        mask[prompt + 2] = 0  # an observation token between policy tokens
        demos.append(Demo("q", ("a",), "", tuple(ids), tuple(mask), prompt))
    return demos


def reference_nll(model, demos, weights=None):
    """Token mean of -log p(x_t | x_<t) over every demo's loss-masked tokens, one unpadded forward each;
    `weights` (one list per demo, in place of its loss_mask) makes it the weighted mean."""
    total, count = 0.0, 0.0
    for i, d in enumerate(demos):
        ids = torch.tensor([d.input_ids])
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        m = torch.tensor((d.loss_mask if weights is None else weights[i])[1:], dtype=torch.float32)
        total = total - (picked * m).sum()
        count += float(m.sum())
    return total / count


def test_anchor_gradient_is_coef_times_the_demonstrations_token_mean_nll(local_worker_factory):
    """algorithm.anchor_coef: the micro-batched, right-padded anchor term equals an unpadded
    reference NLL over the loss-masked tokens of the rows named (three demos of different lengths
    over two micro-batches), and its gradient is the coefficient times the reference's."""
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2, anchor_coef=0.5))
    pool = anchor_pool()
    w.set_anchor(pool)
    rows = [2, 0, 1]

    def grads(worker_pool, coef=0.5):
        w.anchor = worker_pool
        w.spec = dataclasses.replace(w.spec, anchor_coef=coef)
        w.optimizer.zero_grad(set_to_none=False)
        value = w.accumulate_anchor_grads(rows)
        return value, torch.cat([p.grad.reshape(-1).clone() for p in w.params])

    value, g = grads(pool)
    w.optimizer.zero_grad(set_to_none=False)
    expected = reference_nll(w.model, [pool[i] for i in rows])
    (0.5 * expected).backward()
    g_ref = torch.cat([p.grad.reshape(-1).clone() for p in w.params])
    assert value == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(grads(pool, coef=1.5)[1], 3.0 * g, atol=1e-6, rtol=1e-4)
    # control: the observation token scored too gives another value (the mask is what is scored)
    unmasked = [dataclasses.replace(d, loss_mask=tuple(1 if i >= d.prompt_length else m for i, m in enumerate(d.loss_mask)))
                for d in pool]
    assert grads(unmasked)[0] != pytest.approx(value, rel=1e-3)


def test_anchor_plan_weight_scales_the_first_round_in_the_token_mean(local_worker_factory):
    """algorithm.anchor_plan_weight: the first round (anchor_pool's two policy tokens before its
    observation token) counts plan_weight times in the anchor's token mean, the later policy tokens
    once; value and gradient match a hand-weighted reference, and differ from the plain mean."""
    pool = anchor_pool()
    rows = [2, 0, 1]
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2, anchor_coef=1.0,
                                        anchor_plan_weight=4.0))
    w.set_anchor(pool)
    w.optimizer.zero_grad(set_to_none=False)
    value = w.accumulate_anchor_grads(rows)
    g = torch.cat([p.grad.reshape(-1).clone() for p in w.params])

    hand = []  # anchor_pool: prompt, two policy tokens (the first round), one observation token, the rest
    for i in rows:
        d = pool[i]
        hand.append([0.0] * d.prompt_length + [4.0, 4.0, 0.0] + [1.0] * (len(d.input_ids) - d.prompt_length - 3))
        assert [x > 0 for x in hand[-1]] == [bool(m) for m in d.loss_mask]
    w.optimizer.zero_grad(set_to_none=False)
    expected = reference_nll(w.model, [pool[i] for i in rows], hand)
    expected.backward()
    g_ref = torch.cat([p.grad.reshape(-1).clone() for p in w.params])
    assert value == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-4)
    # control: the plain token mean (every policy token once) has another gradient; the random tiny
    # model's NLLs are all near ln(vocab), so its value differs by less than 0.1% and is not the test
    w.optimizer.zero_grad(set_to_none=False)
    reference_nll(w.model, [pool[i] for i in rows]).backward()
    g_plain = torch.cat([p.grad.reshape(-1).clone() for p in w.params])
    assert not torch.allclose(g, g_plain, atol=1e-6, rtol=1e-2)


def test_update_with_anchor_rows_reports_the_anchor_loss_and_moves_differently(local_worker_factory):
    spec = WorkerSpec(model_name=MODEL, lr=1e-3, warmup_steps=0, micro_batch_size=2, anchor_coef=1.0)
    after = {}
    for rows in ([], [0, 1]):
        w = local_worker_factory(spec)
        w.set_anchor(anchor_pool())
        batch = with_targets(w, fixed_batch(), [1.0, -1.0, 0.5, -0.5])
        batch.meta_info.update(n_mini_batches=1, anchor_rows=rows)
        with torch.no_grad():
            expected = float(reference_nll(w.model, anchor_pool()[:2]))
        m = w.update_actor(batch)
        if rows:
            assert m["actor/anchor_loss"] == pytest.approx(expected, rel=1e-5)
        else:
            assert "actor/anchor_loss" not in m
        after[bool(rows)] = torch.cat([p.detach().reshape(-1).clone() for p in w.params])
    assert not torch.allclose(after[False], after[True])


def test_llds_gradient_is_coef_times_the_pure_terms_and_update_reports_it(local_worker_factory):
    from search_r1.algos import llds_loss

    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2))
    batch = with_targets(w, fixed_batch(), [1.0, -1.0, 0.5, 0.0])
    # pi_old above pi_theta on the first two response tokens: the likelihood "fell" there
    batch.batch["old_log_probs"][:, :2] += 0.5
    mask = batch.batch["response_mask"].float()
    norm = float(mask.sum())

    def grads(coef):
        w.spec = dataclasses.replace(w.spec, llds_coef=coef, llds_gate="response")
        w.optimizer.zero_grad(set_to_none=False)
        w.accumulate_grads(batch, norm=norm)
        return torch.cat([p.grad.reshape(-1).clone() for p in w.params])

    g0, g1 = grads(0.0), grads(0.7)
    # the term alone, from the pure function on the worker's own forward
    w.optimizer.zero_grad(set_to_none=False)
    for rows in (slice(0, 2), slice(2, 4)):
        logp, _ = w._forward_logprobs(w.model, batch, rows, with_entropy=False)
        term, _ = llds_loss(logp, batch.batch["old_log_probs"][rows], batch.batch["advantages"][rows], mask[rows],
                            gate="response", normalizer=norm)
        term.backward()
    g_term = torch.cat([p.grad.reshape(-1).clone() for p in w.params])
    assert g_term.abs().sum() > 0
    torch.testing.assert_close(g1, g0 + 0.7 * g_term, atol=1e-6, rtol=1e-5)
    # update_actor logs the term and, given `correct`, the likelihood diagnostics
    batch.batch["correct"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    batch.meta_info["n_mini_batches"] = 1
    m = w.update_actor(batch)
    assert m["actor/llds_loss"] > 0 and 0 < m["actor/llds_gated_token_frac"] <= 1
    assert m["likelihood/correct_logp_new"] < m["likelihood/correct_logp_old"]  # old was raised by 0.5
    assert 0 < m["likelihood/preserved_fell_frac"] <= 1
