"""Format warm-start: demonstrations are well formed and grounded in real retrieved passages, the
loss mask covers exactly the policy's tokens, a few SFT steps lower the loss, the result is cached."""
import json
import re

import pytest
import torch

from search_r1.dtypes import machine_description
from search_r1.models import load_model_and_tokenizer, load_tokenizer
from search_r1.protocol import ObservationEncoder, decode_ids
from search_r1.rewards import check_format_correctness, compute_reward
from search_r1.search import RetrieverClient
from search_r1.trainer.warmstart import (Demo, _batches, build_demos, collate, ensure_warmstart, lr_at,
                                          masked_sft_loss, supervised_tokens, token_mean_sft_backward,
                                          token_weights, train)

MODEL = "tiny-random-qwen3"
OBS, TURN = 64, 64


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def client(retriever_server):
    return RetrieverClient(retriever_server.url, topk=2)


@pytest.fixture(scope="module")
def demos(tokenizer, client, synth_world):
    return build_demos(tokenizer, client, [synth_world / "train.parquet"], n_examples=8, seed=0,
                       max_obs_length=OBS, max_tokens_per_turn=TURN)


def test_demos_get_the_max_seed_reward_and_hold_real_retrieved_evidence(demos, tokenizer, client):
    assert len(demos) == 8
    for d in demos:
        text = d.response_text
        assert check_format_correctness(text) == 0.5
        assert compute_reward(text, list(d.golden_answers)) == 2.5
        assert text.endswith(tokenizer.eos_token)
        info = re.search(r"<information>(.*)</information>", text, re.DOTALL).group(1)
        assert any(g.lower() in info.lower() for g in d.golden_answers)  # copy from evidence
        # the observation is exactly what the rollout would append for this search
        query = re.search(r"<search> (.*?) </search>", text).group(1)
        assert query == d.question
        obs_ids = ObservationEncoder(tokenizer).encode(["search"], client.batch_search([query]), [OBS])[0]
        assert decode_ids(tokenizer, [obs_ids])[0] in text


def test_loss_mask_covers_exactly_the_generated_tokens(demos, tokenizer):
    for d in demos:
        assert len(d.loss_mask) == len(d.input_ids)
        assert not any(d.loss_mask[: d.prompt_length])
        kept = [t for t, m in zip(d.input_ids, d.loss_mask) if m]
        masked_response = [t for t, m in zip(d.input_ids[d.prompt_length:], d.loss_mask[d.prompt_length:]) if not m]
        gen = tokenizer.decode(kept, skip_special_tokens=False)
        assert gen.startswith("<think>") and "<search>" in gen and gen.endswith("</answer>" + tokenizer.eos_token)
        assert "<information>" not in gen and "Doc 1" not in gen
        obs = tokenizer.decode(masked_response, skip_special_tokens=False)
        assert obs.startswith("\n\n<information>") and obs.endswith("</information>\n\n")


def test_bad_settings_fail_naming_the_fix(tokenizer, client, synth_world):
    with pytest.raises(ValueError, match="max_tokens_per_turn"):
        build_demos(tokenizer, client, [synth_world / "train.parquet"], 4, 0, OBS, max_tokens_per_turn=3)
    with pytest.raises(ValueError, match="warmstart.format='chat'.*allowed"):
        build_demos(tokenizer, client, [synth_world / "train.parquet"], 4, 0, OBS, TURN, fmt="chat")
    with pytest.raises(ValueError, match="unknown protocol"):
        build_demos(tokenizer, client, [synth_world / "train.parquet"], 4, 0, OBS, TURN, protocol="xml")


