"""The tool-call agent end to end against the real retriever server over the synthetic corpus,
driven by scripted chat models (every action: both JSON forms, malformed JSON, an unknown tool, a
missing argument, access by document number, answers with and without citations, budgets)."""
from __future__ import annotations

import datetime
import json

import pytest

from search_r1.agents import prompts as P
from search_r1.agents.budget import Budgets
from search_r1.agents.tools import AccessTool, SearchTool
from search_r1.agents.toolcall import ToolCallAgent, ToolCallConfig, first_tool_call
from search_r1.search import render_passages
from tests.search_r1.agents.scripted import OVERFLOW, SERVER_DOWN, ScriptedChat


def search_call(query: str, form: str = "action") -> str:
    payload = ({"action": "web_search", "action_input": {"query": query}} if form == "action"
               else {"name": "search", "arguments": {"query": query}})
    return f"<think>I should look this up.</think>\n<tool_call>{json.dumps(payload)}</tool_call>"


def test_every_action_against_the_real_retriever(client, question):
    q, gold = question["question"], question["golden_answers"][0]
    model = ScriptedChat({"toolcall": [
        search_call(q) + " text after the stop string, never sent",
        '<tool_call>{"action": "web_search", "action_input": {"query": </tool_call>',   # malformed JSON
        '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>',          # unknown tool
        '<tool_call>{"name": "search", "arguments": {"q": "oops"}}</tool_call>',          # missing argument
        search_call("second query " + q, form="name"),
        f"<think>Doc 2 and [1] say it.</think> <answer> {gold} </answer> Sources: Doc 2, [1]",
    ]})
    agent = ToolCallAgent(model, SearchTool(client), config=ToolCallConfig(date="2026-11-23"))
    result = agent.run(q)

    # the prompt: today's date (as configured) and the search budget; stop at </tool_call> every turn
    system = model.calls[0]["messages"][0]["content"]
    assert "Today is 2026-11-23" in system and "at most 5 times" in system
    assert all(c["stop"] == ("</tool_call>",) for c in model.calls)
    # the tool responses: real retrieval results, numbered across the conversation
    expected_1 = render_passages([d["contents"] for d in client.batch_retrieve([q])[0]])
    second = model.calls[1]["messages"]
    assert second[2] == {"role": "assistant", "content": search_call(q)}  # cut at the stop string
    assert second[3] == {"role": "user", "content": f"<tool_response>{expected_1.strip()}</tool_response>"}
    corrections = [model.calls[i]["messages"][-1]["content"] for i in (2, 3, 4)]
    assert "not valid JSON" in corrections[0] and "no tool named 'calculator'" in corrections[1]
    assert 'non-empty "query"' in corrections[2]
    assert all(c.startswith("<tool_response>Error:") for c in corrections)
    hits_2 = client.batch_retrieve(["second query " + q])[0]
    assert render_passages([d["contents"] for d in hits_2], start=4).strip() in model.calls[5]["messages"][-1]["content"]
    # the record
    assert [t["tool"] for t in result["tool_calls"]] == ["search", "invalid", "invalid", "invalid", "search"]
    assert result["search_queries"] == [q, "second query " + q]
    first_ids = [d["id"] for d in client.batch_retrieve([q])[0]]
    assert result["tool_calls"][0]["ids"] == first_ids and result["tool_calls"][4]["docs"] == [4, 5, 6]
    assert result["answer"] == gold and result["cited"]
    assert [s["number"] for s in result["sources"]] == [2, 1]
    assert [s["id"] for s in result["sources"]] == [first_ids[1], first_ids[0]]
    assert result["budget"]["tool_calls"] == 2 and result["budget"]["hits"] == [] and result["turns"] == 6
    assert result["invalid_calls"] == 3 and result["format_valid"] is False and not result["forced_answer"]
    kinds = [e["kind"] for e in result["events"]]
    assert kinds.count("search") == 2 and kinds.count("invalid") == 3 and kinds[-1] == "answer"


