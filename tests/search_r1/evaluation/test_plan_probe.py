"""The plan probe: its log odds are the two plans' teacher-forced likelihood difference, its AUC the
Mann-Whitney statistic, and bad data gets an error naming the fix."""
import math

import pandas as pd
import pytest
import torch

from search_r1.evaluation.plan_probe import auc, first_divergence, main, probe, read_rows, summarize
from search_r1.models import load_model_and_tokenizer
from search_r1.prompts import apply_chat_template
from search_r1.trainer.warmstart import THINK_FIRST, THINK_FIRST_TWO_HOP


def test_auc_by_hand():
    assert auc([3.0, 2.0], [1.0, 0.0]) == 1.0
    assert auc([0.0], [1.0]) == 0.0
    assert auc([1.0, 0.0], [1.0, -1.0]) == pytest.approx((0.5 + 1 + 0 + 1) / 4)
    assert math.isnan(auc([], [1.0]))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 4, 5]) == 2
    with pytest.raises(ValueError, match="prefix"):
        first_divergence([1, 2], [1, 2, 3])


def test_summarize_counts_greedy_plans():
    s = summarize({1: [-1.0, 0.5], 2: [2.0, 1.0, -0.5]})
    assert s["single_hop"] == {"n": 2, "mean_log_odds": -0.25, "share_two_step_plan": 0.5}
    assert s["two_hop"]["share_two_step_plan"] == pytest.approx(2 / 3)
    assert s["auc"] == pytest.approx(5 / 6)  # only -0.5 < 0.5 loses


def _sequence_logp(model, prompt: list[int], response: list[int]) -> float:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return sum(float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(response))


def test_log_odds_equal_the_teacher_forced_difference_at_the_deciding_token(synth_world):
    rows = read_rows(str(synth_world / "test.parquet"), limit=6)
    assert {r["hops"] for r in rows} <= {1, 2}
    model, tok = load_model_and_tokenizer("tiny-random-qwen3", dtype=torch.float32)
    got = probe(model, tok, rows)
    assert sum(map(len, got.values())) == len(rows)
    for row in rows:
        one = tok(THINK_FIRST.format(subject=row["subject"]), add_special_tokens=False)["input_ids"]
        two = tok(THINK_FIRST_TWO_HOP.format(subject=row["subject"]), add_special_tokens=False)["input_ids"]
        k = first_divergence(one, two)
        prompt = apply_chat_template(tok, row["messages"])
        # shared prefix cancels: the difference of the two plans' likelihoods up to the deciding token
        want = _sequence_logp(model, prompt, two[:k + 1]) - _sequence_logp(model, prompt, one[:k + 1])
        assert got[row["hops"]].pop(0) == pytest.approx(want, abs=1e-4)


def test_cli_prints_a_summary_and_rejects_data_without_hops(synth_world, tmp_path, capsys):
    assert main(["--model", "tiny-random-qwen3", "--data", str(synth_world / "test.parquet"), "--limit", "4",
                 "--threads", "1", "--json"]) == 0
    assert '"auc"' in capsys.readouterr().out
    plain = tmp_path / "plain.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "q"}]], "extra_info": [{"split": "test"}]}).to_parquet(plain)
    with pytest.raises(SystemExit, match="extra_info.hops"):
        main(["--model", "tiny-random-qwen3", "--data", str(plain)])