def test_two_hop_demos_search_the_bridge_then_its_attribute(tokenizer, client, synth_world):
    import pandas as pd

    rows = {r["question"]: r["extra_info"] for r in pd.read_parquet(synth_world / "train.parquet").to_dict("records")}
    demos = build_demos(tokenizer, client, [synth_world / "train.parquet"], n_examples=8, seed=0,
                        max_obs_length=OBS, max_tokens_per_turn=TURN, two_hop_share=0.5)
    assert sorted(d.hops for d in demos) == [1] * 4 + [2] * 4
    for d in (d for d in demos if d.hops == 2):
        extra, text = rows[d.question], d.response_text
        assert check_format_correctness(text) == 0.5
        assert compute_reward(text, list(d.golden_answers)) == 2.5
        queries = re.findall(r"<search> (.*?) </search>", text)
        assert queries == [d.question, extra["follow_up"]] and extra["bridge"] in extra["follow_up"]
        info = re.findall(r"<information>(.*?)</information>", text, re.DOTALL)
        assert len(info) == 2 and extra["bridge"] in info[0]  # the bridge is read from the first search
        assert any(g.lower() in info[1].lower() for g in d.golden_answers)  # the answer from the second
        # three policy turns: search, search, answer; both observations masked
        policy = tokenizer.decode([t for t, m in zip(d.input_ids, d.loss_mask) if m])
        assert policy.count("<search>") == 2 and "<information>" not in policy


def test_no_search_share_answers_some_questions_from_memory_under_the_search_prompt(tokenizer, client, synth_world):
    from search_r1.prompts import apply_chat_template

    import pandas as pd

    prompts = {r["question"]: apply_chat_template(tokenizer, list(r["prompt"]))
               for r in pd.read_parquet(synth_world / "train.parquet").to_dict("records")}
    demos = build_demos(tokenizer, client, [synth_world / "train.parquet"], n_examples=8, seed=0,
                        max_obs_length=OBS, max_tokens_per_turn=TURN, no_search_share=0.25)
    memory = [d for d in demos if "<search>" not in d.response_text]
    searched = [d for d in demos if "<search>" in d.response_text]
    assert len(memory) == 2 and len(searched) == 6
    assert not {d.question for d in memory} & {d.question for d in searched}  # no question taught both ways
    for d in demos:  # every kind under the run's own search prompt, at the full seed reward
        assert list(d.input_ids[: d.prompt_length]) == prompts[d.question]
        assert compute_reward(d.response_text, list(d.golden_answers)) == 2.5
    for d in memory:
        assert d.response_text.startswith("<think> I answer from what I know. </think>")
        assert all(d.loss_mask[d.prompt_length:])
    # the searched ones are the same demonstrations the share-free call draws first
    plain = build_demos(tokenizer, client, [synth_world / "train.parquet"], n_examples=6, seed=0,
                        max_obs_length=OBS, max_tokens_per_turn=TURN)
    assert sorted(d.question for d in searched) == sorted(d.question for d in plain)
    with pytest.raises(ValueError, match="no_search_share.*format=search"):
        build_demos(tokenizer, client, [synth_world / "train.parquet"], 4, 0, OBS, TURN, fmt="rag",
                    no_search_share=0.5)
    with pytest.raises(ValueError, match="> 1. Fix"):
        build_demos(tokenizer, client, [synth_world / "train.parquet"], 4, 0, OBS, TURN, two_hop_share=0.5,
                    no_search_share=0.75)


@pytest.mark.parametrize("fmt", ["no_search", "rag"])
def test_baseline_demos_use_the_eval_prompt_and_answer_in_one_turn(fmt, tokenizer, client, synth_world):
    from search_r1.prompts import apply_chat_template, baseline_messages, rag_documents

    demos = build_demos(tokenizer, client, [synth_world / "train.parquet"], n_examples=4, seed=0,
                        max_obs_length=OBS, max_tokens_per_turn=TURN, fmt=fmt, two_hop_share=0.5)
    assert sorted(d.hops for d in demos) == [1, 1, 2, 2]
    for d in demos:
        docs = rag_documents(tokenizer, client.batch_search([d.question]), OBS)[0] if fmt == "rag" else None
        assert list(d.input_ids[: d.prompt_length]) == apply_chat_template(tokenizer, baseline_messages(d.question, docs))
        assert all(d.loss_mask[d.prompt_length:])  # no observation: the whole response is the policy's
        assert "<search>" not in d.response_text and check_format_correctness(d.response_text) == 0.5
        assert compute_reward(d.response_text, list(d.golden_answers)) == 2.5


