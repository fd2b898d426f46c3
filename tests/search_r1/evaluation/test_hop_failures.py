"""search_r1.evaluation.hop_failures on hand-built two-hop trajectories: one per cause, then the CLI on
a training run's validations and an eval directory."""
import json

import pandas as pd
import pytest

from search_r1.evaluation.hop_failures import CAUSES, failure_cause, load_bridges, main
from search_r1.protocol import search_observation

BRIDGE, GOLD = "Zakguth", "Fusfemen"


def trajectory(*rounds, answer="Fusfemen"):
    """(query, passages) rounds, then the answer (None: no answer)."""
    text = "".join(f"<think> t </think>\n<search> {q} </search>" + search_observation(obs) for q, obs in rounds)
    return text + (f"<think> done </think>\n<answer> {answer} </answer>" if answer is not None else "")


def record(response, em=0.0, qid="q", question="Where was T born?"):
    from search_r1.rewards import extract_answer

    return {"id": qid, "data_source": "synth_hotpotqa", "question": question, "golden_answers": [GOLD],
            "prediction": extract_answer(response), "em": em, "searches": float(response.count("<search>")),
            "response": response}


FIRST_OK = ("Where was T born?", "Doc 1 T was born in Zakguth.")
CASES = {
    "right": record(trajectory(FIRST_OK, ("Which country is Zakguth in?", "Zakguth is a city of Fusfemen.")), em=1.0),
    "no_answer": record(trajectory(FIRST_OK, ("Which country is Zakguth in?", "Zakguth is a city of Fusfemen."),
                                   answer=None)),
    "one_search": record(trajectory(FIRST_OK, answer="Zakguth")),
    # the bridge is not in what the policy read (whatever it searched next)
    "bridge_not_shown": record(trajectory(("Where was T born?", "Doc 1 T worked for Saraek Instruments."),
                                          ("Where is Saraek Instruments?", "It is in Bacen."), answer="Bacen")),
    "other_entity": record(trajectory(FIRST_OK, ("Where is Saraek Instruments?", "It is in Bacen."), answer="Bacen")),
    "answer_not_shown": record(trajectory(FIRST_OK, ("Which country is Zakguth in?", "Zakguth (disambiguation)."),
                                          answer="Bacen")),
    "misread": record(trajectory(FIRST_OK, ("Which country is zakguth in?", "Zakguth lies in fusfemen, near Bacen."),
                                 answer="Bacen")),
}


@pytest.mark.parametrize("cause", CAUSES)
def test_each_cause_is_told_apart(cause):
    assert failure_cause(CASES[cause], BRIDGE) == cause


def test_bridge_counts_only_in_the_first_observation_and_the_second_query():
    # the bridge appears in the *second* passages and the answer too, but the first ones never named it:
    # the policy guessed; that is not a reachable question for this first query
    r = record(trajectory(("Where was T born?", "T was a painter."), ("Zakguth?", "Zakguth is in Fusfemen."),
                          answer="Bacen"))
    assert failure_cause(r, BRIDGE) == "bridge_not_shown"


def write_data(path):
    rows = [{"id": "train_1", "question": "Where was T born?", "data_source": "synth_hotpotqa",
             "extra_info": {"hops": 2, "bridge": BRIDGE}},
            {"id": "train_2", "question": "Who founded X?", "data_source": "synth_nq",
             "extra_info": {"hops": 1, "bridge": ""}}]
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_cli_reads_training_validations_and_eval_outputs(tmp_path, capsys):
    data = write_data(tmp_path / "dev.parquet")
    run = tmp_path / "run"
    run.mkdir()
    # the trainer names validation questions by position (dev:N): matched by question text
    before = {**CASES["one_search"], "id": "dev:0", "step": 0}
    after = {**CASES["right"], "id": "dev:0", "step": 12}
    single = {**CASES["right"], "id": "dev:1", "data_source": "synth_nq", "question": "Who founded X?", "step": 12}
    (run / "val_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (before, after, single)))
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "predictions.jsonl").write_text(json.dumps({**CASES["other_entity"], "id": "train_1"}) + "\n")
    assert main(["--data", str(data), str(run), str(ev)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in out[0].strip("|").split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in out[2:]}
    assert set(rows) == {"run step 0", "run step 12", "eval"}
    col = {name: header.index(name) for name in ("two-hop", "right", "one search", "other entity", "reachable")}
    assert rows["run step 0"][col["one search"]] == "1" and rows["run step 0"][col["two-hop"]] == "1"
    assert rows["run step 12"][col["right"]] == "1"  # the single-hop question is not counted
    assert rows["eval"][col["other entity"]] == "1" and rows["eval"][col["reachable"]] == "1"


def test_rows_without_an_id_column_are_matched_by_question_only(tmp_path):
    # no positional ids invented: the eval ("file:row") and the trainer ("dev:N") each name such rows
    # their own way, so a made-up "0" could only match the wrong question
    path = tmp_path / "noid.parquet"
    pd.DataFrame([{"question": "Where was T born?", "extra_info": {"hops": 2, "bridge": BRIDGE}}]).to_parquet(path)
    assert load_bridges([path]) == ({}, {"Where was T born?": BRIDGE})


def test_cli_names_a_data_file_without_bridges(tmp_path, capsys):
    path = tmp_path / "plain.parquet"
    pd.DataFrame([{"id": "a", "question": "q"}]).to_parquet(path)
    assert main(["--data", str(path), str(tmp_path)]) == 2
    assert "no extra_info column" in capsys.readouterr().err
