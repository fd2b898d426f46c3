"""Reward rules of issue 4, one table row per rule and edge case."""
from types import SimpleNamespace

import numpy as np
import pytest

from search_r1 import rewards as R
from search_r1.prompts import make_prompt
from search_r1.protocol import PROTOCOLS, invalid_action_observation

INFO = "\n\n<information>Doc 1(Title: Paris) Paris is the capital of France.\n</information>\n\n"
GOOD = f"<think>need a fact</think><search> capital of France </search>{INFO}<think>found it</think><answer> Paris </answer>"
# Upstream Search-R1's corrective message (responses recorded by upstream rollouts).
INVALID_MSG = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

FORMAT_CASES = [
    # (id, response text, expected format score)
    ("answer only", "<answer>Paris</answer>", 0.5),
    ("think + search + info + answer", GOOD, 0.5),
    ("two search rounds", f"<search>a</search>{INFO}<search>b</search>{INFO}<answer>x</answer>", 0.5),
    ("trailing whitespace and im_end", "<answer>x</answer>  \n<|im_end|>", 0.5),
    ("trailing endoftext pads", "<answer>x</answer><|im_end|><|endoftext|><|endoftext|>", 0.5),
    ("text before answer is fine", "The answer follows. <answer>x</answer>", 0.5),
    ("tags inside think ignored", "<think>maybe <answer>y</answer> or <search>q</think><answer>x</answer>", 0.5),
    ("tags inside information are opaque", f"<search>q</search><information>a <answer>z</answer> </search></information><answer>x</answer>", 0.5),
    ("no answer", "<think>hmm</think>", -1.0),
    ("empty response", "", -1.0),
    ("two answers", "<answer>x</answer><answer>y</answer>", -1.0),
    ("answer not last", "<answer>x</answer> and more text", -1.0),
    ("search after answer", f"<answer>x</answer><search>q</search>{INFO}", -1.0),
    ("unclosed answer", "<answer>x", -1.0),
    ("close before open", "</answer>x<answer>", -1.0),
    ("extra closing answer", "<answer>x</answer></answer>", -1.0),
    ("nested answer in search", "<search>q <answer>x</answer></search>" + INFO, -1.0),
    ("nested search", f"<search>a<search>b</search></search>{INFO}<answer>x</answer>", -1.0),
    ("unbalanced search", "<search>q<answer>x</answer>", -1.0),
    ("search without information", "<search>q</search><answer>x</answer>", -1.0),
    ("text between search and information", f"<search>q</search> oops {INFO}<answer>x</answer>", -1.0),
    ("information without search", f"{INFO}<answer>x</answer>", -1.0),
    ("two informations for one search", f"<search>q</search>{INFO}{INFO}<answer>x</answer>", -1.0),
    ("unclosed information", "<search>q</search><information>Doc 1 <answer>x</answer>", -1.0),
    ("stray think", "<think>never closed <answer>x</answer>", -1.0),
    ("upstream invalid-action message in response", f"I guess{INVALID_MSG}<answer>x</answer>", -1.0),
    ("our invalid-action message in response", f"I guess{invalid_action_observation('tags')}<answer>x</answer>", -1.0),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in FORMAT_CASES], ids=[c[0] for c in FORMAT_CASES])
def test_check_format_correctness(text, expected):
    assert R.check_format_correctness(text) == expected


def test_format_values_are_configurable():
    assert R.check_format_correctness("<answer>x</answer>", valid=1.0, invalid=0.0) == 1.0
    assert R.check_format_correctness("x", valid=1.0, invalid=0.0) == 0.0