@pytest.mark.parametrize("agent_prompt", [False, True])
def test_tool_call_demos_in_the_form_the_prompt_shows(tokenizer, client, synth_world, tmp_path, agent_prompt):
    """tool_call demonstrations: a search tool call the protocol parser reads back as the question,
    a <tool_response> observation (masked) exactly as the rollout writes it, then the answer; the JSON
    form follows the prompt (the tool-call agent's prompt shows {"action": "web_search", ...})."""
    import pandas as pd

    from search_r1.agents.prompts import toolcall_messages
    from search_r1.protocol import parse_action

    train = synth_world / "train.parquet"
    if agent_prompt:
        frame = pd.read_parquet(train)
        frame["prompt"] = [toolcall_messages(q, budget=5, date="2026-11-23") for q in frame["question"]]
        train = tmp_path / "train_agent.parquet"
        frame.to_parquet(train)
    demos = build_demos(tokenizer, client, [train], 4, 0, OBS, 96, protocol="tool_call")
    assert len(demos) == 4
    for d in demos:
        kept = tokenizer.decode([t for t, m in zip(d.input_ids, d.loss_mask) if m], skip_special_tokens=False)
        obs = tokenizer.decode([t for t, m in zip(d.input_ids[d.prompt_length:], d.loss_mask[d.prompt_length:])
                                if not m], skip_special_tokens=False)
        action = parse_action(kept, "tool_call")
        assert (action.kind, action.content) == ("search", d.question)
        assert ('"action": "web_search"' in kept) is agent_prompt and ('"name": "search"' in kept) is not agent_prompt
        assert obs.startswith("\n\n<tool_response>") and obs.endswith("</tool_response>\n\n")
        assert "<information>" not in d.response_text and kept.endswith("</answer>" + tokenizer.eos_token)
        assert parse_action(d.response_text[d.response_text.index("</tool_call>"):], "tool_call").content == \
            d.golden_answers[0]


@pytest.mark.parametrize("plan_weight", [1.0, 5.0])
def test_masked_loss_matches_a_hand_computed_reference(demos, tokenizer, plan_weight):
    """The (weighted) token mean over the policy tokens; plan_weight counts the first round's tokens,
    from prompt_length up to the first observation, that many times."""
    model, _ = load_model_and_tokenizer(MODEL)
    ids, attn, mask = collate(demos[:2], tokenizer.pad_token_id, plan_weight=plan_weight)
    with torch.no_grad():
        got = masked_sft_loss(model, ids, attn, mask)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    total, count, weight = 0.0, 0, 0.0
    for b, d in enumerate(demos[:2]):
        first_obs = d.loss_mask.index(0, d.prompt_length)  # the first round is prompt_length..first_obs-1
        for t in range(1, len(d.input_ids)):
            if d.loss_mask[t]:
                w = plan_weight if t < first_obs else 1.0
                total -= w * float(logp[b, t - 1, ids[b, t]])
                count += 1
                weight += w
    assert count == sum(sum(d.loss_mask) for d in demos[:2])
    assert supervised_tokens(demos[:2], plan_weight) == pytest.approx(weight)
    assert float(got) == pytest.approx(total / weight, rel=1e-4)


def test_token_weights_scale_exactly_the_first_round(demos, tokenizer):
    """plan_weight multiplies the first round's policy tokens (the think that chooses one search or
    two, and the first query, up to the first observation) and nothing else; 1 is the loss_mask."""
    for d in demos:
        assert token_weights(d) == [float(m) for m in d.loss_mask]
        w = token_weights(d, 3.0)
        heavy = [t for t, x in enumerate(w) if x == 3.0]
        assert heavy == list(range(heavy[0], heavy[-1] + 1)) and heavy[0] == d.prompt_length
        first = tokenizer.decode([d.input_ids[t] for t in heavy])
        assert first.startswith("<think>") and first.rstrip().endswith("</search>"), first
        assert ("Two steps" in first) == (d.hops == 2)
        assert all(x == float(m) for t, (x, m) in enumerate(zip(w, d.loss_mask)) if t not in heavy)
        assert d.loss_mask[heavy[-1] + 1] == 0  # the observation starts right after it


