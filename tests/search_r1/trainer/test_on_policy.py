"""The sampler is the policy being trained: the bf16 rollout copy keeps fp32 rotary buffers, every
log-prob pass scores logits / temperature, the sampler's log-probs agree with the trainer's and the
mismatch is reported, and truncated importance weights scale the policy-gradient term when asked.
Model: tiny-random-qwen3, in-process workers."""
import math

import pytest
import torch
from verl import DataProto

from search_r1.rollout.backends import SamplingParams
from search_r1.trainer.workers import WorkerSpec, rollout_copy

from tests.search_r1.trainer.test_workers import MODEL, fixed_batch, with_targets


def _rotary(model):
    return model.model.rotary_emb


def test_bf16_rollout_copy_casts_parameters_only(local_worker_factory):
    w = local_worker_factory(WorkerSpec(model_name=MODEL, rollout_dtype="bfloat16"))
    policy, copy = w.model, w.rollout_model
    assert copy is not policy
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    buffers = dict(policy.named_buffers())
    assert {n: b.dtype for n, b in copy.named_buffers()} == {n: b.dtype for n, b in buffers.items()}
    assert "model.rotary_emb.inv_freq" in buffers and buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    # The angles position * inv_freq up to 1,024 positions: with fp32 inv_freq the bf16 copy's cos/sin
    # are the fp32 ones rounded to bf16 (error <= 2^-9 for values in [-1, 1]); a bf16 inv_freq
    # puts them off by 0.18 here (1.3 for SmolLM2).
    pos = torch.arange(1024)[None]
    cos32, sin32 = _rotary(policy)(torch.zeros(1, dtype=torch.float32), pos)
    cos16, sin16 = _rotary(copy)(torch.zeros(1, dtype=torch.bfloat16), pos)
    assert (cos16.float() - cos32).abs().max() <= 2 ** -9
    assert (sin16.float() - sin32).abs().max() <= 2 ** -9
    # Tied input/output embeddings stay one tensor in the copy.
    assert copy.get_input_embeddings().weight is copy.get_output_embeddings().weight


def test_bf16_copy_log_probs_on_a_long_sequence_within_weight_rounding():
    from search_r1.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(MODEL)
    model.eval()
    half = torch.randint(100, 20000, (1, 360), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([half, half], dim=1)  # (1, 720): the second half is predictable from the first

    def logp(m):
        with torch.no_grad():
            z = m(input_ids=ids).logits[0, :-1].float()
        return z.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)  # (719,)

    ref = logp(model)
    d = (logp(rollout_copy(model, torch.bfloat16)) - ref).abs()
    # bf16 weights and activations: measured mean 6.8e-4, max 3.6e-3, flat over positions
    assert d.mean() < 2e-3 and d.max() < 1e-2
    assert d[-100:].mean() < 2 * d[:100].mean() + 1e-3  # no growth with distance (positions intact)


def test_every_log_prob_pass_scores_logits_over_the_temperature(local_worker_factory):
    t = 0.5
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2, temperature=t))
    batch = fixed_batch()
    ids, attn, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    p = ids.shape[1] - batch.batch["responses"].shape[1]
    old = w.compute_log_prob(batch).batch["old_log_probs"]
    ref = w.compute_ref_log_prob(batch).batch["ref_log_prob"]
    for i in range(len(batch)):
        keep = attn[i].bool()
        x = ids[i][keep][None]
        with torch.no_grad():
            lg = (w.model(input_ids=x, position_ids=pos[i][keep][None]).logits[0] / t).log_softmax(-1)
        n_prompt, n_resp = int(attn[i, :p].sum()), int(attn[i, p:].sum())
        expected = lg[n_prompt - 1:n_prompt - 1 + n_resp].gather(-1, x[0, n_prompt:, None]).squeeze(-1)
        torch.testing.assert_close(old[i, :n_resp], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ref[i, :n_resp], expected, atol=1e-5, rtol=1e-5)
    # the policy pass of the update: on-policy, first mini-batch, the ratio is exactly 1
    batch = with_targets(w, batch, [1.0, -1.0, 0.5, -0.5])
    batch.meta_info["n_mini_batches"] = 1
    m = w.update_actor(batch)
    assert m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7) and m["actor/pg_clipfrac"] == 0.0


def _rollout_batch(w, prompts, temperature, max_tokens=12) -> DataProto:
    """Sample with the worker's own generate_sequences and lay the result out as the rollout does."""
    req = DataProto.from_dict(non_tensors={"prompt_ids": _objects(prompts)},
                              meta_info={"sampling": dict(max_tokens=max_tokens, temperature=temperature,
                                                          top_p=1.0, top_k=-1, stop=(), seed=7)})
    out = w.generate_sequences(req).non_tensor_batch
    P, R = max(map(len, prompts)), max(len(t) for t in out["token_ids"])
    n = len(prompts)
    ids = torch.zeros(n, P + R, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    rollout = torch.zeros(n, R)
    for i, (prompt, toks, lps) in enumerate(zip(prompts, out["token_ids"], out["logprobs"])):
        ids[i, P - len(prompt):P] = torch.tensor(prompt)
        ids[i, P:P + len(toks)] = torch.tensor(toks)
        attn[i, P - len(prompt):P + len(toks)] = 1
        rollout[i, :len(lps)] = torch.tensor(lps)
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": attn,
                                 "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "responses": ids[:, P:],
                                 "response_mask": attn[:, P:].clone(), "rollout_log_probs": rollout})
    batch.batch["old_log_probs"] = w.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["ref_log_prob"] = w.compute_ref_log_prob(batch).batch["ref_log_prob"]
    batch.batch["advantages"] = torch.tensor([1.0, -1.0])[:, None] * batch.batch["response_mask"]
    batch.meta_info["n_mini_batches"] = 1
    return batch


