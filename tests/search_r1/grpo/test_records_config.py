"""search_r1.grpo without a model: records, config, rewards with config values, GRPO math, data loaders."""
import json
import math

import pytest
import torch

from search_r1 import grpo
from search_r1.grpo import (GRPOTrainer, SearchR1Config, TokenStep, Trajectory, config_reward, final_answer_of,
                            load_training_data)

INFO = "\n\n<information>Doc 1(Title: Paris) Paris is the capital of France.\n</information>\n\n"
GOOD = f"<think>need a fact</think><search> capital of France </search>{INFO}<think>found it</think><answer> Paris </answer>"


# ----------------------------------------------------------------------------------------- records

def _trajectory() -> Trajectory:
    # prompt [5, 6, 7], generated 8 9 at 3 4, information 100 101 at 5 6, generated 10 at 7
    steps = [TokenStep(8, "a", -0.5, 3), TokenStep(9, "b", float("nan"), 4), TokenStep(10, "c", -1.25, 7)]
    return Trajectory("q", steps, "ab<information>..</information>c", 1.5, "c", [5, 6, 7, 8, 9, 100, 101, 10],
                      [3, 4, 7], -0.7, num_searches=1, truncated=True)


def test_trajectory_json_round_trip_keeps_everything_and_nan_becomes_null():
    t = _trajectory()
    text = json.dumps(t.to_dict(), allow_nan=False)  # strict JSON: NaN must not leak
    assert json.loads(text)["token_steps"][1]["log_prob"] is None
    back = Trajectory.from_dict(json.loads(text))
    assert back.token_steps[0] == t.token_steps[0] and math.isnan(back.token_steps[1].log_prob)
    for name in ("query", "generated_text", "reward", "final_answer", "full_input_ids", "generated_positions",
                 "advantage", "num_searches", "truncated"):
        assert getattr(back, name) == getattr(t, name), name
    assert back.layout_problem() is None


def test_from_dict_names_unknown_and_missing_keys():
    d = _trajectory().to_dict()
    d["rewardd"] = 1.0
    del d["full_input_ids"]
    with pytest.raises(ValueError, match=r"unknown keys \['rewardd'\], missing keys \['full_input_ids'\]"):
        Trajectory.from_dict(d)
    with pytest.raises(ValueError, match="TokenStep"):
        TokenStep.from_dict({"token_id": 1})


def test_token_step_is_frozen():
    with pytest.raises(Exception):
        TokenStep(1, "a", 0.0, 0).token_id = 2


@pytest.mark.parametrize("mutate,problem", [
    (lambda t: t.full_input_ids.pop(), "outside"),                       # sequence cut short
    (lambda t: t.generated_positions.pop(), "2 generated positions for 3"),
    (lambda t: t.full_input_ids.__setitem__(4, 99), "position 4"),       # token id differs
])
def test_layout_problem_detects_misaligned_records(mutate, problem):
    t = _trajectory()
    mutate(t)
    assert problem in t.layout_problem()


# ----------------------------------------------------------------------------------------- config

def test_config_defaults_are_the_spec():
    c = SearchR1Config()
    spec = dict(use_openai=False, openai_model="gpt-4o-mini", max_tokens=500, group_size=2, update_times=4,
                clip_epsilon=0.2, beta=0.1, learning_rate=1e-5, batch_size=1, num_epochs=10, max_grad_norm=0.5,
                format_reward=0.5, answer_reward=1.0, exact_match_bonus=2.0, log_interval=1,
                model_name_or_path="smollm2-135m-instruct", openai_base_url="https://api.openai.com/v1",
                openai_api="auto")
    assert {k: getattr(c, k) for k in spec} == spec
    assert c.resolved_openai_api == "chat"  # gpt-4o-mini at api.openai.com offers only chat completions
    assert c.device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert c.compute_dtype == torch.float32