def test_micro_batched_backward_is_the_whole_batch_token_mean(demos, tokenizer):
    """Uneven parts weighted by their token share give the gradient of one token mean over the batch
    (not the mean of per-part means), scaled; the returned value is that token mean, unscaled."""
    model, _ = load_model_and_tokenizer(MODEL)
    batch = demos[:5]
    assert len({supervised_tokens([d]) for d in batch}) > 1  # unequal parts, or the weighting is untested

    model.zero_grad()
    whole = masked_sft_loss(model, *collate(batch, tokenizer.pad_token_id))
    (0.5 * whole).backward()
    ref = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    got = token_mean_sft_backward(model, [batch[:1], batch[1:4], batch[4:]], tokenizer.pad_token_id,
                                  supervised_tokens(batch), scale=0.5)
    assert got == pytest.approx(float(whole), rel=1e-5)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-7)

    model.zero_grad()  # the mean of per-part means, the bug the weighting avoids, is measurably different
    for part in ([batch[:1], batch[1:4], batch[4:]]):
        (0.5 * masked_sft_loss(model, *collate(part, tokenizer.pad_token_id)) / 3).backward()
    assert not all(torch.allclose(p.grad, r, rtol=1e-3, atol=1e-6) for p, r in zip(model.parameters(), ref))


def test_bf16_sft_casts_each_weight_once_per_step(demos, tokenizer):
    """Two bf16 steps of two parts each: every weight matrix is cast to bf16 twice, once per step (per
    part before; a cast cached across the optimizer step would be used stale and count once)."""
    from tests._fixtures.weight_casts import WeightCasts

    model, _ = load_model_and_tokenizer(MODEL)
    with WeightCasts(model) as casts:
        train(model, demos[:4], tokenizer.pad_token_id, steps=2, batch_size=4, lr=1e-3, seed=0,
              compute_dtype="bfloat16", progress=False)
    assert set(casts.count) == casts.weights and set(casts.count.values()) == {2}


def test_sft_lowers_the_loss_and_the_result_is_cached(demos, client, synth_world, tmp_path, capsys):
    model, tok = load_model_and_tokenizer(MODEL)
    losses = train(model, demos[:2], tok.pad_token_id, steps=4, batch_size=2, lr=1e-3, seed=0,
                   compute_dtype="float32", progress=False)
    assert losses[-1] < losses[0]
    decayed, _ = load_model_and_tokenizer(MODEL)
    train(decayed, demos[:2], tok.pad_token_id, steps=4, batch_size=2, lr=1e-3, seed=0, compute_dtype="float32",
          progress=False, lr_schedule="linear")
    moved = [(p1 - p0).abs().sum() for p0, p1 in zip(load_model_and_tokenizer(MODEL)[0].parameters(),
                                                     decayed.parameters())]
    const = [(p1 - p0).abs().sum() for p0, p1 in zip(load_model_and_tokenizer(MODEL)[0].parameters(),
                                                     model.parameters())]
    assert sum(moved) < sum(const)  # the decayed steps move the weights less

    kw = dict(steps=1, batch_size=1, lr=1e-3, n_examples=2, seed=0, max_obs_length=OBS,
              max_tokens_per_turn=TURN, compute_dtype="float32", threads=1, cache_root=tmp_path,
              progress=False)
    path, meta = ensure_warmstart(MODEL, client, [synth_world / "train.parquet"], **kw)
    assert (path / "config.json").is_file() and meta["n_demos"] == 2
    loaded, _ = load_model_and_tokenizer(str(path))  # an ordinary HF directory
    stamp = (path / "warmstart.json").stat().st_mtime_ns
    assert meta["machine"] == machine_description() and meta["torch"] == torch.__version__
    capsys.readouterr()
    again, meta2 = ensure_warmstart(MODEL, client, [synth_world / "train.parquet"], **kw)
    assert again == path and (path / "warmstart.json").stat().st_mtime_ns == stamp  # reused, not retrained
    assert meta2["losses"] == meta["losses"]
    assert "another machine" not in capsys.readouterr().out
    # a cache copied from another CPU kind is used, and says where it was trained
    (path / "warmstart.json").write_text(json.dumps({**meta, "machine": "Intel Xeon, torch AVX512, amx_bf16"}))
    again, _ = ensure_warmstart(MODEL, client, [synth_world / "train.parquet"], **kw)
    out = capsys.readouterr().out
    assert again == path and "trained on another machine (Intel Xeon, torch AVX512, amx_bf16; this one: " in out
    other, _ = ensure_warmstart(MODEL, client, [synth_world / "train.parquet"], **{**kw, "seed": 1})
    assert other != path
    assert json.loads((other / "warmstart.json").read_text())["seed"] == 1
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 2