def test_search_budget_forces_the_final_answer(client, question):
    q = question["question"]
    model = ScriptedChat({"toolcall": [search_call(q), search_call("river city"), "<answer> forced </answer>"]})
    agent = ToolCallAgent(model, SearchTool(client), config=ToolCallConfig(
        budgets=Budgets(max_steps=8, max_tool_calls=2, max_tokens=4096, max_seconds=60)))
    result = agent.run(q)
    assert result["budget"]["tool_calls"] == 2 and result["forced_answer"]
    assert result["budget"]["hits"] == [{"budget": "tool_calls", "limit": 2, "used": 2, "phase": "toolcall",
                                         "then": "asking for the final answer"}]
    last = model.calls[-1]
    assert last["stop"] == () and "used your search budget" in last["messages"][-1]["content"]
    assert "at most 2 times" in model.calls[0]["messages"][0]["content"]
    assert result["answer"] == "forced" and not result["cited"]
    assert len(result["sources"]) == 6  # nothing cited: every document shown is listed
    assert any(e["kind"] == "budget" for e in result["events"])


def test_a_call_over_the_budget_is_not_run_and_steps_and_tokens_budgets(client, question):
    q = question["question"]
    # one search allowed; the model ignores the notice and calls again: not run
    model = ScriptedChat({"toolcall": [search_call(q), search_call("more")]}, fallback="<answer> x </answer>")
    agent = ToolCallAgent(model, SearchTool(client), config=ToolCallConfig(
        budgets=Budgets(max_steps=1, max_tool_calls=3, max_tokens=4096, max_seconds=60)))
    result = agent.run(q)
    assert [h["budget"] for h in result["budget"]["hits"]] == ["steps"]
    assert result["search_queries"] == [q] and result["answer"] is None  # the forced turn called a tool again
    assert first_tool_call(result["final_text"]) is not None
    # the token budget caps each turn; spent, it forces the answer (14 words = the search turn's tokens)
    assert len(search_call(q).split()) == 14
    model = ScriptedChat({"toolcall": [search_call(q)]}, fallback="<answer> x </answer>")
    agent = ToolCallAgent(model, SearchTool(client), config=ToolCallConfig(
        budgets=Budgets(max_steps=8, max_tool_calls=5, max_tokens=14, max_seconds=60)))
    result = agent.run(q)
    assert model.calls[0]["max_tokens"] == 14 and model.calls[-1]["stop"] == ()
    assert [h["budget"] for h in result["budget"]["hits"]] == ["tokens"] and result["answer"] == "x"
    # a turn cut by the token budget is the final answer, recorded as such
    model = ScriptedChat({"toolcall": [search_call(q)]})
    result = ToolCallAgent(model, SearchTool(client), config=ToolCallConfig(
        budgets=Budgets(max_steps=8, max_tool_calls=5, max_tokens=5, max_seconds=60))).run(q)
    assert len(model.calls) == 1 and result["search_queries"] == [] and result["answer"] is None
    assert result["budget"]["hits"][0]["then"] == "the turn was cut short; it is the final answer"


def test_inline_transcript_continues_one_assistant_message(client, question):
    q = question["question"]
    model = ScriptedChat({"toolcall": [search_call(q, form="name"), "<answer> a </answer>"]})
    agent = ToolCallAgent(model, SearchTool(client), config=ToolCallConfig(transcript="inline"))
    result = agent.run(q)
    context = model.calls[1]["messages"]
    assert [m["role"] for m in context] == ["system", "user", "assistant"]
    obs = "\n\n<tool_response>" + client.batch_search([q])[0].strip() + "</tool_response>\n\n"
    assert context[-1]["parts"] == [search_call(q, form="name"), obs]
    assert context[-1]["content"] == "".join(context[-1]["parts"]) == result["response"][: len(context[-1]["content"])]
    assert result["answer"] == "a"


def test_access_by_document_number_and_by_id(client, question, retriever_server):
    q = question["question"]
    gold_id = question["gold_doc_ids"][0]
    model = ScriptedChat({"toolcall": [
        search_call(q),
        '<tool_call>{"action": "access", "action_input": {"target": "Doc 1"}}</tool_call>',
        f'<tool_call>{{"name": "access", "arguments": {{"id": "{gold_id}"}}}}</tool_call>',
        '<tool_call>{"name": "access", "arguments": {"target": "no-such-doc"}}</tool_call>',
        "<answer> done </answer> see Doc 5",
    ]})
    agent = ToolCallAgent(model, SearchTool(client), AccessTool(retriever=client))
    result = agent.run(q)
    assert "access" in model.calls[0]["messages"][0]["content"]
    first_id = client.batch_retrieve([q])[0][0]["id"]
    whole = client.batch_access([first_id])[0]["contents"]
    assert render_passages([whole], start=4).strip() in model.calls[2]["messages"][-1]["content"]
    assert "there is no document with id 'no-such-doc'" in model.calls[4]["messages"][-1]["content"]
    assert [t.get("id") for t in result["tool_calls"][1:3]] == [first_id, gold_id]
    assert [s["id"] for s in result["sources"]] == [gold_id] and result["budget"]["tool_calls"] == 4


