"""The answer log-prob probe: its score is the gold answer's teacher-forced log-likelihood after the
reference's context (checked token by token), it finds prompts by eval id, trainer uid or question,
and bad references get an error naming the fix."""
import json

import pandas as pd
import pytest
import torch

from search_r1.evaluation.answer_logprob import (answer_context, build_cases, load_prompts, main, notable, score,
                                                 summarize)
from search_r1.models import load_model_and_tokenizer


def test_answer_context_keeps_the_last_answer_tag():
    assert answer_context("<search> q </search> <answer> a </answer> then <answer> b </answer>") == \
        "<search> q </search> <answer> a </answer> then <answer>"
    assert answer_context("<think> no answer </think>") is None


def test_summarize_and_notable_by_hand():
    first = [(-1.0, -0.69), (-2.0, -3.0), (-0.5, -0.1)]
    other = [(-0.5, -0.5), (-2.5, -3.0), (-0.5, -0.1)]
    assert summarize(first, other) == {"n": 3, "mean_logp": pytest.approx(-3.5 / 3),
                                       "mean_change": pytest.approx(0.0), "rose": 1, "fell": 1}
    # question 0: p_first 0.50 (greedy edge); question 1 moved 0.5 nats; question 2 neither
    assert notable([None] * 3, [first, other]) == [0, 1]


def _records(data_path, n=3):
    df = pd.read_parquet(data_path).head(n)
    recs = []
    for i, row in enumerate(df.itertuples()):
        response = ("<think> Look up. </think>\n<search> q </search>\n\n<information>Doc 1 text</information>\n\n"
                    "<think> The passages give the answer. </think>\n<answer> x </answer>")
        recs.append({"id": str(row.id), "question": row.question, "golden_answers": list(row.golden_answers),
                     "response": response if i < n - 1 else "<think> never answers"})
    return recs


def test_score_is_the_teacher_forced_answer_likelihood(synth_world):
    data = str(synth_world / "test.parquet")
    model, tok = load_model_and_tokenizer("tiny-random-qwen3", dtype=torch.float32)
    cases, skipped = build_cases(_records(data), load_prompts([data], tok))
    assert (len(cases), skipped) == (2, 1)
    for case in cases:
        logp, logp_first = score(model, tok, case)
        prefix = list(case.prompt_ids) + tok(case.context, add_special_tokens=False)["input_ids"]
        answer = tok(case.answer, add_special_tokens=False)["input_ids"]
        want = []
        for t in answer:  # one forward per answer token, on the growing prefix
            with torch.no_grad():
                want.append(float(torch.log_softmax(model(input_ids=torch.tensor([prefix])).logits[0, -1].float(), -1)[t]))
            prefix.append(t)
        assert logp == pytest.approx(sum(want), abs=1e-4)
        assert logp_first == pytest.approx(want[0], abs=1e-4)
        assert case.answer.startswith(" ") and case.context.endswith("<answer>")


def test_prompts_are_found_by_trainer_uid_and_question(synth_world):
    data = str(synth_world / "test.parquet")
    _, tok = load_model_and_tokenizer("tiny-random-qwen3", dtype=torch.float32)
    prompts = load_prompts([data], tok)
    recs = _records(data)
    by_eval_id, _ = build_cases(recs, prompts)
    # the trainer's validation names rows "file-stem:row"
    by_uid, _ = build_cases([dict(r, id=f"test:{i}") for i, r in enumerate(recs)], prompts)
    # an id that names another row falls back to the question
    swapped, _ = build_cases([dict(recs[0], id=recs[1]["id"])], prompts)
    assert [c.prompt_ids for c in by_uid] == [c.prompt_ids for c in by_eval_id]
    assert swapped[0].prompt_ids == by_eval_id[0].prompt_ids != by_eval_id[1].prompt_ids
    with pytest.raises(ValueError, match="not in --data"):
        build_cases([dict(recs[0], id="elsewhere", question="A question no file has?")], prompts)


def test_cli_scores_each_model_against_the_first(synth_world, tmp_path, capsys):
    data = str(synth_world / "test.parquet")
    ref = tmp_path / "eval"
    ref.mkdir()
    (ref / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(data)))
    out = tmp_path / "scores.json"
    assert main(["--data", data, "--reference", str(ref), "--model", "tiny-random-qwen3",
                 "--model", "tiny-random-qwen3", "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 questions (1 of the reference never opened <answer>, skipped)" in printed
    assert "rose on 0, fell on 0 of 2" in printed  # the same model scores the same
    result = json.loads(out.read_text())
    assert [q["logp"][0] == q["logp"][1] for q in result["questions"]] == [True, True]
    with pytest.raises(SystemExit):  # a directory with neither predictions file
        main(["--data", data, "--reference", str(tmp_path / "nowhere"), "--model", "tiny-random-qwen3"])
    assert "neither predictions.jsonl nor val_predictions.jsonl" in capsys.readouterr().err
    # Another chat template renders other prompt ids: the probe refuses to mix the two.
    model, tok = load_model_and_tokenizer("tiny-random-qwen3")
    tok.chat_template = "{% for m in messages %}### {{ m['content'] }}\n{% endfor %}"
    other = tmp_path / "other-template"
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(SystemExit):
        main(["--data", data, "--reference", str(ref), "--model", "tiny-random-qwen3", "--model", str(other),
              "--threads", "1"])
    assert f"--model {other} has another tokenizer than --model tiny-random-qwen3" in capsys.readouterr().err
