"""LLMGenerationManager.run_llm_loop end to end: scripted policy, real tokenizer, real retriever.

Each case asserts the exact token layout: the decoded text of the whole response, the decoded text
of the response_mask == 1 tokens (exactly what the policy sampled), padding sides, position ids,
logprob alignment and the per-row stats.
"""
import json

import numpy as np
import pytest
import requests
import torch
from verl import DataProto

from search_r1.prompts import apply_chat_template, make_messages
from search_r1.protocol import (
    failed_search_observation,
    invalid_action_observation,
    search_observation,
)
from search_r1.rollout.generation import GenerationConfig, LLMGenerationManager
from search_r1.rollout.tensor_helper import pad_ragged
from search_r1.search import MockSearchEngine, RetrieverClient, SearchEngine, render_passages

from tests._fixtures.retriever import corpus_titles, dead_url
from tests.search_r1.rollout.scripted import ScriptedGenerator, fake_logprob, smollm2_tokenizer

VELTRA = "Doc 1(Title: Veltra) Veltra was founded by Ana Osk.\n"
OSK = "Doc 1(Title: Ana Osk) Ana Osk was born in Mirren.\n"


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


class CountingEngine(SearchEngine):
    """Wraps an engine and records every batch_search call (the one-call-per-round contract)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def batch_search(self, queries):
        self.calls.append(list(queries))
        return self.inner.batch_search(queries)


def make_batch(tok, questions, protocol="tags"):
    prompts = [apply_chat_template(tok, make_messages(q, protocol)) for q in questions]
    ids, mask = pad_ragged(prompts, pad_value=tok.pad_token_id or 0, left=True)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": torch.clip(mask.cumsum(-1) - 1, 0)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(len(questions))], dtype=object)},
        meta_info={"origin": "test"},
    )
    return prompts, batch


def run(tok, questions, scripts, engine, protocol="tags", validation=False, **cfg):
    prompts, batch = make_batch(tok, questions, protocol)
    gen = ScriptedGenerator(tok, prompts, scripts, honour_stop=cfg.pop("honour_stop", True))
    config = GenerationConfig(protocol=protocol, **{"max_response_length": 400, **cfg})
    out = LLMGenerationManager(tok, gen, config, engine, is_validation=validation).run_llm_loop(batch)
    check_layout(out, prompts, config)
    return out, gen


def check_layout(out, prompts, config):
    """Invariants every output must satisfy, whatever the scripts did."""
    b = out.batch
    P = b["prompts"].shape[1]
    R = b["responses"].shape[1]
    assert b["input_ids"].shape == (len(prompts), P + R)
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    assert torch.equal(b["response_mask"], b["info_mask"][:, P:])
    assert torch.equal(b["info_mask"][:, :P], b["attention_mask"][:, :P])
    for i, p in enumerate(prompts):
        am = b["attention_mask"][i]
        n = int(am[P:].sum())
        # prompt left-padded, response right-padded
        assert am[: P - len(p)].sum() == 0 and am[P - len(p): P].all()
        assert b["prompts"][i, P - len(p):].tolist() == p
        assert am[P: P + n].all() and am[P + n:].sum() == 0
        # generated tokens are a subset of the real response tokens
        assert (b["response_mask"][i] <= am[P:]).all()
        # positions count real tokens from 0 with no gaps
        pos = b["position_ids"][i][am.bool()]
        assert pos.tolist() == list(range(len(p) + n))
        # logprobs: the scripted values on generated tokens, 0 elsewhere
        resp, rm, lp = b["responses"][i], b["response_mask"][i], b["rollout_log_probs"][i]
        assert (lp[rm == 0] == 0).all() and (lp[rm == 1] < 0).all()  # fake_logprob is always < 0
        # the limits: response budget, and the whole sequence the policy saw
        assert n <= config.max_response_length and len(p) + n <= config.max_prompt_length


def texts(out, tok, i):
    """(whole response text, generated-only text) of row i."""
    P = out.batch["prompts"].shape[1]
    am = out.batch["attention_mask"][i, P:].bool()
    resp, rm = out.batch["responses"][i], out.batch["response_mask"][i].bool()
    return tok.decode(resp[am]), tok.decode(resp[rm])


# -- mock engine: the rollout logic ------------------------------------------------------------
def test_batch_of_mixed_trajectories(tok):
    engine = CountingEngine(MockSearchEngine({"veltra": VELTRA, "osk": OSK}))
    s_search = "<think>I need the founder.</think>\n<search> who founded Veltra </search>"
    s_answer = "<think>Found it.</think>\n<answer> Ana Osk </answer>"
    s_second = "<think>Where was she born?</think>\n<search> Ana Osk birthplace </search>"
    scripts = [
        [s_search, s_answer],  # search then answer
        ["<answer> Paris </answer>"],  # immediate answer
        ["I am not sure what to do.", s_answer],  # invalid action, then answer
        [s_search, s_second, "<answer> Mirren </answer>"],  # two searches
    ]
    # distinct questions: the scripted policy tells trajectories apart by their prompt
    questions = ["Who founded Veltra", "Capital of France", "Who started Veltra", "Where was the founder born"]
    out, gen = run(tok, questions, scripts, engine, max_turns=2)

    obs_veltra, obs_osk = search_observation(VELTRA), search_observation(OSK)
    expected = [
        (s_search + obs_veltra + s_answer, s_search + s_answer),
        ("<answer> Paris </answer>", "<answer> Paris </answer>"),
        ("I am not sure what to do." + invalid_action_observation() + s_answer, "I am not sure what to do." + s_answer),
        (s_search + obs_veltra + s_second + obs_osk + "<answer> Mirren </answer>",
         s_search + s_second + "<answer> Mirren </answer>"),
    ]
    for i, exp in enumerate(expected):
        assert texts(out, tok, i) == exp, f"row {i}"

    m = out.meta_info
    assert m["turns_stats"] == [2, 1, 2, 3]
    assert m["valid_action_stats"] == [2, 1, 1, 3]
    assert m["valid_search_stats"] == [1, 0, 0, 2]
    assert m["active_mask"] == [False] * 4
    assert m["truncated_mask"] == [False] * 4
    assert m["search_failure_stats"] == [0] * 4
    assert m["origin"] == "test"  # input meta_info kept
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3"]
    # observation counts are the mask-0 tokens of each row
    P = out.batch["prompts"].shape[1]
    real = out.batch["attention_mask"][:, P:]
    assert m["observation_token_stats"] == ((real == 1) & (out.batch["response_mask"] == 0)).sum(1).tolist()
    assert m["generated_token_stats"] == out.batch["response_mask"].sum(1).tolist()
    rs = m["rollout_stats"]
    assert rs["discarded_tokens"] == 0 and rs["overshoot_tokens"] == 0 and rs["answered"] == 4
    assert set(m["timing"]) == {"gen_s", "search_s", "loop_s", "total_s"}

    # Inactive rows cost nothing: round 2 only rows 0, 2, 3; round 3 only row 3.
    assert [c["rows"] for c in gen.calls] == [[0, 1, 2, 3], [0, 2, 3], [3]]
    # One engine call per round with all that round's queries.
    assert engine.calls == [["who founded Veltra", "who founded Veltra"], ["Ana Osk birthplace"]]
    # Stop strings reach the backend; training rollouts sample.
    assert all(c["params"].stop == ("</search>", "</answer>") for c in gen.calls)
    assert gen.calls[0]["params"].temperature == 1.0

    # logprobs are exactly the backend's, token for token, turn by turn
    row0 = out.batch["rollout_log_probs"][0][out.batch["response_mask"][0].bool()].tolist()
    ids1 = tok(s_search, add_special_tokens=False)["input_ids"]
    ids2 = tok(s_answer, add_special_tokens=False)["input_ids"]
    want = [fake_logprob(t, k) for k, t in enumerate(ids1)] + [fake_logprob(t, k) for k, t in enumerate(ids2)]
    assert row0 == pytest.approx(want, abs=1e-7)
    # and the response ids are the sampled ids themselves, not a re-tokenization of the text
    assert out.batch["responses"][0, : len(ids1)].tolist() == ids1


def test_never_answering_hits_max_turns(tok):
    engine = CountingEngine(MockSearchEngine({"veltra": VELTRA}))
    s = "<search> Veltra </search>"
    out, gen = run(tok, ["Who founded Veltra"], [[s, s, s, s]], engine, max_turns=2)
    whole, generated = texts(out, tok, 0)
    obs = search_observation(VELTRA)
    # two searches answered, then the final no-search round; its search is not executed
    assert whole == s + obs + s + obs + s and generated == s * 3
    m = out.meta_info
    assert (m["turns_stats"], m["valid_search_stats"], m["valid_action_stats"]) == ([3], [2], [3])
    assert m["active_mask"] == [True] and m["truncated_mask"] == [False]
    assert len(engine.calls) == 2 and len(gen.calls) == 3


def test_text_after_stop_string_does_not_survive(tok):
    engine = MockSearchEngine({"veltra": VELTRA})
    s1 = "<search> Veltra </search>"
    s1_tail = s1 + "\n\n<information>I made this up</information><answer> wrong </answer>"
    s2 = "<answer> Ana Osk </answer>"
    # A backend that honours stop strings (the scripted one, like vLLM / HF) ...
    out, _ = run(tok, ["Who founded Veltra"], [[s1_tail, s2]], engine, max_turns=2)
    assert texts(out, tok, 0) == (s1 + search_observation(VELTRA) + s2, s1 + s2)
    assert out.meta_info["rollout_stats"]["overshoot_tokens"] == 0
    # ... and one that ignores them: the manager trims the overshoot itself and says how much.
    out, _ = run(tok, ["Who founded Veltra"], [[s1_tail, s2 + " and more words"]], engine, max_turns=2,
                 honour_stop=False)
    assert texts(out, tok, 0) == (s1 + search_observation(VELTRA) + s2, s1 + s2)
    rs = out.meta_info["rollout_stats"]
    tail_tokens = (len(tok(s1_tail, add_special_tokens=False)["input_ids"]) - len(tok(s1, add_special_tokens=False)["input_ids"])
                   + len(tok(s2 + " and more words", add_special_tokens=False)["input_ids"])
                   - len(tok(s2, add_special_tokens=False)["input_ids"]))
    assert rs["overshoot_tokens"] == tail_tokens == rs["discarded_tokens"]


def test_tool_call_protocol(tok):
    engine = MockSearchEngine({"veltra": VELTRA})
    call = '<tool_call>{"name": "search", "arguments": {"query": "Veltra founder"}}</tool_call>'
    out, gen = run(tok, ["Who founded Veltra"], [[call + " extra", "<answer> Ana Osk </answer>"]], engine,
                   protocol="tool_call", max_turns=2)
    assert texts(out, tok, 0)[0] == call + "\n\n<tool_response>" + VELTRA.strip() + "</tool_response>\n\n<answer> Ana Osk </answer>"
    assert gen.calls[0]["params"].stop == ("</tool_call>", "</answer>")


def test_validation_is_greedy_and_seeded_rounds(tok):
    engine = MockSearchEngine({"veltra": VELTRA})
    _, gen = run(tok, ["q"], [["<answer> a </answer>"]], engine, validation=True, temperature=0.9)
    assert gen.calls[0]["params"].temperature == 0.0
    _, gen = run(tok, ["q"], [["<search> Veltra </search>", "<answer> a </answer>"]], engine, seed=7)
    assert [c["params"].seed for c in gen.calls] == [7, 8]


def test_overlong_observation_is_shortened_keeping_the_closing_tag(tok):
    long_passages = "".join(f"Doc {i}(Title: Veltra {i}) Veltra fact number {i} is long and detailed.\n"
                            for i in range(1, 30))
    engine = MockSearchEngine({"veltra": long_passages})
    s1, s2 = "<search> Veltra </search>", "<answer> Ana </answer>"
    out, _ = run(tok, ["Who founded Veltra"], [[s1, s2]], engine, max_turns=2, max_obs_length=40)
    whole, generated = texts(out, tok, 0)
    assert generated == s1 + s2
    obs = whole[len(s1): len(whole) - len(s2)]
    assert obs.startswith("\n\n<information>Doc 1(Title: Veltra 1) Veltra fact")
    assert obs.endswith("</information>\n\n") and "Doc 29" not in obs
    assert out.meta_info["observation_token_stats"] == [40]
    assert out.meta_info["rollout_stats"]["shortened_observations"] == 1


def test_context_overflow_ends_cleanly(tok):
    engine = MockSearchEngine({"veltra": VELTRA * 5})
    prompts, _ = make_batch(tok, ["Who founded Veltra", "Who founded Veltra and when exactly"])
    s = "<think>" + "let me think " * 10 + "</think><search> Veltra </search>"
    n_s = len(tok(s, add_special_tokens=False)["input_ids"])
    # Context room: enough for the first turn and a shortened observation, not for a second turn of
    # that size; the loop must stop without crashing and without exceeding the limits.
    limit = max(len(p) for p in prompts) + n_s + 30
    out, gen = run(tok, ["Who founded Veltra", "Who founded Veltra and when exactly"],
                   [[s, s, s], ["<answer> x </answer>"]], engine,
                   max_turns=3, max_prompt_length=limit, max_start_length=limit - 1, max_obs_length=100)
    m = out.meta_info
    assert m["truncated_mask"] == [True, False] and m["active_mask"] == [True, False]
    P = out.batch["prompts"].shape[1]
    n0 = int(out.batch["attention_mask"][0, P:].sum())
    assert len(prompts[0]) + n0 <= limit
    # Every generate call respected each row's room.
    for call in gen.calls:
        assert call["params"].max_tokens <= limit - len(prompts[0])
    whole, generated = texts(out, tok, 0)
    assert whole.startswith(s + "\n\n<information>") and "</information>\n\n" in whole


def test_prompt_longer_than_max_start_length_keeps_its_last_tokens(tok):
    """As upstream's run_llm_loop and verl's agent loops: cut from the left, then rolled out (an
    empty response would give verl's reward placement nothing to stand on)."""
    questions = ["short", "a much longer question " * 10]
    prompts, batch = make_batch(tok, questions)
    cap = len(prompts[0]) + 1
    kept = [p[-cap:] for p in prompts]  # row 0 fits; row 1 loses len(prompts[1]) - cap tokens
    gen = ScriptedGenerator(tok, kept, [["<answer> a </answer>"], ["<answer> b </answer>"]])
    config = GenerationConfig(max_start_length=cap, max_response_length=400)
    out = LLMGenerationManager(tok, gen, config, MockSearchEngine({})).run_llm_loop(batch)
    check_layout(out, kept, config)
    assert [c["rows"] for c in gen.calls] == [[0, 1]]
    assert out.batch["prompts"].shape[1] == cap
    assert out.meta_info["prompt_cut_stats"] == [0, len(prompts[1]) - cap]
    assert out.meta_info["truncated_mask"] == [False, False] and out.meta_info["rollout_stats"]["prompts_cut"] == 1
    assert texts(out, tok, 1) == ("<answer> b </answer>", "<answer> b </answer>")


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="max_turns must be an int >= 0"):
        GenerationConfig(max_turns=-1)
    with pytest.raises(ValueError, match="max_start_length .* must be less than max_prompt_length"):
        GenerationConfig(max_start_length=10, max_prompt_length=5)
    with pytest.raises(ValueError, match="must leave room to generate"):
        GenerationConfig(max_start_length=10, max_prompt_length=10)
    with pytest.raises(ValueError, match="allowed values"):
        GenerationConfig(protocol="json")
    with pytest.raises(ValueError, match="max_obs_length must be an int >= 1"):
        GenerationConfig(max_obs_length=0)
    d = GenerationConfig()
    assert (d.max_turns, d.max_start_length, d.max_prompt_length, d.max_response_length, d.max_obs_length, d.topk) \
        == (2, 2048, 4096, 500, 500, 3)


