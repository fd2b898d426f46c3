"""Aggregation and tables of the eval CLI, on hand-made records."""
import pytest

from search_r1.scoring import aggregate, compare_table, markdown_table, score_response


def test_score_response_uses_the_training_metrics():
    text = "<search> q </search>\n\n<information>Doc 1(Title: A) <answer> wrong </answer></information>\n\n" \
           "<answer> The Eiffel tower </answer>"
    s = score_response(text, ["eiffel tower", "tour eiffel"])
    # the <answer> inside <information> is the environment's, not the model's
    assert s["prediction"] == "The Eiffel tower"
    assert (s["em"], s["subem"], s["f1"], s["format_valid"]) == (1.0, 1.0, 1.0, 1.0)
    assert s["reward"] == 0.5 + 1.0  # format 0.5 + fuzzy match (not the exact string) 1.0
    s = score_response("no tags at all", ["x"])
    assert s["prediction"] is None and (s["em"], s["f1"], s["format_valid"], s["reward"]) == (0.0, 0.0, 0.0, -1.0)


def test_aggregate_weighs_sources_by_questions():
    recs = [{"data_source": "a", "em": 1.0, "f1": 1.0, "turns": 2},
            {"data_source": "a", "em": 0.0, "f1": 0.5, "turns": 1},
            {"data_source": "b", "em": 1.0, "f1": 0.25, "turns": 3}]
    m = aggregate(recs)
    assert m["per_source"]["a"] == {"n": 2, "em": 0.5, "f1": 0.75, "turns": 1.5}
    assert m["per_source"]["b"] == {"n": 1, "em": 1.0, "f1": 0.25, "turns": 3.0}
    assert m["overall"]["em"] == pytest.approx(2 / 3)  # not the mean of source means (0.75)
    assert m["overall"]["f1"] == pytest.approx(1.75 / 3)
    table = markdown_table(m, keys=("em", "f1", "turns"))
    assert table.splitlines()[2] == "| a | 2 | 0.500 | 0.750 | 1.500 |"
    assert table.splitlines()[-1] == "| **overall** | 3 | 0.667 | 0.583 | 2.000 |"


def test_compare_table_side_by_side():
    r1 = {"name": "rag", "metrics": aggregate([{"data_source": "a", "em": 1.0, "f1": 1.0}])}
    r2 = {"name": "grpo", "metrics": aggregate([{"data_source": "a", "em": 0.0, "f1": 0.5},
                                                {"data_source": "b", "em": 1.0, "f1": 1.0}])}
    lines = compare_table([r1, r2], keys=("em", "f1")).splitlines()
    assert lines[0] == "| data_source | rag EM | rag F1 | grpo EM | grpo F1 |"
    assert lines[2] == "| a | 1.000 | 1.000 | 0.000 | 0.500 |"
    assert lines[3] == "| b | - | - | 1.000 | 1.000 |"  # a source one run lacks
    assert lines[4] == "| **overall** | 1.000 | 1.000 | 0.500 | 0.750 |"
    assert lines[5] == "| n | 1 | 1 | 2 | 2 |"
    with pytest.raises(ValueError, match="unknown metric 'acc'"):
        compare_table([r1], keys=("acc",))
