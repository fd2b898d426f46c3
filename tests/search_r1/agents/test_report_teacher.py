"""The report agent's demonstrations (search_r1.agents.report_teacher, report_warmstart) and its run
figures (report_metrics): the teacher drives the real agent against the real retriever to a full report,
the demonstrations are exactly the agent's calls with loss on the replies alone, and the figures count
what the trace shows."""
from __future__ import annotations

import json

import pytest

from search_r1.agents.report_metrics import run_metrics
from search_r1.agents.report_teacher import (Hop, Recorder, ReportTeacher, demonstration_run, hops_of,
                                             relevant_sentences)
from search_r1.agents.tools import AccessTool, SearchTool
from search_r1.agents.weaver import WeaverAgent
from search_r1.trainer.warmstart import _train_rows


@pytest.fixture(scope="module")
def rows(synth_world):
    return _train_rows([synth_world / "train.parquet"])


def test_relevant_sentences_keep_every_sentence_on_the_goal_in_page_order():
    page = ("Established in 1723, University of Tadak is a university in Tadak. It was founded by Zai Perva. "
            "It has a library.")
    # "founder" meets "founded" at the 5-letter stem; "library" shares nothing with the goal
    assert relevant_sentences(page, "Where was the founder of University of Tadak born?") == (
        "Established in 1723, University of Tadak is a university in Tadak. It was founded by Zai Perva.")
    assert relevant_sentences(page, "Who sings?") == "Established in 1723, University of Tadak is a university in Tadak."


def test_hops_follow_the_question_record():
    two = {"question": "Q?", "golden_answers": ["Gold"], "hops": 2, "subject": "S", "bridge": "B", "follow_up": "F?"}
    assert hops_of(two) == [Hop("Q?", ("S", "B")), Hop("F?", ("B", "Gold"))]
    assert hops_of({**two, "hops": 1}) == [Hop("Q?", ("S", "Gold"))]


def test_the_teacher_writes_a_full_cited_report_through_the_real_agent(rows, client, tmp_path):
    """Two-hop training questions: wherever the retriever returns the evidence, the agent (driven by the
    teacher) searches twice, reads two pages, outlines three sections, writes them with citations of
    retrieved documents and answers with the gold answer; where it does not, the run is rejected."""
    kept = reasons = 0
    for i, row in enumerate([r for r in rows if r["hops"] == 2][:40]):
        recorder = Recorder(ReportTeacher(rows))
        result = WeaverAgent(recorder, SearchTool(client), AccessTool(retriever=client)).run(row["question"],
                                                                                               tmp_path / str(i))
        why = demonstration_run(result, row)
        if why is not None:
            reasons += 1
            assert why == "evidence_not_retrieved", why
            continue
        kept += 1
        trace = json.loads((tmp_path / str(i) / "trace.json").read_text())
        m = run_metrics(trace)
        assert m["finished"] and m["sections"] == 3 and m["invalid_actions"] == 0
        assert m["cites"] >= 4 and m["valid_cites"] == m["cites"]  # 1 + 1 + 2 (the Answer section cites both)
        assert [c["role"] for c in recorder.calls] == [
            "planner", "planner", "summarizer", "planner", "planner", "summarizer", "planner", "outline", "planner",
            "writer", "writer", "writer", "writer", "writer", "writer", "answer"]
        assert result["search_queries"] == [row["question"], row["follow_up"]]
        assert [s["heading"] for s in result["sections"]] == [row["subject"], row["bridge"], "Answer"]
        assert result["answer"] == row["golden_answers"][0]
        assert row["golden_answers"][0] in (tmp_path / str(i) / "report.md").read_text()
    assert kept >= 3, (kept, reasons)


def test_demonstrations_train_only_the_replies(rows, client):
    from search_r1.agents.report_warmstart import report_demos
    from tests.search_r1.rollout.scripted import smollm2_tokenizer

    tok = smollm2_tokenizer()
    demos, stats = report_demos(rows, SearchTool(client), AccessTool(retriever=client), tok, n_questions=2, seed=0,
                                two_hop_share=0.5)
    assert stats["kept_2_hop"] == 1 and stats["kept_1_hop"] == 1, stats
    # a two-hop run makes 16 calls (the test above), a single-hop one 11 (4 planner, 1 summarizer, 1 outline,
    # 2 sections x 2 writer turns, 1 answer): one demonstration per call
    assert len(demos) == 16 + 11 == sum(v for k, v in stats.items() if k.startswith("calls_"))
    for d in demos:
        first = d.loss_mask.index(1)
        assert set(d.loss_mask[:first]) == {0} and set(d.loss_mask[first:]) == {1}  # prompt, then the reply
        assert tok.decode(d.input_ids[first:]) == d.response_text
        assert tok.decode(d.input_ids[:first]).endswith("<|im_start|>assistant\n")  # the generation prompt
    replies = [d.response_text for d in demos]
    assert any(r.startswith("<search>") for r in replies) and any(r.startswith("<access>") for r in replies)
    assert any(r.startswith("<outline>") for r in replies) and any(r.startswith("<write>") for r in replies)


def test_run_metrics_counts_only_citations_of_retrieved_documents():
    trace = {"outline": "## a\n## b\n## c", "invalid_actions": 1,
             "events": [{"kind": "search", "ids": ["10", "11"]}, {"kind": "access", "ids": ["99"]}],
             "memory_bank": [{"id": 1, "source": {"id": "10"}}, {"id": 2, "source": {"id": "99"}}],
             "writer": {"sections": [
                 {"status": "written", "text": "x <cite><id>1</id></cite>"},
                 {"status": "written", "text": "y <cite><id>2</id>, <id>7</id></cite>"},  # 2: not searched; 7: unknown
                 {"status": "written", "text": "z <cite><id>1</id></cite>"},
                 {"status": "not written (writer stopped)", "text": "", "cites": [1]}]}}
    assert run_metrics(trace) == {"finished": True, "sections": 3, "cites": 4, "valid_cites": 2, "invalid_actions": 1}
    trace["writer"]["sections"][2]["status"] = "not written (context overflow)"
    assert run_metrics(trace)["finished"] is False  # two written sections