def test_manager_needs_an_engine_or_url(tok):
    with pytest.raises(ValueError, match="search_engine or GenerationConfig.search_url"):
        LLMGenerationManager(tok, None, GenerationConfig(), None)


def test_search_engine_down_gives_failed_observation(tok):
    engine = RetrieverClient(dead_url(), retries=1, backoff=0.01, timeout=2.0)
    s1, s2 = "<search> Veltra </search>", "<answer> unknown </answer>"
    out, _ = run(tok, ["Who founded Veltra", "q2"], [[s1, s2], [s2]], engine, max_turns=2)
    assert texts(out, tok, 0) == (s1 + failed_search_observation() + s2, s1 + s2)
    m = out.meta_info
    assert m["search_failure_stats"] == [1, 0] and m["valid_search_stats"] == [1, 0]
    assert m["rollout_stats"]["search_failures"] == 1 and m["active_mask"] == [False, False]


# -- the real retriever server ------------------------------------------------------------------
def direct_passages(url, query, topk=3):
    """What the server returns, fetched independently of RetrieverClient and rendered."""
    r = requests.post(url, json={"queries": [query], "topk": topk, "return_scores": False}, timeout=10)
    r.raise_for_status()
    # without scores the server lists the documents themselves (upstream shape)
    return render_passages([hit.get("document", hit)["contents"] for hit in r.json()["result"][0]])


