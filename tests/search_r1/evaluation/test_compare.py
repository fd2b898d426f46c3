"""search_r1.evaluation.compare on hand-built predictions: spread, search behaviour, transitions, verdicts."""
import json

import pytest

from search_r1.evaluation.compare import Run, arm_stats, changed, count_flips, main, transitions, verdicts


def write_run(path, rows):
    """rows: (id, source, em, searches, format_valid) -> an eval output directory."""
    path.mkdir(parents=True)
    with open(path / "predictions.jsonl", "w") as f:
        for qid, source, em, searches, fmt in rows:
            f.write(json.dumps({"id": qid, "data_source": source, "em": em, "f1": em, "format_valid": fmt,
                                "searches": searches, "answered": 1.0}) + "\n")
    return path


def world(tmp_path, two_hop_em: dict, single_em: dict, searches_after=2):
    """4 two-hop (t0..t3) and 2 single-hop (s0, s1) questions per run; ems given per run name."""
    runs = {}
    for name in two_hop_em:
        rows = [(f"t{i}", "synth_hotpotqa", e, searches_after if name.startswith("grpo") else 1, 1.0)
                for i, e in enumerate(two_hop_em[name])]
        rows += [(f"s{i}", "synth_nq", e, 1, 1.0) for i, e in enumerate(single_em[name])]
        runs[name] = Run.load(write_run(tmp_path / name, rows))
    return runs


def test_arm_stats_mean_and_spread_over_seeds(tmp_path):
    r = world(tmp_path, {"grpo0": [1, 1, 0, 0], "grpo1": [1, 1, 1, 0]}, {"grpo0": [1, 0], "grpo1": [1, 1]})
    s = arm_stats([r["grpo0"], r["grpo1"]], "synth_hotpotqa")
    assert s["em_values"] == [0.5, 0.75] and s["em"] == pytest.approx(0.625) and s["em_spread"] == pytest.approx(0.25)
    assert s["searches"] == 2 and s["answered_after_2"] == 1.0
    assert arm_stats([r["grpo0"]], None)["em"] == pytest.approx(3 / 6)


def test_transitions_count_changes_by_searches_of_the_after_run(tmp_path):
    r = world(tmp_path, {"ws": [1, 0, 0, 1], "grpo0": [1, 1, 1, 0]}, {"ws": [0, 0], "grpo0": [0, 0]})
    t = transitions(r["ws"], r["grpo0"], "synth_hotpotqa")
    assert t == {2: {"wrong_to_right": 2, "right_to_wrong": 1}}


def test_training_validations_load_per_step_and_changed_lists_the_flips(tmp_path):
    # val_predictions.jsonl as the trainer appends it: steps 0 and 5, then step 5 again after a resume
    rows = [(0, "a", 1.0), (0, "b", 0.0), (0, "c", 1.0), (5, "a", 0.0), (5, "b", 0.0), (5, "c", 1.0),
            (5, "a", 1.0), (5, "b", 1.0), (5, "c", 1.0), (10, "a", 0.0), (10, "b", 1.0), (10, "c", 1.0)]
    (tmp_path / "val_predictions.jsonl").write_text("".join(
        json.dumps({"step": step, "id": qid, "data_source": "synth_nq", "em": em}) + "\n" for step, qid, em in rows))
    runs = Run.load_validations(tmp_path)
    assert list(runs) == [0, 5, 10]
    assert {q: r["em"] for q, r in runs[5].records.items()} == {"a": 1.0, "b": 1.0, "c": 1.0}  # the last one kept
    assert [(b["id"], a["em"]) for b, a in changed(runs[0], runs[10])] == [("a", 0.0), ("b", 1.0)]
    assert changed(runs[0], runs[0]) == []
    assert count_flips(changed(runs[0], runs[10])) == (1, 1)  # b gained, a lost
    assert count_flips(changed(runs[0], runs[5])) == (1, 0)  # b gained; a, c unchanged
    assert count_flips(changed(runs[0], runs[10]), "synth_hotpotqa") == (0, 0)
    with pytest.raises(ValueError, match="no val_predictions.jsonl"):
        Run.load_validations(tmp_path / "nowhere")


def test_verdicts_need_a_gain_beyond_twice_the_spread(tmp_path):
    # before 0.25 two-hop; seeds 0.75 and 1.0: gains +0.5 / +0.75, spread 0.25, 2 x spread 0.5 -> 0.5 is not > 0.5
    r = world(tmp_path, {"ws": [1, 0, 0, 0], "rag": [0, 0, 0, 0], "grpo0": [1, 1, 1, 0], "grpo1": [1, 1, 1, 1]},
              {"ws": [1, 0], "rag": [1, 0], "grpo0": [1, 0], "grpo1": [1, 1]})
    arms = {"rag": [r["rag"]], "ws": [r["ws"]], "grpo": [r["grpo0"], r["grpo1"]]}
    v = {name: met for name, met, _ in verdicts(arms, "ws", "grpo", "rag")}
    assert v["two-hop EM gain over the spread"] is False
    assert v["two-hop EM above the baseline"] is True
    assert v["single-hop EM does not fall"] is True
    # with equal seeds the spread is 0 and the gain counts
    r2 = world(tmp_path / "b", {"ws": [1, 0, 0, 0], "rag": [0, 0, 0, 0], "grpo0": [1, 1, 1, 0], "grpo1": [1, 1, 1, 0]},
               {"ws": [1, 1], "rag": [1, 0], "grpo0": [1, 0], "grpo1": [1, 0]})
    arms2 = {"rag": [r2["rag"]], "ws": [r2["ws"]], "grpo": [r2["grpo0"], r2["grpo1"]]}
    v2 = {name: met for name, met, _ in verdicts(arms2, "ws", "grpo", "rag")}
    assert v2["two-hop EM gain over the spread"] is True
    assert v2["single-hop EM does not fall"] is False  # 1.0 -> 0.5


def test_format_verdict_and_cli(tmp_path, capsys):
    write_run(tmp_path / "ws", [("t0", "synth_hotpotqa", 0, 1, 1.0), ("s0", "synth_nq", 1, 1, 1.0)])
    write_run(tmp_path / "rag", [("t0", "synth_hotpotqa", 0, 0, 0.0), ("s0", "synth_nq", 0, 0, 1.0)])
    write_run(tmp_path / "g", [("t0", "synth_hotpotqa", 1, 2, 1.0), ("s0", "synth_nq", 1, 1, 1.0)])
    out = tmp_path / "cmp.md"
    assert main(["--arm", f"rag={tmp_path / 'rag'}", "--arm", f"ws={tmp_path / 'ws'}", "--arm", f"grpo={tmp_path / 'g'}",
                 "--before", "ws", "--after", "grpo", "--baseline", "rag", "--out", str(out),
                 "--json", str(tmp_path / "cmp.json")]) == 0
    text = out.read_text()
    assert "every arm answers in format (>= 0.9): **not met** (rag 0.500" in text
    assert json.loads((tmp_path / "cmp.json").read_text())["verdicts"][3]["met"] is False
    assert main(["--arm", f"ws={tmp_path / 'ws'}", "--before", "ws", "--after", "grpo", "--baseline", "ws"]) == 2
    assert "not among the arms" in capsys.readouterr().err