@pytest.mark.parametrize("bf16, want", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_cuda_is_bf16_where_supported(monkeypatch, bf16, want):
    """auto never means float16 weights: it picks the autocast dtype (the weights stay float32)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert SearchR1Config(device="cuda").compute_dtype == want
    assert SearchR1Config(device="cuda", dtype="float32").compute_dtype == torch.float32


@pytest.mark.parametrize("kwargs,message", [
    ({"group_size": 1}, "group_size must be an int >= 2"),
    ({"clip_epsilon": 0}, "clip_epsilon must be a number > 0"),
    ({"beta": -0.1}, "beta must be a number >= 0"),
    ({"top_p": 1.5}, "top_p"),
    ({"search_backend": "bing"}, r"search_backend='bing' is invalid; choose one of \['retriever', 'web', 'synthetic'\]"),
    ({"device": "tpu"}, r"device='tpu' is invalid; choose one of"),
    ({"device": 0}, "device must be a string"),
    ({"save_interval": 5}, "needs output_dir"),
    ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
    ({"openai_api": "responses"}, r"openai_api='responses' is invalid; choose one of \['auto', 'completions', 'chat'\]"),
])
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SearchR1Config(**kwargs)


def test_yaml_json_round_trip_unknown_keys_and_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    c = SearchR1Config(group_size=4, beta=0.05, web_api_key="web-secret")
    assert c.openai_api_key == "sk-from-env"  # empty field -> environment
    text = c.to_yaml(tmp_path / "c.yaml")
    assert "sk-from-env" not in text and "web-secret" not in text  # secrets never written
    back = SearchR1Config.from_yaml(tmp_path / "c.yaml")
    assert back.group_size == 4 and back.beta == 0.05 and back.openai_api_key == "sk-from-env"
    assert SearchR1Config.from_json('{"max_tokens": 64}').max_tokens == 64
    (tmp_path / "c.json").write_text(json.dumps({"update_times": 2}))
    assert SearchR1Config.from_json(tmp_path / "c.json").update_times == 2
    (tmp_path / "bad.yaml").write_text("grop_size: 4\n")
    with pytest.raises(ValueError, match=r"unknown keys \['grop_size'\]"):
        SearchR1Config.from_yaml(tmp_path / "bad.yaml")


# ----------------------------------------------------------------------------------------- reward

REWARD_TABLE = [
    # (id, response, gold, reward with defaults = format + answer)
    ("best: searched, exact", GOOD, ["Paris"], 0.5 + 2.0),
    ("no tags at all", "I do not know", ["Paris"], -1.0 + 0.0),
    ("bad format, right answer", "<answer>Paris</answer> trailing", ["Paris"], -1.0 + 2.0),
    ("good format, wrong answer", "<answer>Rome</answer>", ["Paris"], 0.5 + 0.0),
    ("good format, similar answer", "<answer>paris</answer>", ["Paris"], 0.5 + 1.0),
    ("abstain", "<answer>未找到相关内容</answer>", {"target": ["Paris"]}, 0.5 + 0.5),
    ("search without information", "<search>q</search><answer>Paris</answer>", ["Paris"], -1.0 + 2.0),
]


@pytest.mark.parametrize("text,gold,expected", [c[1:] for c in REWARD_TABLE], ids=[c[0] for c in REWARD_TABLE])
def test_reward_table(text, gold, expected):
    assert config_reward(text, gold, SearchR1Config()) == expected
    # with default values it is exactly search_r1.rewards.compute_reward (re-exported, not copied)
    assert grpo.compute_reward(Trajectory("q", generated_text=text), gold) == expected


def test_reward_values_come_from_the_config():
    c = SearchR1Config(format_reward=1.0, format_penalty=0.0, answer_reward=0.3, exact_match_bonus=5.0)
    assert config_reward(GOOD, "Paris", c) == 1.0 + 5.0
    assert config_reward("<answer>paris</answer>", "Paris", c) == 1.0 + 0.3
    assert config_reward("<answer>Paris</answer> x", "Paris", c) == 0.0 + 5.0


def test_reward_functions_are_importable_from_grpo():
    assert grpo.check_format_correctness("<answer>x</answer>") == 0.5
    assert grpo.check_answer_correctness("Paris", ["Paris"]) == 2.0


@pytest.mark.parametrize("text,expected", [
    ("<answer> Paris </answer>", "Paris"),
    ("<think>x</think><answer> Par", "Par"),                  # cut by the budget: partial answer
    ("<answer> Osk<|im_end|>", "Osk"),                         # EOS without a closing tag
    ("<search> q </search>\n\n<information>Doc <answer> no</information>", ""),  # inside information
    ("no answer here", ""),
])
def test_final_answer_of(text, expected):
    assert final_answer_of(text) == expected


# ----------------------------------------------------------------------------------------- GRPO math

def test_compute_advantages_population_std():
    # mean 2, population std sqrt(((1-2)^2 + 0 + (3-2)^2) / 3) = sqrt(2/3) = 0.81650
    adv = GRPOTrainer.compute_advantages([1.0, 2.0, 3.0])
    assert torch.allclose(adv, torch.tensor([-1 / math.sqrt(2 / 3), 0.0, 1 / math.sqrt(2 / 3)]), atol=1e-6)
    assert GRPOTrainer.compute_advantages([0.7]).tolist() == [0.0]   # one trajectory: no baseline
    assert GRPOTrainer.compute_advantages([2.5, 2.5]).tolist() == [0.0, 0.0]


def test_compute_kl_divergence_k3_by_hand():
    # old - new = [1, -1] -> ratio [e, 1/e]; ratio - log ratio - 1 = [e - 2, 1/e] -> mean (e - 2 + 1/e) / 2
    kl = GRPOTrainer.compute_kl_divergence([0.0, -1.0], [-1.0, 0.0])
    assert kl.item() == pytest.approx((math.e - 2 + 1 / math.e) / 2, abs=1e-6)
    assert GRPOTrainer.compute_kl_divergence([-0.3, -2.0], [-0.3, -2.0]).item() == 0.0
    with pytest.raises(ValueError, match="shape"):
        GRPOTrainer.compute_kl_divergence([0.0], [0.0, 1.0])


# ----------------------------------------------------------------------------------------- data

def test_loaders_jsonl_and_csv(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"question": "Who?", "golden_answers": ["Ana", "A."]}\n\n'
                                      '{"query": "Where?", "answer": "Osk"}\n')
    assert load_training_data(tmp_path / "a.jsonl") == (["Who?", "Where?"], [["Ana", "A."], ["Osk"]])
    (tmp_path / "a.csv").write_text("question,answer\nWho?,Ana | A.\nWhere?,Osk\n")
    assert load_training_data(tmp_path / "a.csv") == (["Who?", "Where?"], [["Ana", "A."], ["Osk"]])
    (tmp_path / "b.jsonl").write_text('{"q": "Who?", "answer": "x"}\n')
    with pytest.raises(ValueError, match="b.jsonl line 1: none of the columns"):
        load_training_data(tmp_path / "b.jsonl")
    with pytest.raises(ValueError, match="use .jsonl or .csv"):
        (tmp_path / "c.txt").write_text("x")
        load_training_data(tmp_path / "c.txt")


def test_create_training_data_from_the_synthetic_world(synth_world):
    queries, answers = grpo.create_training_data(5, synth_dir=synth_world)
    rows = [json.loads(line) for line in (synth_world / "train.jsonl").read_text().splitlines()[:5]]
    assert queries == [r["question"] for r in rows] and answers == [r["golden_answers"] for r in rows]
    kb = grpo.synthetic_knowledge_base(synth_world)
    first = json.loads((synth_world / "corpus.jsonl").read_text().splitlines()[0])["contents"]
    title = first.split("\n")[0].strip('"')
    assert kb[title].startswith(f"Doc 1(Title: {title}) ")
    engine = grpo.MockSearchEngine(kb)
    assert engine.search(f"tell me about {title.lower()}") == kb[title]
    assert engine.search("zzzz") == "No information found for: zzzz"