def test_real_retriever_search_then_answer_and_two_searches(tok, retriever_server):
    t1, t2 = corpus_titles(retriever_server.corpus_path, 2)
    engine = CountingEngine(RetrieverClient(retriever_server.url, topk=3))
    a1 = f"<think>Look up {t1}.</think>\n<search> {t1} </search>"
    a2 = f"<think>Now {t2}.</think>\n<search> {t2} </search>"
    ans = f"<answer> {t1} </answer>"
    out, gen = run(tok, [f"What is {t1}", f"Compare {t1} and {t2}"], [[a1, ans], [a1, a2, ans]],
                   engine, max_turns=2, max_obs_length=500, max_response_length=1500)
    o1 = search_observation(direct_passages(retriever_server.url, t1))
    o2 = search_observation(direct_passages(retriever_server.url, t2))
    assert f"Doc 1(Title: {t1})" in o1  # the title query finds its own passage first
    assert texts(out, tok, 0) == (a1 + o1 + ans, a1 + ans)
    assert texts(out, tok, 1) == (a1 + o1 + a2 + o2 + ans, a1 + a2 + ans)
    assert engine.calls == [[t1, t1], [t2]]
    m = out.meta_info
    assert m["valid_search_stats"] == [1, 2] and m["turns_stats"] == [2, 3] and m["search_failure_stats"] == [0, 0]
    assert m["timing"]["search_s"] > 0