def test_access_is_not_offered_unless_configured_and_urls_need_web_access(client, question):
    model = ScriptedChat({"toolcall": [
        '<tool_call>{"name": "access", "arguments": {"target": "1"}}</tool_call>', "<answer> a </answer>"]})
    ToolCallAgent(model, SearchTool(client)).run(question["question"])
    assert "access" not in model.calls[0]["messages"][0]["content"]
    assert "no tool named 'access'" in model.calls[1]["messages"][-1]["content"]
    model = ScriptedChat({"toolcall": [
        '<tool_call>{"name": "access", "arguments": {"url": "http://169.254.169.254/latest"}}</tool_call>',
        "<answer> a </answer>"]})
    ToolCallAgent(model, SearchTool(client), AccessTool(retriever=client)).run(question["question"])
    assert "reading web pages is switched off" in model.calls[1]["messages"][-1]["content"]


def test_default_date_is_today(client, question):
    model = ScriptedChat({"toolcall": ["<answer> a </answer>"]})
    ToolCallAgent(model, SearchTool(client)).run(question["question"])
    assert f"Today is {datetime.date.today().isoformat()}" in model.calls[0]["messages"][0]["content"]


def test_wall_time_budget_forces_the_answer_and_is_in_the_trace(client, question):
    import time

    q = question["question"]

    def slow_search(_messages):
        time.sleep(0.3)
        return search_call(q)

    model = ScriptedChat({"toolcall": [slow_search]}, fallback="<answer> late </answer>")
    result = ToolCallAgent(model, SearchTool(client), config=ToolCallConfig(
        budgets=Budgets(max_steps=8, max_tool_calls=5, max_tokens=4096, max_seconds=0.2))).run(q)
    (hit,) = result["budget"]["hits"]
    assert hit["budget"] == "seconds" and hit["used"] >= 0.2 and result["answer"] == "late"
    assert len(model.calls) == 2 and result["search_queries"] == [q]
    budget_events = [e for e in result["events"] if e["kind"] == "budget"]
    assert budget_events and budget_events[0]["budget"] == "seconds"


def test_a_context_overflow_forces_the_answer_without_the_newest_tool_responses(client, question):
    q, gold = question["question"], question["golden_answers"][0]

    def answer(messages):  # fits once the tool response is dropped
        if "Doc 1(Title:" in messages[-2]["content"]:
            raise_overflow()
        return f"<answer> {gold} </answer>"

    model = ScriptedChat({"toolcall": [search_call(q), OVERFLOW, OVERFLOW, answer]})
    result = ToolCallAgent(model, SearchTool(client)).run(q)
    last = model.calls[-1]["messages"]
    assert last[-2]["content"] == f"<tool_response>{P.TOOLCALL_DROPPED}</tool_response>"
    assert "filled your context window" in last[-1]["content"] and model.calls[-1]["stop"] == ()
    assert result["answer"] == gold and result["forced_answer"] and result["error"] is None
    assert "does not fit" in result["overflow"]
    assert [e["kind"] for e in result["events"]].count("overflow") == 2


def raise_overflow():
    from search_r1.agents.chat import ContextOverflow

    raise ContextOverflow("scripted: too long")


def test_a_question_the_context_cannot_hold_and_a_server_error_are_recorded_errors(client, question):
    q = question["question"]
    overflowing = ToolCallAgent(ScriptedChat({"toolcall": [OVERFLOW, OVERFLOW]}), SearchTool(client)).run(q)
    assert overflowing["answer"] is None and overflowing["error"].startswith("context overflow")
    assert overflowing["format_valid"] is False
    down = ToolCallAgent(ScriptedChat({"toolcall": [search_call(q), SERVER_DOWN]}), SearchTool(client)).run(q)
    assert down["answer"] is None and down["error"].startswith("server error: scripted: the server is down")
    assert down["searches"] == 1 and down["events"][-1]["kind"] == "error"
