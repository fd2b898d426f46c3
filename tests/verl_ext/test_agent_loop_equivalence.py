"""The architecture's key contract: the batch driver (`run_llm_loop`) and the verl agent loop
(`SearchR1AgentLoop`, run by verl's real `AgentLoopWorker`) give the same trajectories.

Both paths get the same scripted policy (tests/search_r1/rollout/scripted.py: real tokenizer, stops
like vLLM) and the same real retriever server; the verl path reaches the policy through verl's real
`LLMServerClient` and a server shaped like verl's vLLM server (tests/verl_ext/helpers.py). Per
trajectory we compare prompt ids, response ids, response mask, rollout log-probs and the Search-R1
statistics, for both protocols and every scripted case of tests/search_r1/rollout/test_generation.py.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from search_r1.prompts import make_messages
from search_r1.rollout.generation import LLMGenerationManager
from search_r1.search import RetrieverClient
from verl_ext.agent_loop import SearchR1Settings

from tests._fixtures.retriever import corpus_titles, dead_url
from tests.search_r1.rollout.scripted import ScriptedGenerator, smollm2_tokenizer
from tests.search_r1.rollout.test_generation import make_batch
from tests.verl_ext.helpers import FakeVLLMServer, ScriptedLLMClient, _Method, verl_config

PROTOCOLS = ("tags", "tool_call")


def search(query: str, protocol: str) -> str:
    if protocol == "tags":
        return f"<think>I should look up {query}.</think>\n<search> {query} </search>"
    call = json.dumps({"name": "search", "arguments": {"query": query}})
    return f"<think>I should look up {query}.</think>\n<tool_call>{call}</tool_call>"


def answer(text: str) -> str:
    return f"<think>Done.</think>\n<answer> {text} </answer>"


def cases(titles, protocol):
    """name -> (questions, scripts, config overrides, honour_stop). Overrides use `__` for dots."""
    t1, t2 = titles
    s1, s2 = search(t1, protocol), search(t2, protocol)
    long_think = "<think>" + "let me think " * 10 + "</think>"
    return {
        "search_then_answer": (["Who is T1", "Capital of France"], [[s1, answer(t1)], [answer("Paris")]], {}, True),
        "two_searches": (["Compare T1 and T2"], [[s1, s2, answer(t2)]], {}, True),
        "invalid_then_answer": (["Who started it"], [["I am not sure what to do.", answer("x")]], {}, True),
        "never_answering": (["Who founded it"], [[s1, s1, s1, s1]], {}, True),
        "overshoot_past_stop": (["Who is T1"], [[s1 + "\n\n<information>made up</information>" + answer("wrong"),
                                                 answer(t1) + " and more words"]], {}, False),
        "observation_too_long": (["Who is T1"], [[s1, answer(t1)]], {"search_r1__max_obs_length": 24}, True),
        "context_overflow": (["Who is T1", "Who is T1 and when exactly"],
                             [[long_think + s1] * 3, [answer("x")]],
                             {"search_r1__max_turns": 3, "search_r1__max_obs_length": 100,
                              "search_r1__max_context_length": "LIMIT"}, True),
        "retriever_down": (["Who is T1", "q2"], [[s1, answer("unknown")], [answer("unknown")]],
                           {"search_r1__retriever__urls": "DEAD", "search_r1__retriever__retries": 1,
                            "search_r1__retriever__backoff": 0.01, "search_r1__retriever__timeout": 2.0}, True),
        # longer than rollout.prompt_length: both paths keep its last prompt_length tokens
        "overlong_prompt": (["Who is T1 " + "and what else " * 10, "Who is T2"], [[s1, answer(t1)], [answer(t2)]],
                            {"data__max_prompt_length": "CUT"}, True),
    }


def run_both(tok, protocol, questions, scripts, overrides, honour_stop, retriever_url):
    """(batch DataProto from run_llm_loop, DataProto from verl's AgentLoopWorker, fake server)."""
    prompts, batch = make_batch(tok, questions, protocol)
    overrides = dict(overrides)
    prompt_length = max(map(len, prompts)) + 8
    if overrides.pop("data__max_prompt_length", None) == "CUT":
        prompt_length = len(prompts[0]) - 5  # row 0 loses 5 tokens, row 1 (shorter) none
    known = [p[-prompt_length:] for p in prompts]  # the prompts the policy is asked to continue
    if overrides.get("search_r1__max_context_length") == "LIMIT":
        # room for one long turn and a shortened observation, not for a second turn of that size
        n_turn = len(tok(scripts[0][0], add_special_tokens=False)["input_ids"])
        overrides["search_r1__max_context_length"] = max(map(len, prompts)) + n_turn + 30
    if overrides.get("search_r1__retriever__urls") == "DEAD":
        overrides["search_r1__retriever__urls"] = [dead_url()]
    overrides.setdefault("search_r1__retriever__urls", [retriever_url])
    cfg = verl_config(search_r1__protocol=protocol, data__max_prompt_length=prompt_length,
                      data__max_response_length=400, **overrides)
    settings = SearchR1Settings.from_config(cfg)
    r = settings.retriever

    def engine():
        return RetrieverClient(list(r.urls), topk=r.topk, timeout=r.timeout, retries=r.retries, backoff=r.backoff)

    # -- batch driver -----------------------------------------------------------------------------
    gen = ScriptedGenerator(tok, known, scripts, honour_stop=honour_stop)
    gen_config = settings.generation_config(cfg.actor_rollout_ref.rollout)
    batch_out = LLMGenerationManager(tok, gen, gen_config, engine()).run_llm_loop(batch)

    # -- verl's AgentLoopWorker running SearchR1AgentLoop -------------------------------------------
    server = FakeVLLMServer(ScriptedGenerator(tok, known, scripts, honour_stop=honour_stop),
                            cfg.actor_rollout_ref.rollout.prompt_length, cfg.actor_rollout_ref.rollout.response_length)
    client = ScriptedLLMClient(cfg, server)
    server.client = client  # for tests that look at routing
    worker = AgentLoopWorker(cfg, client)
    n = len(questions)
    rows = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([make_messages(q, protocol) for q in questions] + [None], dtype=object)[:n],
        "agent_name": np.array(["search_r1"] * n, dtype=object),
        "data_source": np.array(["synth"] * n, dtype=object),
        "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
    }, meta_info={"validate": False, "global_steps": 3})
    verl_out = asyncio.run(worker.generate_sequences(rows))
    return batch_out, verl_out, server


