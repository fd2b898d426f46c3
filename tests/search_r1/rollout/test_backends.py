"""HFGenerator on the real tiny Qwen3 (SmolLM2 tokenizer): stops, logprobs, determinism, batching.

References are independent of the generator: log-probs from one teacher-forced forward pass over
prompt + output (no cache, no padding), stop positions from `find_stop` (full-prefix decoding, not the
generator's windowed tail check), sampling math from hand-computed distributions.
"""
import math

import pytest
import torch

from search_r1.models import load_model_and_tokenizer
from search_r1.prompts import apply_chat_template
from search_r1.rollout.backends import (GenOutput, Generator, HFGenerator, SamplingParams, filtered_logits,
                                        find_stop, sample_from_logits)

QUESTIONS = ["Who wrote the play Hamlet?", "What is the tallest mountain on Earth, and how high is it?", "Hi"]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == 3  # different lengths: left padding is exercised
    return model, tokenizer, prompts


def teacher_forced(model, prompt, out, temperature=1.0):
    """log p(out[i] | prompt + out[:i]) from one full forward pass (logits / temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float() / temperature  # (T, V)
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


def test_is_a_generator_and_rejects_bad_input(tiny):
    model, tok, prompts = tiny
    gen = HFGenerator(model, tok)
    assert isinstance(gen, Generator)
    assert gen.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        gen.generate([prompts[0], []], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="batch_size"):
        HFGenerator(model, tok, batch_size=0)
    with pytest.raises(ValueError, match="logprobs_mode"):
        HFGenerator(model, tok, logprobs_mode="softmax")


def test_greedy_is_deterministic_and_batch_equals_single(tiny):
    model, tok, prompts = tiny
    params = SamplingParams(max_tokens=12, temperature=0)
    gen = HFGenerator(model, tok)
    batch = gen.generate(prompts, params)
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in batch]
    for prompt, out in zip(prompts, batch):
        single = gen.generate([prompt], params)[0]
        assert single.token_ids == out.token_ids
        assert single.logprobs == pytest.approx(out.logprobs, abs=1e-4)
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
    # Greedy really is the argmax: every step's token is the teacher-forced mode.
    with torch.no_grad():
        full = torch.tensor([prompts[0] + batch[0].token_ids])
        argmax = model(full).logits[0, len(prompts[0]) - 1:-1].argmax(-1).tolist()
    assert argmax == batch[0].token_ids


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=16, temperature=0),
    SamplingParams(max_tokens=16, temperature=1.0, seed=7),
    SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=50, seed=7),
], ids=["greedy", "t1", "t0.7-top_p-top_k"])
def test_raw_logprobs_equal_teacher_forced_pass(tiny, params):
    model, tok, prompts = tiny
    outs = HFGenerator(model, tok, batch_size=2).generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) == 16
        ref = teacher_forced(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_processed_logprobs_are_of_the_tempered_distribution(tiny):
    model, tok, prompts = tiny
    params = SamplingParams(max_tokens=10, temperature=0.5, seed=3)
    raw = HFGenerator(model, tok).generate(prompts[:1], params)[0]
    processed = HFGenerator(model, tok, logprobs_mode="processed").generate(prompts[:1], params)[0]
    assert processed.token_ids == raw.token_ids  # the mode changes what is reported, not the sample
    ref = teacher_forced(model, prompts[0], raw.token_ids, temperature=0.5)
    assert max(abs(a - b) for a, b in zip(ref, processed.logprobs)) < 1e-4
    assert max(abs(a - b) for a, b in zip(raw.logprobs, processed.logprobs)) > 0.1


def test_seeded_sampling_is_reproducible_and_row_independent(tiny):
    model, tok, prompts = tiny
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11)
    gen = HFGenerator(model, tok)
    first = gen.generate(prompts, params)
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in first]
    # Each row has its own RNG stream: chunking the batch differently changes nothing.
    chunked = HFGenerator(model, tok, batch_size=1, sort_by_length=False).generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in first]
    other = gen.generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=12))
    assert [o.token_ids for o in other] != [o.token_ids for o in first]
    # A GRPO group (same prompt repeated) must not collapse to identical samples.
    group = gen.generate([prompts[0]] * 4, params)
    assert len({tuple(o.token_ids) for o in group}) == 4


def test_a_next_round_prefills_only_its_new_tokens_on_the_kept_cache(tiny):
    """A rollout's next round (context + sampled tokens + observation) reuses the previous call's KV
    cache and samples what a generator without it samples; changed weights drop the cache."""
    model, tok, prompts = tiny
    obs = [tok.encode(f"\n<information>Doc {i}: {'text ' * (3 * i)}</information>\n", add_special_tokens=False)
           for i in range(4)]
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=5)
    gen, fresh = HFGenerator(model, tok), HFGenerator(model, tok, reuse_kv=False)
    first = [prompts[0], prompts[0], prompts[1], prompts[2]]
    outs = gen.generate(first, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh.generate(first, params)]
    assert gen.stats["reused_tokens"] == 0
    # rows 0-2 continue; row 3 kept only part of its output (a budget cut: no cached prefix); row 4 is new
    second = [p + o.token_ids + ob for p, o, ob in zip(first[:3], outs, obs)]
    second += [first[3] + outs[3].token_ids[:4] + obs[3], prompts[1]]
    reused = sum(len(p) + len(o.token_ids) - 1 for p, o in zip(first[:3], outs))
    cont = gen.generate(second, params)
    assert gen.stats["reused_tokens"] == reused
    expected = fresh.generate(second, params)
    assert fresh.stats["reused_tokens"] == 0
    assert [o.token_ids for o in cont] == [o.token_ids for o in expected]
    for a, b, prompt in zip(cont, expected, second):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.logprobs == pytest.approx(teacher_forced(model, prompt, a.token_ids), abs=1e-4)
    # a third round on the second's caches, then a weight change (an optimizer step) in between
    third = [p + o.token_ids + obs[0] for p, o in zip(second, cont)]
    assert [o.token_ids for o in gen.generate(third, params)] == [o.token_ids for o in fresh.generate(third, params)]
    assert gen.stats["reused_tokens"] == reused + sum(len(p) + len(o.token_ids) - 1 for p, o in zip(second, cont))
    before = gen.stats["reused_tokens"]
    outs = gen.generate(first, params)
    weight = next(model.parameters())
    with torch.no_grad():
        weight.mul_(1.5)
    try:
        second = [p + o.token_ids + ob for p, o, ob in zip(first, outs, obs)]
        cont = gen.generate(second, params)
        assert gen.stats["reused_tokens"] == before
        assert [o.token_ids for o in cont] == [o.token_ids for o in fresh.generate(second, params)]
    finally:
        with torch.no_grad():
            weight.div_(1.5)


def test_a_group_prompt_is_prefilled_once_with_the_same_samples(tiny):
    """Repeated prompts (GRPO groups) share one prefill; every row still samples what it would alone."""
    model, tok, prompts = tiny
    batch = [prompts[0], prompts[0], prompts[1], prompts[0], prompts[1]]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    gen = HFGenerator(model, tok)
    shared = gen.generate(batch, params)
    assert gen.stats["prefilled_prompts"] == 2
    alone = HFGenerator(model, tok, batch_size=1)  # one row per batch: nothing to share
    single = alone.generate(batch, params)
    assert alone.stats["prefilled_prompts"] == 5
    assert [o.token_ids for o in shared] == [o.token_ids for o in single]
    for a, b in zip(shared, single):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    for out, prompt in zip(shared, batch):  # and they are the model's log-probs of those tokens
        assert out.logprobs == pytest.approx(teacher_forced(model, prompt, out.token_ids), abs=1e-4)
    assert len({tuple(o.token_ids) for o in shared[:2] + shared[3:4]}) == 3


def test_top_k_1_equals_greedy(tiny):
    model, tok, prompts = tiny
    gen = HFGenerator(model, tok)
    greedy = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    topk1 = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=1.3, top_k=1, seed=5))
    assert [o.token_ids for o in topk1] == [o.token_ids for o in greedy]


def _clean_piece(tok, token_id):
    text = tok.decode([token_id])
    return text if text.strip() and "\ufffd" not in text else None


def test_stop_strings_end_exactly_at_the_completing_token(tiny):
    model, tok, prompts = tiny
    base = SamplingParams(max_tokens=24, temperature=1.0, seed=21)
    gen = HFGenerator(model, tok)
    free = gen.generate(prompts, base)
    row0 = free[0].token_ids
    # Build stop strings from what row 0 actually samples (seeded, so the rerun follows the same path):
    single = next(_clean_piece(tok, t) for t in row0[8:] if _clean_piece(tok, t))  # one whole token
    span = tok.decode(row0[10:13])                                              # across 3 tokens
    piece = next(p for p in (_clean_piece(tok, t) for t in row0[5:]) if p and len(p.strip()) >= 3)
    partial = piece.strip()[:2]                                                 # ends inside a token
    for stop in [(single,), (span,), (partial,), ("never-sampled-@@@", span)]:
        outs = gen.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=21, stop=stop))
        for full, out in zip(free, outs):
            keep = find_stop(full.token_ids, tok, stop)
            if keep is None:
                assert out.token_ids == full.token_ids and out.finish_reason == "length"
                continue
            assert out.token_ids == full.token_ids[:keep], stop
            assert out.logprobs == pytest.approx(full.logprobs[:keep], abs=1e-4)
            assert out.finish_reason == "stop"
            text = tok.decode(out.token_ids)
            assert any(s in text for s in stop)
            assert not any(s in tok.decode(out.token_ids[:-1]) for s in stop)  # no token too many
        assert find_stop(row0, tok, stop) is not None and len(outs[0].token_ids) < 24  # row 0 did stop
    # The multi-token stop really needed several tokens: it is not inside its last token alone.
    keep = find_stop(row0, tok, (span,))
    assert span not in tok.decode(row0[keep - 1:keep])


def test_eos_ends_a_row_and_is_kept(tiny):
    model, tok, prompts = tiny
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=4)
    free = HFGenerator(model, tok).generate(prompts, params)
    eos = free[1].token_ids[6]
    outs = HFGenerator(model, tok, eos_token_ids=[eos]).generate(prompts, params)
    for full, out in zip(free, outs):
        if eos in full.token_ids:
            cut = full.token_ids.index(eos) + 1
            assert out.token_ids == full.token_ids[:cut] and out.finish_reason == "stop"
        else:
            assert out.token_ids == full.token_ids and out.finish_reason == "length"
    assert len(outs[1].token_ids) <= 7


def test_filtered_logits_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top-p 0.8: mass of better tokens = [0, .5, .8, .95]; keep where < 0.8 -> tokens 0 and 1.
    kept = torch.isfinite(filtered_logits(logits, 1.0, top_p=0.8)).tolist()[0]
    assert kept == [True, True, False, False]
    assert torch.isfinite(filtered_logits(logits, 1.0, top_p=0.85)).tolist()[0] == [True, True, True, False]
    assert torch.isfinite(filtered_logits(logits, 1.0, top_k=3)).tolist()[0] == [True, True, True, False]
    # Temperature 0.5 squares the probabilities before renormalising: p_i^2 / sum p^2.
    probs = torch.softmax(filtered_logits(logits, 0.5), -1)[0]
    expected = torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365
    assert torch.allclose(probs, expected, atol=1e-6)


def test_inverse_cdf_sampling_hand_computed():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 4))
    # cumulative [0.5, 0.8, 1.0]: u=0.5 -> 0, u=0.51 -> 1, u=0.8 -> 1, u=1.0 -> 2
    got = sample_from_logits(z, torch.tensor([0.5, 0.51, 0.8, 1.0], dtype=torch.float64)).tolist()
    assert got == [0, 1, 1, 2]
    # A zero-probability token is never chosen, even for the smallest u.
    z0 = torch.tensor([[float("-inf"), 0.0, 0.0]])
    assert sample_from_logits(z0, torch.tensor([1e-12], dtype=torch.float64)).item() == 1


def test_outputs_are_genoutputs_with_consistent_lengths(tiny):
    model, tok, prompts = tiny
    outs = HFGenerator(model, tok).generate(prompts, SamplingParams(max_tokens=5, temperature=0.9, seed=1))
    for out in outs:
        assert isinstance(out, GenOutput)
        assert len(out.token_ids) == len(out.logprobs) == 5
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)


def test_generation_restores_the_callers_train_mode(tiny):
    model, tok, prompts = tiny
    gen = HFGenerator(model, tok)
    model.train()
    try:
        train_mode = gen.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))[0]
        assert model.training  # the trainer's module is left as it was
    finally:
        model.eval()
    assert train_mode.token_ids == gen.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
