"""Both agents' command lines: batches scored like `search_r1.evaluation` (predictions.jsonl, results.json,
per-source table, resume, concurrency) and single questions with a live trace, against the real
retriever server and a vLLM-shaped fake chat server (tests/search_r1/agents/fake_chat_server.py)."""
from __future__ import annotations

import json
import re
import time

import pytest

from search_r1.agents import toolcall, weaver
from search_r1.agents.cli import build_parser
from tests.search_r1.agents.fake_chat_server import Fail, context_overflow
from tests.search_r1.agents.scripted import role_of


@pytest.fixture(scope="module")
def golds(synth_world):
    with open(synth_world / "test.jsonl") as f:
        return {r["question"]: r["golden_answers"][0] for r in map(json.loads, f)}


def question_of(messages) -> str:
    for m in messages:
        found = re.search(r"Question: (.*?)\??$", m["content"], re.MULTILINE)
        if m["role"] == "user" and found:
            return found.group(1) + "?"
    raise AssertionError("no question in the conversation")


def toolcall_responder(golds):
    def respond(messages):
        time.sleep(0.2)  # long enough for concurrent questions to overlap
        q = question_of(messages)
        if not any(m["content"].startswith("<tool_response>") for m in messages):
            return f'<tool_call>{{"action": "web_search", "action_input": {{"query": "{q}"}}}}</tool_call>'
        return f"<answer> {golds[q]} </answer> Sources: Doc 1"
    return respond