def unpadded(out: DataProto, i: int) -> dict:
    """Row i's prompt, response, mask and log-probs without padding."""
    b = out.batch
    P = b["prompts"].shape[1]
    am = b["attention_mask"][i]
    n = int(am[P:].sum())
    return {
        "prompt": b["prompts"][i][am[:P].bool()].tolist(),
        "response": b["responses"][i, :n].tolist(),
        "mask": b["response_mask"][i, :n].tolist(),
        "logprobs": b["rollout_log_probs"][i, :n].tolist(),
    }


STAT_KEYS = {"turns": "turns_stats", "valid_actions": "valid_action_stats", "valid_searches": "valid_search_stats",
             "search_failures": "search_failure_stats", "truncated": "truncated_mask",
             "generated_tokens": "generated_token_stats", "observation_tokens": "observation_token_stats",
             "prompt_cut": "prompt_cut_stats"}


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", list(cases(("a", "b"), "tags")))
def test_same_trajectories_on_both_paths(tok, retriever_server, protocol, case):
    titles = corpus_titles(retriever_server.corpus_path, 2)
    questions, scripts, overrides, honour_stop = cases(titles, protocol)[case]
    batch_out, verl_out, server = run_both(tok, protocol, questions, scripts, overrides, honour_stop,
                                           retriever_server.url)
    stats = verl_out.non_tensor_batch["search_r1"]
    m = batch_out.meta_info
    for i in range(len(questions)):
        want, got = unpadded(batch_out, i), unpadded(verl_out, i)
        assert got["prompt"] == want["prompt"], f"row {i}: verl's chat template differs from ours"
        assert got["response"] == want["response"], f"row {i}"
        assert got["mask"] == want["mask"], f"row {i}"
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-7), f"row {i}"
        for ours, theirs in STAT_KEYS.items():
            assert stats[i][ours] == int(m[theirs][i]), f"row {i} {ours}"
        assert stats[i]["answered"] == int(not m["active_mask"][i])
    # the case really exercised what it is named after
    s0 = stats[0]
    expect = {"two_searches": s0["valid_searches"] == 2, "invalid_then_answer": s0["valid_actions"] == 1,
              "never_answering": not s0["answered"] and s0["turns"] == 3,
              "overshoot_past_stop": s0["overshoot_tokens"] > 0,
              "observation_too_long": s0["shortened_observations"] == 1,
              "context_overflow": bool(s0["truncated"]),
              # ...and its cause travels with the stats (the trainer stops a step whose searches all failed)
              "retriever_down": s0["search_failures"] == 1 and s0["answered"] and "127.0.0.1" in s0["search_error"],
              "overlong_prompt": s0["prompt_cut"] == 5 and s0["valid_searches"] == 1 and s0["answered"],
              "search_then_answer": s0["valid_searches"] == 1 and s0["answered"]}
    assert expect[case], s0
    assert (verl_out.non_tensor_batch["__num_turns__"] >= 2).all()


