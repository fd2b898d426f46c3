"""The report agent end to end against the real retriever server over the synthetic corpus, driven
by a scripted chat model: every planner and writer action (malformed ones included), the
summarizer's isolation, memory-bank ids and the outline flag, outline citations with an unknown id,
the writer receiving exactly the cited summaries, report.md, the answer, resume from trace.json,
and the step budget."""
from __future__ import annotations

import json

import pytest

from search_r1.agents.budget import Budgets
from search_r1.agents.memory import MemoryBank, cited_ids, ids_in, outline_sections, parse_summary, render_citations
from search_r1.agents.tools import AccessTool, SearchTool
from search_r1.agents.weaver import WeaverAgent, WeaverConfig, parse_planner_action
from search_r1.search.format import split_title
from tests.search_r1.agents.scripted import CRASH, OVERFLOW, SERVER_DOWN, ScriptCrash, ScriptedChat

OUTLINE = ("<outline>## The answer <cite><id>1</id></cite>\n- what the record says <cite><id>2</id>, <id>9</id></cite>\n"
           "## Background <cite><id>2</id></cite>\n- context</outline>")


def planner_script(q: str, gold_id: str) -> list:
    return [
        f"<search> {q} </search> more text after the stop",
        f"<access> {gold_id} </access>",                                   # no goal: corrected
        f"<access> {gold_id} <goal> find what the question asks </goal> </access>",
        "<access> Doc 2 <goal> background on the subject </goal> </access>",  # a result by number
        "I am not sure what to do.",                                         # no action: corrected
        "<write_outline></write_outline>",
        "<write_outline></write_outline>",                                   # nothing new since
        "<access> no-such-doc <goal> x </goal> </access>",                   # unknown id: tool error
        "<terminate></terminate>",
    ]


def scripts(q: str, gold: str, gold_id: str) -> dict:
    return {
        "planner": planner_script(q, gold_id),
        "summarizer": [f"<rational>the first sentence</rational><evidence>quoted</evidence><summary>SUMMARY-A: "
                       f"{gold}</summary>", "Rational: the middle\nEvidence: a quote\nSummary: SUMMARY-B"],
        "outline": [OUTLINE],
        "writer": ["<retrieve><id>1</id>, <id>2</id>, <id>9</id></retrieve>",
                   f"<write>{gold} is the answer <cite><id>1</id></cite>.</write>",
                   "<retrieve><id>2</id></retrieve>", "no action here",
                   "<write>Background text.</write>"],
        "answer": [f"<think>the report says</think><answer> {gold} </answer>"],
    }


def corpus_of(client, doc_id):
    return split_title(client.batch_access([doc_id])[0]["contents"])