def test_real_retriever_overlong_observation(tok, retriever_server):
    [t1] = corpus_titles(retriever_server.corpus_path, 1)
    engine = RetrieverClient(retriever_server.url, topk=3)
    s1, s2 = f"<search> {t1} </search>", "<answer> x </answer>"
    out, _ = run(tok, [f"What is {t1}"], [[s1, s2]], engine, max_turns=1, max_obs_length=24)
    whole, generated = texts(out, tok, 0)
    assert generated == s1 + s2
    assert whole.startswith(s1 + f"\n\n<information>Doc 1(Title: {t1})") and whole.endswith("</information>\n\n" + s2)
    assert out.meta_info["observation_token_stats"] == [24]


def test_real_retriever_killed_mid_rollout_then_restarted(tok, retriever_server, start_retriever):
    server = start_retriever([retriever_server.index_dir])
    t1, t2, t3 = corpus_titles(retriever_server.corpus_path, 3)
    engine = RetrieverClient(server.url, topk=2, retries=1, backoff=0.01, timeout=3.0)
    s1, s2, s3 = (f"<search> {t} </search>" for t in (t1, t2, t3))
    ans = "<answer> done </answer>"
    prompts, batch = make_batch(tok, [f"Tell me about {t1}"])
    scripted = ScriptedGenerator(tok, prompts, [[s1, s2, s3, ans]])

    class ServerToggling:
        """Stops the server while round 2 generates and restarts it during round 3."""

        def generate(self, contexts, params):
            n = len(scripted.calls)
            if n == 1:
                server.stop()
            elif n == 2:
                server.restart()
            return scripted.generate(contexts, params)

    config = GenerationConfig(max_turns=3, max_response_length=1200, max_obs_length=400)
    out = LLMGenerationManager(tok, ServerToggling(), config, engine).run_llm_loop(batch)
    check_layout(out, prompts, config)
    o1 = search_observation(direct_passages(server.url, t1, topk=2))
    o3 = search_observation(direct_passages(server.url, t3, topk=2))
    assert texts(out, tok, 0) == (s1 + o1 + s2 + failed_search_observation() + s3 + o3 + ans, s1 + s2 + s3 + ans)
    m = out.meta_info
    assert m["search_failure_stats"] == [1] and m["valid_search_stats"] == [3] and m["active_mask"] == [False]