def test_stop_strings_and_sampling_params_reach_the_server(tok, retriever_server):
    [t1, t2] = corpus_titles(retriever_server.corpus_path, 2)
    _, verl_out, server = run_both(tok, "tags", ["Who is T1"], [[search(t1, "tags"), answer(t1)]],
                                   {"actor_rollout_ref__rollout__temperature": 0.7,
                                    "actor_rollout_ref__rollout__top_p": 0.9}, True, retriever_server.url)
    assert len(server.calls) == 2
    for call in server.calls:
        sp = call["sampling_params"]
        assert sp["stop"] == ["</search>", "</answer>"] and sp["include_stop_str_in_output"] is True
        assert (sp["temperature"], sp["top_p"], sp["logprobs"]) == (0.7, 0.9, True)
    # max_tokens is each turn's budget: the per-turn cap, then what the response budget leaves
    assert server.calls[0]["sampling_params"]["max_tokens"] == 400  # min(500 per turn, 400 response)
    row = unpadded(verl_out, 0)
    first_turn = row["mask"].index(0)  # generated tokens before the first observation
    n_obs = row["mask"][first_turn:].index(1)
    assert server.calls[1]["sampling_params"]["max_tokens"] == 400 - first_turn - n_obs
    # the second call continues the first context: prompt + turn 1 + observation
    assert server.calls[1]["prompt_ids"] == row["prompt"] + row["response"][: first_turn + n_obs]
    # one request id per trajectory for the load balancer (sticky routing: the prefix cache of one
    # server keeps the trajectory's context); verl's client gives vLLM a fresh id per turn
    assert len(server.client.acquired) == 2 and len(set(server.client.acquired)) == 1


class LocalActor:
    """`handle.method.remote(...)` of a Ray actor handle, answered by a local object (verl awaits it)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        return _Method(getattr(self.obj, name))


def test_overlong_prompt_trains_through_verls_reward_and_transfer_queue_paths(tok, retriever_server):
    """One prompt longer than rollout.prompt_length, through verl's real AgentLoopWorker and its real
    RewardLoopWorker (verl_ext.reward): the prompt keeps its last prompt_length tokens, the policy is
    asked to continue exactly that, the score lands on the last response token, and the raw output
    converts as verl's v1 TransferQueue worker converts it (`AgentLoopOutput.as_dict`, which raised
    IndexError on an empty response and failed the whole group)."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    question = "a much longer question " * 10
    full = make_batch(tok, [question])[0][0]
    cap = len(full) - 5
    cfg = verl_config(data__max_prompt_length=cap, data__max_response_length=64,
                      search_r1__retriever__urls=[retriever_server.url])
    server = FakeVLLMServer(ScriptedGenerator(tok, [full[-cap:]], [[answer("b")]]), cap, 64)
    raw = []

    async def run(rows):
        # the reward worker binds the event loop it is created in, as in its Ray actor
        worker = AgentLoopWorker(cfg, ScriptedLLMClient(cfg, server),
                                 reward_loop_worker_handles=[LocalActor(RewardLoopWorker(cfg))])
        postprocess = worker._agent_loop_postprocess

        async def keep_raw(output, validate, **kwargs):
            raw.append(output)
            return await postprocess(output, validate, **kwargs)

        worker._agent_loop_postprocess = keep_raw
        return await worker.generate_sequences(rows)

    rows = DataProto.from_dict(non_tensors={"raw_prompt": np.array([None], dtype=object),
                                            "uid": np.array(["u0"], dtype=object),
                                            "data_source": np.array(["synth"], dtype=object),
                                            "reward_model": np.array([{"ground_truth": {"target": ["b"]}}],
                                                                     dtype=object)},
                               meta_info={"validate": False, "global_steps": 1})
    rows.non_tensor_batch["raw_prompt"][0] = make_messages(question)
    out = asyncio.run(run(rows))
    assert [c["prompt_ids"] for c in server.calls] == [full[-cap:]]  # generated from the cut prompt
    stats = out.non_tensor_batch["search_r1"][0]
    assert stats["prompt_cut"] == 5 and stats["answered"] == 1 and stats["truncated"] == 0
    row = unpadded(out, 0)
    assert row["prompt"] == full[-cap:] and tok.decode(row["response"]) == answer("b")
    # EM reward 1 on the last response token, 0 elsewhere (verl's _postprocess placement)
    assert out.batch["rm_scores"][0].tolist() == [0.0] * (len(row["response"]) - 1) + [1.0] + \
        [0.0] * (64 - len(row["response"]))
    field = raw[0].as_dict()  # what AgentLoopWorkerTQ stores per trajectory
    assert field["rm_scores"].tolist()[-1] == 1.0 and field["prompts"].tolist() == full[-cap:]