def test_every_action_end_to_end(client, question, tmp_path):
    q, gold, gold_id = question["question"], question["golden_answers"][0], question["gold_doc_ids"][0]
    model = ScriptedChat(scripts(q, gold, gold_id))
    result = WeaverAgent(model, SearchTool(client), AccessTool(retriever=client),
                         WeaverConfig(date="2026-11-23")).run(q, tmp_path)
    hits = client.batch_retrieve([q])[0]

    planner = model.of("planner")
    assert all(c["stop"] == ("</search>", "</access>", "</write_outline>", "</terminate>") for c in planner)
    msgs = planner[-1]["messages"]
    observations = [m["content"] for m in msgs if m["role"] == "user"][1:]
    assert msgs[2]["content"] == f"<search> {q} </search>"  # cut at the stop string
    assert [f"(id: {h['id']})" in observations[0] for h in hits] == [True] * 3
    assert "needs a goal" in observations[1] and "no valid action" in observations[4]
    assert "Summary <id>1</id>" in observations[2] and "SUMMARY-A" in observations[2]
    assert "Summary <id>2</id>" in observations[3] and "SUMMARY-B" in observations[3]
    assert "does not hold: [9]" in observations[5] and "No new summaries" in observations[6]
    assert "there is no document with id 'no-such-doc'" in observations[7]

    # the summarizer saw only the page and the goal
    summarizer = model.of("summarizer")
    assert len(summarizer) == 2
    for call, (doc_id, goal) in zip(summarizer, [(gold_id, "find what the question asks"),
                                                 (hits[1]["id"], "background on the subject")]):
        title, text = corpus_of(client, doc_id)
        assert [m["role"] for m in call["messages"]] == ["system", "user"]
        assert call["messages"][1]["content"] == f"Goal: {goal}\n\nDocument:\n{title}\n{text}"
        assert q not in json.dumps(call["messages"]) and "SUMMARY-A" not in json.dumps(call["messages"])

    # memory bank, counter and flag, as saved in trace.json
    trace = json.loads((tmp_path / "trace.json").read_text())
    bank = trace["memory_bank"]
    assert [e["id"] for e in bank] == [1, 2] and trace["summary_id_counter"] == 2 and trace["summary_id_flag"] == 2
    assert [e["source"]["id"] for e in bank] == [gold_id, hits[1]["id"]]
    assert bank[0]["summary"] == f"SUMMARY-A: {gold}" and bank[0]["rational"] == "the first sentence"
    assert (bank[1]["rational"], bank[1]["evidence"], bank[1]["summary"]) == ("the middle", "a quote", "SUMMARY-B")

    # outline: saw the two new summaries; cites [1, 2, 9], 9 unknown
    (outline_call,) = model.of("outline")
    assert "[1]" in outline_call["messages"][1]["content"] and "[2]" in outline_call["messages"][1]["content"]
    assert trace["outlines"][0]["cites"] == [1, 2, 9] and trace["outlines"][0]["unknown"] == [9]
    assert trace["outlines"][0]["took_in"] == [1, 2]

    # writer: each section in a fresh conversation, retrieve returns exactly what was asked for
    writer = model.of("writer")
    first_obs = writer[1]["messages"][-1]["content"]
    assert "SUMMARY-A" in first_obs and "SUMMARY-B" in first_obs and "Unknown ids: [9]" in first_obs
    section2 = writer[2]["messages"]
    assert len(section2) == 2 and "section 2 of 2: Background" in section2[1]["content"]
    assert "<cite><id>2</id></cite>" in section2[1]["content"]
    write_ctx = json.dumps(writer[4]["messages"])
    assert "SUMMARY-B" in write_ctx and "SUMMARY-A" not in write_ctx  # exactly the cited summary
    assert "no valid action" in writer[4]["messages"][-1]["content"]
    sections = trace["writer"]["sections"]
    assert [s["retrieved"] for s in sections] == [[1, 2], [2]] and [s["cites"] for s in sections] == [[1, 2, 9], [2]]

    # report.md: sections with resolvable citations and a reference list
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(f"# {q}\n") and "## The answer" in report and "## Background" in report
    assert f"{gold} is the answer [1]." in report and "Sources: [2]" in report
    title1, _ = corpus_of(client, gold_id)
    assert f"[1] {title1} (doc {gold_id}); goal: find what the question asks" in report
    assert f"[2] {hits[1]['contents'].split(chr(10))[0].strip(chr(34))} (doc {hits[1]['id']})" in report

    # answer from report, outline and history
    (answer_call,) = model.of("answer")
    assert "SUMMARY-A" in answer_call["messages"][1]["content"] and report.strip() in answer_call["messages"][1]["content"]
    assert result["answer"] == gold and result["searches"] == 1 and result["invalid_actions"] == 4
    assert trace["phase"] == "done" and trace["budget"]["tool_calls"] == 4 and trace["budget"]["steps"] == 9


def test_resume_from_the_trace_after_a_crash(client, question, tmp_path):
    q, gold, gold_id = question["question"], question["golden_answers"][0], question["gold_doc_ids"][0]
    full = scripts(q, gold, gold_id)
    crashing = dict(full, planner=full["planner"][:3] + [CRASH])
    first = ScriptedChat(crashing)
    agent_args = (SearchTool(client), AccessTool(retriever=client))
    with pytest.raises(ScriptCrash):
        WeaverAgent(first, *agent_args).run(q, tmp_path)
    saved = json.loads((tmp_path / "trace.json").read_text())
    assert saved["phase"] == "planner" and [e["id"] for e in saved["memory_bank"]] == [1]
    assert saved["budget"]["steps"] == 3 and len(saved["planner"]["messages"]) == 2 + 2 * 3

    second = ScriptedChat(dict(full, planner=full["planner"][3:], summarizer=full["summarizer"][1:]))
    result = WeaverAgent(second, *agent_args).run(q, tmp_path)
    resumed = second.of("planner")[0]["messages"]
    assert resumed == saved["planner"]["messages"]  # the saved history, nothing redone
    assert [c["role"] for c in second.calls].count("summarizer") == 1
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [e["id"] for e in trace["memory_bank"]] == [1, 2]  # the counter continued
    assert trace["budget"]["steps"] == 9 and result["answer"] == gold
    assert any(e["kind"] == "resume" for e in trace["events"])
    with pytest.raises(ValueError, match="another question"):
        WeaverAgent(second, *agent_args).run("a different question?", tmp_path)


