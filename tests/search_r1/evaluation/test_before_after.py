"""The demo's closing summary (search_r1.evaluation.before_after) on a hand-written val_predictions.jsonl."""
from __future__ import annotations

import json

import pytest

from search_r1.evaluation.before_after import change_is_beyond_noise, main, report, trajectory


def _record(step, qid, em, response, source="synth_nq"):
    return {"step": step, "id": qid, "data_source": source, "question": f"question {qid}?",
            "golden_answers": [f"gold {qid}"], "em": float(em), "f1": float(em), "format_valid": 1.0,
            "searches": float(response.count("<search>") - response.count("<information><search>")),
            "response": response}


def _turn(query=None, answer=None, passage=""):
    text = "<think> x </think>"
    if query is not None:
        text += f"<search> {query} </search>\n\n<information>{passage}</information>\n\n"
    return text + (f"<answer> {answer} </answer>" if answer is not None else "")


def _write(tmp_path, before: list[dict], after: list[dict]):
    (tmp_path / "val_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before + after))
    return tmp_path


def test_trajectory_reads_queries_and_answer_but_not_text_inside_passages():
    response = (_turn("who founded X", passage="Doc 1: <search> a quoted query </search> <answer> no </answer>")
                + _turn("where is Y") + "<answer> Paris </answer>")
    assert trajectory({"response": response}) == (["who founded X", "where is Y"], "Paris")
    assert trajectory({"response": "<think> hmm"}) == ([], None)
    # the environment's reminder after an invalid action quotes the tags; it is not the model's action
    from search_r1.protocol import invalid_action_observation

    looped = "<think> Look up X. </think>" + invalid_action_observation("tags") + "<think> Look up X."
    assert trajectory({"response": looped}) == ([], None)


@pytest.mark.parametrize("gained, lost, beyond", [(3, 2, False), (10, 0, True), (8, 2, False), (12, 2, True),
                                                  (0, 0, False)])
def test_sign_test(gained, lost, beyond):
    # 2 sqrt(g + l): 4.47 for 5 changes, 6.32 for 10, 7.48 for 14
    assert change_is_beyond_noise(gained, lost) is beyond


def test_report_table_noise_and_examples(tmp_path):
    before = [_record(0, "a", 0, _turn("a?", "wrong a")), _record(0, "b", 1, _turn("b?", "gold b")),
              _record(0, "c", 0, _turn(answer="guess c")), _record(0, "d", 1, _turn("d?", "gold d"), "synth_hotpotqa")]
    after = [_record(5, "a", 1, _turn("a?") + _turn("a bridge?", "gold a")), _record(5, "b", 0, _turn("b?", "oops")),
             _record(5, "c", 1, _turn("c?", "gold c")), _record(5, "d", 1, _turn("d?", "gold d"), "synth_hotpotqa")]
    lines = report(_write(tmp_path, before, after))
    text = "\n".join(lines)
    assert "same 4 dev questions, before training (step 0) and after (step 5)" in text
    em_row = next(line for line in lines if line.strip().startswith("EM (exact match)"))
    assert em_row.split()[-3:] == ["0.500", "0.750", "+0.250"]
    assert next(line for line in lines if "single-hop questions (3)" in line).split()[-3:] == ["0.333", "0.667", "+0.333"]
    assert next(line for line in lines if "two-hop questions (1)" in line).split()[-3:] == ["1.000", "1.000", "+0.000"]
    assert "2 went wrong -> right and 1 right -> wrong, a net +1 of 4" in text
    assert "within what chance alone could give" in text and "about 0.250" in text  # sqrt(.5 x .5 / 4)
    # gains first, each with both trajectories' searches and answers
    examples = text.split("Examples of questions whose answer changed:")[1].splitlines()[1:]
    assert examples[0] == "  + 'question a?' (gold 'gold a')"
    assert examples[1] == "      before: searched 'a?' -> answered 'wrong a' (wrong)"
    assert examples[2] == "      after:  searched 'a?'; searched 'a bridge?' -> answered 'gold a' (right)"
    assert examples[4].endswith("no search -> answered 'guess c' (wrong)")
    assert len(examples) == 9  # 3 examples x 3 lines; the third is the loss
    assert examples[6].startswith("  - 'question b?'")


def test_examples_show_a_change_in_searching_before_a_change_in_the_answer_only(tmp_path):
    before = [_record(0, "a", 0, _turn("a?", "wrong a")), _record(0, "b", 0, _turn(answer="guess b")),
              _record(0, "c", 1, _turn("c?", "gold c")), _record(0, "d", 1, _turn("d?", "gold d"))]
    after = [_record(5, "a", 1, _turn("a?", "gold a")), _record(5, "b", 1, _turn("b?", "gold b")),
             _record(5, "c", 0, _turn("c?", "wrong c")), _record(5, "d", 0, _turn(answer="guess d"))]
    text = "\n".join(report(_write(tmp_path, before, after), examples=4))
    shown = [line.split("'")[1] for line in text.splitlines() if line.startswith(("  + ", "  - "))]
    # gains, then losses; inside each, the one whose searches changed first
    assert shown == ["question b?", "question a?", "question d?", "question c?"]


def test_one_validation_is_named_not_a_traceback(tmp_path, capsys):
    only = [_record(0, "a", 1, _turn("a?", "gold a"))]
    assert "needs two" in report(_write(tmp_path, only, []))[0]
    assert main([str(tmp_path / "missing")]) == 2
    assert "has no val_predictions.jsonl" in capsys.readouterr().err