def _objects(values):
    import numpy as np

    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
def test_sampler_log_probs_match_the_trainer_and_the_mismatch_is_logged(local_worker_factory, rollout_dtype):
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2, temperature=0.7,
                                        rollout_dtype=rollout_dtype, compute_dtype="float32"))
    batch = _rollout_batch(w, [[5, 6, 7, 8, 9, 10], [11, 12, 13]], temperature=0.7)
    m = batch.batch["response_mask"].bool()
    old, rollout = batch.batch["old_log_probs"], batch.batch["rollout_log_probs"]
    d = (old - rollout).abs()[m].double()
    if rollout_dtype == "float32":  # the same weights: KV-cache decoding vs one full forward
        assert d.max() < 1e-4
    else:  # bf16 weights: a real, small mismatch
        assert 1e-4 < d.mean() < 0.05
    metrics = w.update_actor(batch)
    assert metrics["training/rollout_log_probs_diff_mean"] == pytest.approx(float(d.mean()), rel=1e-6, abs=1e-9)
    assert metrics["training/rollout_log_probs_diff_max"] == pytest.approx(float(d.max()), rel=1e-6, abs=1e-9)
    dp = (old.double().exp() - rollout.double().exp()).abs()[m]
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(float(dp.max()), rel=1e-6, abs=1e-9)
    seq = torch.exp(((old - rollout).double() * m).sum(-1))  # (2,) pi_old / pi_rollout per sequence
    assert metrics["rollout_corr/rollout_is_seq_mean"] == pytest.approx(float(seq.mean()), rel=1e-6)
    assert metrics["rollout_corr/rollout_is_seq_max"] == pytest.approx(float(seq.max()), rel=1e-6)


@pytest.mark.parametrize("level", ["none", "token", "sequence"])
def test_truncated_importance_weights_scale_the_policy_gradient(local_worker_factory, level):
    w = local_worker_factory(WorkerSpec(model_name=MODEL, micro_batch_size=2, rollout_is=level,
                                        rollout_is_threshold=2.0, kl_coef=0.0, entropy_coef=0.0))
    batch = with_targets(w, fixed_batch(), [1.0, -1.0, 0.5, -0.5])
    batch.meta_info["n_mini_batches"] = 1
    mask = batch.batch["response_mask"].float()
    # The sampler gave some tokens 1/3 of the trainer's probability (ratio 3, capped at 2), others
    # twice (ratio 0.5); rows 0 and 3 were sampled exactly.
    shift = torch.zeros_like(mask)
    shift[1, :] = math.log(3.0)
    shift[2, :] = math.log(0.5)
    batch.batch["rollout_log_probs"] = batch.batch["old_log_probs"] - shift
    if level == "none":
        weight = torch.ones_like(mask)
    elif level == "token":
        weight = torch.tensor([[1.0], [2.0], [0.5], [1.0]]).expand_as(mask)
    else:  # exp(sum of the row's shifts), capped: row 1 3^k -> 2, row 2 0.5^k
        k = mask.sum(-1)
        weight = torch.stack([torch.tensor(1.0), torch.tensor(2.0), 0.5 ** k[2], torch.tensor(1.0)])[:, None].expand_as(mask)
    # first update on-policy: ratio 1, so the loss is -token_mean(A * w)
    expected = -float((batch.batch["advantages"] * weight * mask).sum() / mask.sum())
    assert w.update_actor(batch)["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)


def test_training_rollouts_reject_top_p_below_one_and_greedy():
    from search_r1.trainer.config import RolloutConfig

    with pytest.raises(ValueError, match=r"rollout\.top_p.*nucleus"):
        RolloutConfig(top_p=0.95)
    with pytest.raises(ValueError, match=r"rollout\.temperature"):
        RolloutConfig(temperature=0.0)


def test_worker_spec_carries_temperature_and_correction(synth_world):
    from search_r1.trainer.config import TrainConfig
    from search_r1.trainer.main import worker_spec

    cfg = TrainConfig.from_dict({"rollout": {"temperature": 0.6},
                                 "algorithm": {"rollout_is": "token", "rollout_is_threshold": 3.0}})
    spec = worker_spec(cfg)
    assert (spec.temperature, spec.rollout_is, spec.rollout_is_threshold) == (0.6, "token", 3.0)
    assert SamplingParams(temperature=0.6).top_p == 1.0