def test_step_budget_forces_terminate_and_a_last_outline(client, question, tmp_path):
    q, gold_id = question["question"], question["gold_doc_ids"][0]
    model = ScriptedChat({
        "planner": [f"<search> {q} </search>", f"<access> {gold_id} <goal> g </goal> </access>",
                    f"<search> {q} again </search>"],
        "summarizer": ["<summary>S1</summary>"],
        "outline": ["## Only <cite><id>1</id></cite>"],   # no <outline> tags: the whole reply
        "writer": ["<write_terminate></write_terminate>"],
        "answer": ["no tags at all"],
    })
    cfg = WeaverConfig(budgets=Budgets(max_steps=3, max_tool_calls=10, max_tokens=10_000, max_seconds=60))
    result = WeaverAgent(model, SearchTool(client), AccessTool(retriever=client), cfg).run(q, tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [h["budget"] for h in trace["budget"]["hits"]] == ["steps"]
    assert trace["budget"]["hits"][0]["then"] == "terminating the planner"
    assert trace["outline"] == "## Only <cite><id>1</id></cite>" and trace["summary_id_flag"] == 1
    assert trace["writer"]["terminated"] and trace["writer"]["sections"][0]["status"] == "not written (writer stopped)"
    assert "(no section was written)" in (tmp_path / "report.md").read_text()
    assert result["answer"] is None and result["format_valid"] is False


def test_tool_call_budget_refuses_further_searches(client, question, tmp_path):
    q = question["question"]
    model = ScriptedChat({"planner": [f"<search> {q} </search>", "<search> more </search>", "<terminate></terminate>"],
                          "answer": ["<answer> a </answer>"]})
    cfg = WeaverConfig(budgets=Budgets(max_steps=10, max_tool_calls=1, max_tokens=10_000, max_seconds=60))
    WeaverAgent(model, SearchTool(client), AccessTool(retriever=client), cfg).run(q, tmp_path)
    assert "budget of 1 searches and reads is used up" in model.of("planner")[2]["messages"][-1]["content"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["budget"]["tool_calls"] == 1 and trace["budget"]["hits"][0]["budget"] == "tool_calls"


def test_context_overflows_end_each_phase_with_what_the_memory_holds(client, question, tmp_path):
    """The planner overflows after one summary: it ends, the outline is written from the memory bank; the
    first section's writer overflows: the section is skipped; the answer overflows once: asked again
    from the report alone. The run finishes with an answer and the overflows recorded, no error."""
    q, gold, gold_id = question["question"], question["golden_answers"][0], question["gold_doc_ids"][0]
    model = ScriptedChat({
        "planner": [f"<search> {q} </search>", f"<access> {gold_id} <goal> g </goal> </access>", OVERFLOW],
        "summarizer": [f"<summary>S1 {gold}</summary>"],
        "outline": ["<outline>## First <cite><id>1</id></cite>\n## Second <cite><id>1</id></cite></outline>"],
        "writer": [OVERFLOW, "<write>Second text <cite><id>1</id></cite>.</write>"],
        "answer": [OVERFLOW, f"<answer> {gold} </answer>"],
    })
    result = WeaverAgent(model, SearchTool(client), AccessTool(retriever=client)).run(q, tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [o["phase"] for o in trace["overflows"]] == ["planner", "writer", "answer"]
    assert trace["planner"]["terminated"] and trace["outlines"][0]["took_in"] == [1]
    assert [s["status"] for s in trace["writer"]["sections"]] == ["not written (context overflow)", "written"]
    assert "Second text [1]." in (tmp_path / "report.md").read_text()
    compact = model.of("answer")[1]["messages"][1]["content"]
    assert "(omitted)" in compact and "Second text" in compact
    assert result["answer"] == gold and result["error"] is None and "planner:" in result["overflow"]
    kinds = [e["kind"] for e in trace["events"]]
    assert kinds.count("overflow") == 3 and trace["phase"] == "done"


def test_an_answer_that_cannot_fit_is_an_error_and_a_resume_does_not_redo_it(client, question, tmp_path):
    q = question["question"]
    model = ScriptedChat({"planner": [OVERFLOW], "answer": [OVERFLOW, OVERFLOW]})
    agent_args = (SearchTool(client), AccessTool(retriever=client))
    result = WeaverAgent(model, *agent_args).run(q, tmp_path)
    assert result["answer"] is None and result["error"].startswith("context overflow in the answer")
    assert json.loads((tmp_path / "trace.json").read_text())["phase"] == "done"
    again = ScriptedChat({})  # any model call would fail: the finished run is not redone
    assert WeaverAgent(again, *agent_args).run(q, tmp_path)["error"] == result["error"] and again.calls == []


def test_a_server_error_stops_the_run_and_a_resume_retries_the_failed_step(client, question, tmp_path):
    q, gold = question["question"], question["golden_answers"][0]
    first = ScriptedChat({"planner": [f"<search> {q} </search>", SERVER_DOWN]})
    agent_args = (SearchTool(client), AccessTool(retriever=client))
    result = WeaverAgent(first, *agent_args).run(q, tmp_path)
    assert result["error"].startswith("server error in the planner") and result["answer"] is None
    saved = json.loads((tmp_path / "trace.json").read_text())
    assert saved["phase"] == "planner" and saved["budget"]["steps"] == 1
    second = ScriptedChat({"planner": ["<terminate></terminate>"], "answer": [f"<answer> {gold} </answer>"]})
    result = WeaverAgent(second, *agent_args).run(q, tmp_path)
    assert result["error"] is None and result["answer"] == gold
    assert second.of("planner")[0]["messages"] == saved["planner"]["messages"]  # resumed at the failed step


# -- the pieces ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("<search> a b </search>", ("search", "a b", "")),
    ("<access> 12 <goal> who </goal> </access>", ("access", "12", "who")),
    ("<access>https://x.org/p<goal>g</goal></access>", ("access", "https://x.org/p", "g")),
    ("<write_outline></write_outline>", ("write_outline", "", "")),
    ("<terminate/>", ("terminate", "", "")),
    ("<search>   </search>", ("invalid", "the search query is empty", "")),
    ("<access><goal>g</goal></access>", ("invalid", "an access needs a document id or URL before the <goal>", "")),
])
def test_parse_planner_action(text, expected):
    assert parse_planner_action(text) == expected


def test_memory_bank_flag_and_lookup():
    bank = MemoryBank()
    for i in range(3):
        bank.add({"kind": "doc", "id": str(i), "title": f"T{i}"}, "g", "", "", f"s{i}")
    assert [e.id for e in bank.since_flag()] == [1, 2, 3]
    bank.advance_flag()
    assert bank.since_flag() == []
    bank.add({"kind": "web", "id": "https://x.org", "title": "X"}, "g", "", "", "s3")
    assert [e.id for e in bank.since_flag()] == [4] and bank.entries[4].label() == "X (<https://x.org>)"
    found, unknown = bank.lookup([4, 7, 1])
    assert [e.id for e in found] == [4, 1] and unknown == [7]
    again = MemoryBank(**{"entries": bank.state()["memory_bank"], "counter": 4, "flag": 3})
    assert [e.id for e in again.since_flag()] == [4]
    with pytest.raises(ValueError, match="inconsistent memory bank"):
        MemoryBank(bank.state()["memory_bank"], counter=2, flag=0)


def test_citations_sections_and_summaries():
    assert cited_ids("a <cite><id>3</id>, <id>1</id></cite> b <cite><id>3</id></cite> <id>8</id>") == [3, 1]
    assert ids_in("<id>2</id>,<id> 5 </id>") == [2, 5] and ids_in("1, 3") == [1, 3]
    assert render_citations("x <cite><id>1</id>, <id>3</id></cite>.") == "x [1][3]."
    secs = outline_sections(OUTLINE[len("<outline>"):-len("</outline>")])
    assert [(s["heading_text"], s["cites"]) for s in secs] == [("The answer", [1, 2, 9]), ("Background", [2])]
    assert [s["heading_text"] for s in outline_sections("1. First\n2. Second <cite><id>4</id></cite>")] == \
        ["First", "Second"]
    assert parse_summary("no structure at all")["parsed"] is False
    assert parse_summary("**Rationale**: r\n**Evidence**: e\n**Summary**: s") == \
        {"rational": "r", "evidence": "e", "summary": "s", "parsed": True}