def test_toolcall_batch_scores_resumes_and_runs_concurrently(chat_server, retriever_server, synth_world, golds,
                                                             tmp_path, capsys):
    srv = chat_server(toolcall_responder(golds))
    out = tmp_path / "run"
    argv = ["--model", "served-model", "--base-url", srv.base_url, "--retriever-url", retriever_server.base_url,
            "--data", str(synth_world / "test.parquet"), "--limit", "6", "--out", str(out), "--concurrency", "3",
            "--no-progress"]
    assert toolcall.main(argv) == 0
    printed = capsys.readouterr().out
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    results = json.loads((out / "results.json").read_text())
    assert len(preds) == 6 and results["n"] == 6 and results["mode"] == "agent:toolcall"
    assert all(p["em"] == 1.0 and p["searches"] == 1 and p["format_valid"] == 1.0 and p["cited"] for p in preds)
    assert all(p["search_queries"] == [p["question"]] and p["sources"][0]["number"] == 1 for p in preds)
    assert results["metrics"]["overall"]["em"] == 1.0 and set(results["metrics"]["per_source"]) <= {
        "synth_nq", "synth_hotpotqa"}
    assert "| **overall** | 6 | 1.000 |" in printed
    assert srv.max_in_flight > 1 and len(srv.requests) == 12
    assert all("continue_final_message" not in r for r in srv.requests)  # servers get tool responses as messages
    # resume: nothing is asked again; a changed setting is refused
    assert toolcall.main(argv) == 0 and len(srv.requests) == 12
    assert "resuming: 6 of 6" in capsys.readouterr().err
    assert toolcall.main(argv + ["--topk", "2"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_toolcall_batch_survives_server_errors_per_question_and_resume_retries_them(
        chat_server, retriever_server, synth_world, golds, tmp_path, capsys):
    """One question is refused (403), one overflows the context window however it is asked, one meets a
    server that is down (503 after the retries), one overflows after its search and is answered once
    the tool response is dropped. The batch goes on, counts the errors and scores the rest; a second
    run retries the errored questions only."""
    from search_r1.evaluation.runner import load_questions, select_examples

    picked = [ex.question for ex in select_examples(load_questions([str(synth_world / "test.parquet")]), 6, None, 0)]
    forbidden, too_long, down, long_search = picked[:4]
    healthy = {"now": False}
    plain = toolcall_responder(golds)

    def respond(messages):
        q = question_of(messages)
        if not healthy["now"] and q in (forbidden, too_long, down):
            return {forbidden: Fail(403, "Forbidden: this key may not use the model"),
                    too_long: context_overflow(2048, 3000, 512), down: Fail(503, "Service Unavailable")}[q]
        if q == long_search and any("Doc 1(Title:" in m["content"] for m in messages):  # its search results
            return context_overflow(2048, 2100, 512)
        return plain(messages)

    srv = chat_server(respond)
    out = tmp_path / "run"
    argv = ["--model", "served-model", "--base-url", srv.base_url, "--retriever-url", retriever_server.base_url,
            "--data", str(synth_world / "test.parquet"), "--limit", "6", "--out", str(out), "--concurrency", "2",
            "--no-progress", "--retries", "1", "--request-timeout", "30"]
    assert toolcall.main(argv) == 0
    printed = capsys.readouterr().out
    preds = {p["question"]: p for p in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    assert len(preds) == 6
    assert "403" in preds[forbidden]["error"] and "Forbidden" in preds[forbidden]["error"]
    assert preds[too_long]["error"].startswith("context overflow") and "maximum context length" in preds[too_long]["error"]
    assert "failed after 2 attempts" in preds[down]["error"] and "503" in preds[down]["error"]
    assert all(preds[q]["em"] is None and preds[q]["answered"] == 0.0 for q in (forbidden, too_long, down))
    assert preds[long_search]["error"] is None and preds[long_search]["em"] == 1.0 and preds[long_search]["overflow"]
    results = json.loads((out / "results.json").read_text())
    assert results["errors"]["n"] == 3 and results["n"] == 3 and results["metrics"]["overall"]["n"] == 3
    assert results["metrics"]["overall"]["em"] == 1.0  # errored questions are not scored
    assert "| **overall** | 3 | 1.000 |" in printed and "errors: 3 of 6 questions ended in an error" in printed
    # resume: the errored questions are asked again (the server works now), the others are kept
    healthy["now"] = True
    asked = len(srv.requests)
    assert toolcall.main(argv) == 0
    assert "retrying 3 that ended in an error" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["errors"]["n"] == 0 and results["n"] == 6 and results["metrics"]["overall"]["n"] == 6
    assert len(srv.requests) - asked == 3 * 2  # two turns for each retried question, none for the rest


def test_every_question_failing_is_a_failed_batch(chat_server, retriever_server, synth_world, tmp_path, capsys):
    srv = chat_server(lambda messages: "never", api_key="sk-right")
    argv = ["--model", "served-model", "--base-url", srv.base_url, "--retriever-url", retriever_server.base_url,
            "--data", str(synth_world / "test.parquet"), "--limit", "2", "--out", str(tmp_path), "--no-progress",
            "--no-api-key"]
    assert toolcall.main(argv) == 1
    err = capsys.readouterr().err
    assert "every question ended in an error" in err and "rejected the API key" in err
    assert srv.auth == [None, None]  # --no-api-key: no Authorization header at all


def test_agents_cli_plain_http_needs_the_agents_own_opt_in(retriever_server, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    argv = ["--model", "m", "--base-url", "http://10.0.0.8:8000/v1", "--retriever-url", retriever_server.url,
            "--question", "q?"]
    assert toolcall.main(argv) == 2
    err = capsys.readouterr().err
    assert "--allow-insecure-http" in err and "--no-api-key" in err and "SearchR1Config" not in err
    assert "sk-secret" not in err


def weaver_responder(golds):
    def respond(messages):
        role, q = role_of(messages), None
        if role == "planner":
            seen = "\n".join(m["content"] for m in messages)
            if "(id: " not in seen:
                return f"<search> {question_of(messages)} </search>"
            if "Summary <id>" not in seen:
                doc_id = re.search(r"\(id: ([^)]+)\)", seen).group(1)
                return f"<access> {doc_id} <goal> the answer </goal> </access>"
            return "<write_outline></write_outline>" if "Outline version" not in seen else "<terminate></terminate>"
        if role == "summarizer":
            return "<rational>start</rational><evidence>quote</evidence><summary>a summary</summary>"
        if role == "outline":
            return "<outline>## Finding <cite><id>1</id></cite></outline>"
        if role == "writer":
            if "<information>" in messages[-1]["content"]:
                return "<write>The finding <cite><id>1</id></cite>.</write>"
            return "<retrieve><id>1</id></retrieve>"
        q = question_of(messages)
        return f"<answer> {golds[q]} </answer>"
    return respond


def test_weaver_batch_writes_a_report_per_question(chat_server, retriever_server, synth_world, golds, tmp_path):
    srv = chat_server(weaver_responder(golds))
    out = tmp_path / "weaver"
    argv = ["--model", "served-model", "--base-url", srv.base_url, "--retriever-url", retriever_server.url,
            "--data", str(synth_world / "test.parquet"), "--limit", "2", "--out", str(out), "--concurrency", "2",
            "--no-progress"]
    assert weaver.main(argv) == 0
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 2 and all(p["em"] == 1.0 and p["searches"] == 1 for p in preds)
    for p in preds:
        run_dir = out / "runs" / p["id"]
        report = (run_dir / "report.md").read_text()
        trace = json.loads((run_dir / "trace.json").read_text())
        assert p["report_path"] == str(run_dir / "report.md")
        assert "The finding [1]." in report and "## References" in report and trace["phase"] == "done"
        assert [e["id"] for e in trace["memory_bank"]] == [1] and trace["outlines"][0]["cites"] == [1]


def test_single_question_live_trace_and_result_file(chat_server, retriever_server, golds, tmp_path, capsys):
    srv = chat_server(toolcall_responder(golds))
    q = next(iter(golds))
    assert toolcall.main(["--model", "served-model", "--base-url", srv.base_url, "--retriever-url",
                          retriever_server.url, "--question", q, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"toolcall\s+search\s+\"" + re.escape(q) + r"\" -> Doc 1 ", printed)
    assert f"Answer: {golds[q]}" in printed and "Sources (cited):" in printed and "[Doc 1]" in printed
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["answer"] == golds[q] and saved["events"][-1]["kind"] == "answer"


def test_weaver_single_question_needs_out_and_bad_flags_fail_cleanly(retriever_server, capsys):
    assert weaver.main(["--model", "m", "--base-url", "http://127.0.0.1:9", "--retriever-url",
                        retriever_server.url, "--question", "q?"]) == 2
    assert "--out DIR is needed" in capsys.readouterr().err
    assert toolcall.main(["--model", "m", "--retriever-url", retriever_server.url]) == 2
    assert "pass --question TEXT" in capsys.readouterr().err
    assert toolcall.main(["--model", "m", "--question", "q", "--retriever-url", "x", "--web-search", "serper"]) == 2
    assert "exactly one of --retriever-url, --retriever-index, --web-search" in capsys.readouterr().err


@pytest.mark.parametrize("agent", ["toolcall", "weaver"])
def test_help_explains_every_flag(agent, capsys):
    parser = build_parser(agent)
    for action in parser._actions:
        assert action.help and len(action.help) > 10, f"{agent}: {action.option_strings} has no help"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--concurrency" in text and "--allow-private-urls" in text and "--max-tool-calls" in text
    for flag in ("--allow-insecure-http", "--no-api-key", "--request-timeout", "--retries", "--web-rate-limit"):
        assert flag in text