ANSWER_CASES = [
    # (id, answer, ground truth, expected)
    ("exact", "Paris", "Paris", 2.0),
    ("exact after strip", "  Paris ", ["Paris"], 2.0),
    ("case differs -> similarity", "paris", "Paris", 1.0),
    ("no relevant content", "未找到相关内容", "Paris", 0.5),
    ("no-answer string is also gold", "未找到相关内容", ["未找到相关内容"], 2.0),
    # "newyorkcity" vs "newyork": ratio = 2*7/(11+7) = 0.78 >= 0.5
    ("similar", "New York City", "new york", 1.0),
    # whitespace removed before comparing: "thebeatles" == "thebeatles"
    ("whitespace ignored", "The  Beat les", "the beatles", 1.0),
    # "london" vs "paris": one common char 'a'? no: l,o,n,d,o,n vs p,a,r,i,s -> ratio 0
    ("different", "London", "Paris", 0.0),
    # "abcd" vs "abxy": matching block "ab" -> 2*2/8 = 0.5 -> exactly at the threshold
    ("threshold 0.5 inclusive", "abcd", "abxy", 1.0),
    # "abc" vs "axyz": 'a' matches -> 2*1/7 = 0.29
    ("below threshold", "abc", "axyz", 0.0),
    ("empty answer", "", "Paris", 0.0),
    ("whitespace answer", "   ", "Paris", 0.0),
    ("missing answer", None, "Paris", 0.0),
    ("multiple golds: best", "Lutetia", ["Paris", "Lutetia"], 2.0),
    ("multiple golds: similarity", "lutetia", ["Paris", "Lutetia"], 1.0),
    ("search-r1 dict", "Paris", {"target": ["Paris"]}, 2.0),
    ("numpy aliases from parquet", "Paris", {"target": np.array(["City of Light", "Paris"], dtype=object)}, 2.0),
    ("empty gold never matches", "x", ["", "  "], 0.0),
]


@pytest.mark.parametrize("answer,gt,expected", [c[1:] for c in ANSWER_CASES], ids=[c[0] for c in ANSWER_CASES])
def test_check_answer_correctness(answer, gt, expected):
    assert R.check_answer_correctness(answer, gt) == expected


REWARD_CASES = [
    # (id, response, gt, expected = format + answer)
    ("best", GOOD, ["Paris"], 0.5 + 2.0),
    ("worst", "I do not know", ["Paris"], -1.0 + 0.0),
    ("bad format, right answer", "<answer>Paris</answer> trailing", ["Paris"], -1.0 + 2.0),
    ("good format, wrong answer", "<answer>Rome</answer>", ["Paris"], 0.5 + 0.0),
    ("abstain", "<answer>未找到相关内容</answer>", {"target": ["Paris"]}, 0.5 + 0.5),
]


@pytest.mark.parametrize("text,gt,expected", [c[1:] for c in REWARD_CASES], ids=[c[0] for c in REWARD_CASES])
def test_compute_reward(text, gt, expected):
    r = R.compute_reward(text, gt)
    assert r == expected
    assert -1.0 <= r <= 2.5


def test_compute_reward_accepts_trajectory_objects():
    assert R.compute_reward(SimpleNamespace(response_text=GOOD), "Paris") == 2.5
    assert R.compute_reward(SimpleNamespace(text=GOOD), "Paris") == 2.5
    with pytest.raises(ValueError, match="response_text"):
        R.compute_reward(SimpleNamespace(tokens=[1, 2]), "Paris")


def test_bad_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="target"):
        R.compute_reward(GOOD, {"answers": ["Paris"]})
    with pytest.raises(ValueError, match="ground_truth must be"):
        R.compute_reward(GOOD, 42)


EXTRACT_CASES = [
    ("none", "no tags here", None),
    ("stripped", "<answer>  Paris \n</answer>", "Paris"),
    ("last answer wins", "<answer>Rome</answer> no wait <answer>Paris</answer>", "Paris"),
    ("multiline", "<answer>New\nYork</answer>", "New\nYork"),
    ("empty", "<answer></answer>", ""),
    ("information block ignored", "<answer>Rome</answer><information><answer>Oslo</answer></information>", "Rome"),
    ("invalid-action message ignored", f"<answer>Rome</answer>{INVALID_MSG}", "Rome"),
    ("only the invalid-action message", f"blah{INVALID_MSG}", None),
    ("tool_response block ignored", "<answer>Rome</answer><tool_response><answer>Oslo</answer></tool_response>", "Rome"),
]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_extract_answer_ignores_our_invalid_action_message(protocol):
    # The rollout's corrective message names the <answer> tags; it is never the model's answer.
    message = invalid_action_observation(protocol)
    assert "<answer>" in message
    assert R.extract_answer(f"blah{message}") is None
    assert R.extract_answer(f"<answer>Rome</answer> x{message}") == "Rome"
    assert R.extract_answer(f"blah{message}<answer>Oslo</answer>") == "Oslo"