def test_a_run_that_waited_for_the_lock_reuses_what_the_first_one_built(tmp_path):
    """Two runs of a sweep start together: the second waits on the lock while the first trains, then
    reuses its directory instead of training again and replacing it under the first run's workers."""
    import threading

    from search_r1.models import file_lock
    from search_r1.trainer.warmstart import FORMAT_VERSION, META_FILE, train_and_save

    target = tmp_path / "key"
    result = {}
    with file_lock(tmp_path / ".key.lock"):  # the first run, training
        # A model name that cannot load: the waiting run fails if it trains instead of reusing.
        waiter = threading.Thread(target=lambda: result.update(meta=train_and_save(
            "no-such-model", None, [], target, {}, threads=1, label="warmstart")))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive()  # it waits for the lock
        target.mkdir()
        (target / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "loss_first": 2.0,
                                                     "loss_last": 0.5, "seed": 7}))
    waiter.join(timeout=30)
    assert result["meta"]["seed"] == 7 and result["meta"]["loss_last"] == 0.5


def _fake_demos(hops: list[int]) -> list[Demo]:
    return [Demo(f"q{i}", ("a",), "", (1, 2), (0, 1), 1, h) for i, h in enumerate(hops)]


def test_batches_hold_both_kinds_evenly_and_cycle_through_every_demo():
    demos = _fake_demos([1] * 12 + [2] * 4)  # a quarter two-hop
    batches = list(_batches(demos, batch_size=4, steps=12, seed=0, batching="stratified"))
    assert all(len(b) == 4 and sum(d.hops == 2 for d in b) == 1 for b in batches)
    seen = [d.question for b in batches[:4] for d in b if d.hops == 2]
    assert sorted(seen) == [f"q{i}" for i in range(12, 16)]  # one epoch of the two-hop demos in 4 steps
    singles = [d.question for b in batches[:4] for d in b if d.hops == 1]
    assert sorted(singles) == sorted(f"q{i}" for i in range(12))  # and of the single-hop ones


def test_batches_of_one_kind_are_shuffled_epochs():
    demos = _fake_demos([1] * 6)
    batches = list(_batches(demos, batch_size=4, steps=3, seed=0))
    flat = [d.question for b in batches for d in b]
    assert sorted(flat[:6]) == [f"q{i}" for i in range(6)] and len(flat) == 12
    assert list(_batches(demos, 4, 3, 0)) == batches  # deterministic for a seed


def test_lr_schedules():
    assert [lr_at(s, 4, 1.0, "constant") for s in range(4)] == [1.0] * 4
    assert [lr_at(s, 4, 1.0, "linear") for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    with pytest.raises(ValueError, match="warmstart.lr_schedule"):
        lr_at(0, 4, 1.0, "cosine")