# -- a real backend -------------------------------------------------------------------------------
def test_hf_generator_ids_and_logprobs_are_kept_verbatim():
    """With HFGenerator (tiny random Qwen3) the response holds exactly the sampled ids and their
    logprobs, turn after turn; greedy validation rollouts are reproducible."""
    from search_r1.models import load_model_and_tokenizer
    from search_r1.rollout.backends import HFGenerator

    torch.set_num_threads(1)
    model, htok = load_model_and_tokenizer("tiny-random-qwen3")
    prompts, batch = make_batch(htok, ["Who founded Veltra", "Where is Mirren"])
    backend = HFGenerator(model, htok)
    seen = {0: [], 1: []}  # row -> [(ids, logprobs)] per turn

    class Recording:
        def generate(self, contexts, params):
            outs = backend.generate(contexts, params)
            for ctx, o in zip(contexts, outs):
                row = 0 if ctx[: len(prompts[0])] == prompts[0] else 1
                seen[row].append((list(o.token_ids), list(o.logprobs)))
            return outs

    config = GenerationConfig(max_turns=1, max_tokens_per_turn=6, max_response_length=300, seed=3)
    engine = MockSearchEngine({})
    out = LLMGenerationManager(htok, Recording(), config, engine).run_llm_loop(batch)
    check_layout(out, prompts, config)
    for row in (0, 1):
        rm = out.batch["response_mask"][row].bool()
        assert out.batch["responses"][row][rm].tolist() == [t for ids, _ in seen[row] for t in ids]
        assert out.batch["rollout_log_probs"][row][rm].tolist() == pytest.approx(
            [lp for _, lps in seen[row] for lp in lps], abs=1e-6)
    assert out.meta_info["rollout_stats"]["discarded_tokens"] == 0

    val = [LLMGenerationManager(htok, backend, config, engine, is_validation=True).run_llm_loop(batch)
           for _ in range(2)]
    assert torch.equal(val[0].batch["input_ids"], val[1].batch["input_ids"])
    assert torch.equal(val[0].batch["response_mask"], val[1].batch["response_mask"])