@pytest.mark.parametrize("text,expected", [c[1:] for c in EXTRACT_CASES], ids=[c[0] for c in EXTRACT_CASES])
def test_extract_answer(text, expected):
    assert R.extract_answer(text) == expected


def test_prompt_example_answer_is_not_counted():
    # The instruction shows "<answer> Beijing </answer>"; the reward functions read the response
    # only, so a response without an answer scores nothing even for the gold "Beijing".
    prompt = make_prompt("What is the capital of China")
    assert "<answer> Beijing </answer>" in prompt
    response = "<think>I am not sure</think>"
    assert R.em_score(response, ["Beijing"]) == 0.0
    assert R.f1_score(response, ["Beijing"]) == 0.0
    assert R.compute_reward(response, ["Beijing"]) == -1.0
    # ...whereas wrongly scoring prompt + response would have found the example answer.
    assert R.em_score(prompt + response, ["Beijing"]) == 1.0


@pytest.mark.parametrize(
    "s,expected",
    [
        ("The Beatles", "beatles"),
        ("  A  tale of  an apple! ", "tale of apple"),
        ("U.S.A.", "usa"),
        ("Theatre", "theatre"),  # "the" only as a whole word
        ("rock-and-roll, the band", "rockandroll band"),
        ("", ""),
    ],
)
def test_normalize_answer(s, expected):
    assert R.normalize_answer(s) == expected


QA_CASES = [
    # (id, response, golds, em, subem, f1)
    ("punctuation and articles", "<answer>The Eiffel Tower!</answer>", ["eiffel tower"], 1.0, 1.0, 1.0),
    ("best alias", "<answer>NYC</answer>", ["New York City", "nyc"], 1.0, 1.0, 1.0),
    # pred "eiffel tower in paris" (4 tokens), gold "eiffel tower" (2): P = 2/4, R = 2/2, F1 = 2*.5*1/1.5 = 2/3
    ("superset", "<answer>the Eiffel Tower in Paris</answer>", ["Eiffel Tower"], 0.0, 1.0, 2 / 3),
    # pred "paris" vs gold "paris france": P = 1, R = 1/2, F1 = 2/3; not a substring the other way
    ("subset", "<answer>Paris</answer>", ["Paris, France"], 0.0, 0.0, 2 / 3),
    ("no overlap", "<answer>Rome</answer>", ["Paris"], 0.0, 0.0, 0.0),
    ("no answer", "Paris", ["Paris"], 0.0, 0.0, 0.0),
    ("last answer wins", "<answer>Paris</answer><answer>Rome</answer>", ["Paris"], 0.0, 0.0, 0.0),
    # F1 uses token multisets: pred "a b b" -> "b b" (article a dropped), gold "b": P = 1/2, R = 1, F1 = 2/3
    ("repeated tokens", "<answer>a b b</answer>", ["b"], 0.0, 1.0, 2 / 3),
    ("empty answer", "<answer> </answer>", ["Paris"], 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("text,golds,em,subem,f1", [c[1:] for c in QA_CASES], ids=[c[0] for c in QA_CASES])
def test_qa_metrics(text, golds, em, subem, f1):
    assert R.em_score(text, golds) == em
    assert R.subem_score(text, golds) == subem
    assert R.f1_score(text, golds) == pytest.approx(f1)
    assert R.em_score(text, {"target": golds}) == em


def test_string_level_metrics():
    assert R.exact_match("The Paris.", "paris") == 1.0
    assert R.exact_match(None, "paris") == 0.0
    assert R.substring_match("in paris france", ["Paris"]) == 1.0
    assert R.substring_match("anything", [""]) == 0.0  # an empty gold is not "contained"
    assert R.token_f1("paris", ["rome", "paris"]) == 1.0


def test_reward_registry():
    assert R.get_reward_fn() is R.compute_reward
    assert R.get_reward_fn("seed")(GOOD, ["Paris"]) == 2.5
    assert R.get_reward_fn("em")(GOOD, ["Paris"]) == 1.0
    assert R.get_reward_fn("f1")("<answer>Paris France</answer>", ["Paris"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"unknown reward 'bleu'.*'em'.*'f1'.*'seed'"):
        R.get_reward_fn("bleu")


def test_batch_scores():
    assert R.batch_scores(R.em_score, [GOOD, "x"], [["Paris"], ["Paris"]]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1"):
        R.batch_scores(R.em_score, [GOOD, "x"], [["Paris"]])
