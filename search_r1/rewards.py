"""Rule-based rewards for Search-R1 trajectories: format + answer (the seed reward), EM, sub-EM, F1.

Every function here is pure and takes the *response* text only: the tokens the policy generated
plus the observations the environment inserted (`<information>` blocks, the invalid-action
message). Never pass the prompt: the instruction itself contains the example `<answer> Beijing
</answer>`, which would then count as an answer.

Ground truth may be given as a string, a list/tuple/numpy array of aliases, or the Search-R1
parquet dict `{"target": [...]}`; every metric takes the best score over the aliases.

Reward functions are registered by name (`get_reward_fn`): `seed` (format + answer, the default
training reward, range [-1.0, 2.5]), `em` and `f1` (in [0, 1]); `subem` is registered too.
"""
from __future__ import annotations

import collections
import difflib
import re
import string
from typing import Any, Callable, Iterable

from search_r1.protocol import PROTOCOLS, invalid_action_observation

# The answer that means "no relevant content found"; rewarded as an honest abstention.
NO_ANSWER = "未找到相关内容"

FORMAT_VALID = 0.5
FORMAT_INVALID = -1.0

# End-of-sequence markers that may trail a decoded response when special tokens are kept
# (ChatML/Qwen/SmolLM2, Llama 3, Llama 2/Mistral, Gemma). Only these and whitespace may follow
# the final `</answer>` for the format to count as valid.
EOS_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>", "<eos>")

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
# check_format_correctness: symbols for an information block and for "</search>" + its block
# (control characters no response keeps: they are removed from the text first)
_INFO, _OBSERVED = "\x00", "\x01"
_INFORMATION_BLOCK = re.compile(r"<information>.*?</information>", re.DOTALL)
_SEARCH_THEN_INFO = re.compile(r"</search>\s*\x00")
_FORMAT_SYMBOL = re.compile(r"</?(?:search|information|answer|think)>|[\x00\x01]")
_FORMAT_GRAMMAR = re.compile(r"(?:<search>\x01)*<answer></answer>")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Text the environment inserts into a response: retrieved passages may contain anything, and the
# invalid-action message names the <answer> tags itself, so neither may be read as the model's
# answer. The messages come from `search_r1.protocol` (both protocols) plus upstream Search-R1's
# wording, so responses recorded by upstream rollouts are read the same way.
_UPSTREAM_INVALID = r"My previous action is invalid\..*?Let me try again\."
_ENV_TEXT = re.compile(
    "|".join(
        [r"<information>.*?</information>", r"<tool_response>.*?</tool_response>", _UPSTREAM_INVALID]
        + [re.escape(invalid_action_observation(p).strip()) for p in PROTOCOLS]
    ),
    re.DOTALL,
)


# --------------------------------------------------------------------------- ground truth


def gold_answers(ground_truth: Any) -> list[str]:
    """The list of gold aliases in `ground_truth` (str | list/tuple/ndarray of str | {"target": ...}).

    Raises:
        ValueError: a dict without a "target" key, or a value that is not text / a list of text.
    """
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(
                f"ground_truth dict has keys {sorted(ground_truth)}; expected the Search-R1 form "
                '{"target": [answers]}'
            )
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        return [ground_truth]
    if hasattr(ground_truth, "tolist"):  # numpy arrays read back from parquet
        ground_truth = ground_truth.tolist()
    if isinstance(ground_truth, (list, tuple)) and all(isinstance(g, str) for g in ground_truth):
        return list(ground_truth)
    raise ValueError(
        f"ground_truth must be a str, a list of str or {{'target': [str, ...]}}; got "
        f"{type(ground_truth).__name__}: {ground_truth!r:.200}"
    )


def response_text_of(trajectory_or_text: Any) -> str:
    """The response text of a str or of an object with a `response_text` (or `text`) attribute."""
    if isinstance(trajectory_or_text, str):
        return trajectory_or_text
    for attr in ("response_text", "text"):
        value = getattr(trajectory_or_text, attr, None)
        if isinstance(value, str):
            return value
    raise ValueError(
        f"expected the response text (str) or an object with a str attribute `response_text` or "
        f"`text`; got {type(trajectory_or_text).__name__}"
    )


# --------------------------------------------------------------------------- format


def _strip_trailing_eos(text: str) -> str:
    """`text` without trailing whitespace and EOS markers (any number, in any order)."""
    previous = None
    while previous != text:
        previous = text
        text = text.rstrip()
        for marker in EOS_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)]
    return text


def check_format_correctness(text: str, valid: float = FORMAT_VALID, invalid: float = FORMAT_INVALID) -> float:
    """`valid` if the response follows the Search-R1 protocol, else `invalid`.

    After deleting every `<think>...</think>` block (tags inside thoughts do not count) and
    collapsing every `<information>...</information>` block to one opaque symbol (retrieved passages
    may contain any text), the protocol tags must read, in order, exactly

        (<search> </search> <information-block>)*  <answer> </answer>

    with only whitespace between a `</search>` and its information block, and only whitespace and
    EOS markers (`EOS_MARKERS`, e.g. `<|im_end|>`) after `</answer>`. So: no stray think tag, one
    answer block and it comes last, no nested blocks, every search followed by its information and
    every information preceded by a search. A response holding the environment's invalid-action
    message fails (the message names the tags itself): such a trajectory is not well formed.
    """
    body = _THINK_BLOCK.sub(" ", text.replace(_INFO, "").replace(_OBSERVED, ""))
    body = _INFORMATION_BLOCK.sub(_INFO, body)
    body = _SEARCH_THEN_INFO.sub(_OBSERVED, body)  # "</search>" + whitespace + passages -> one symbol
    if not _FORMAT_GRAMMAR.fullmatch("".join(m.group(0) for m in _FORMAT_SYMBOL.finditer(body))):
        return invalid
    tail = body[body.rindex("</answer>") + len("</answer>"):]
    return invalid if _strip_trailing_eos(tail) else valid


# --------------------------------------------------------------------------- answers


def extract_answer(response_text: str) -> str | None:
    """The stripped content of the LAST `<answer>...</answer>` in the response, or None.

    Environment text (`<information>` blocks, the invalid-action message) is ignored, so a tag
    quoted there is never taken for the model's answer. Pass the response only, never the prompt.
    """
    matches = _ANSWER.findall(_ENV_TEXT.sub(" ", response_text))
    return matches[-1].strip() if matches else None


def _similarity_key(s: str) -> str:
    return "".join(s.lower().split())


def check_answer_correctness(final_answer: str | None, ground_truth: Any) -> float:
    """Score an extracted answer against the gold aliases (best over aliases).

    - empty or missing answer (None / whitespace): 0.0
    - exact string match with a gold (after stripping surrounding whitespace): 2.0
    - the answer is `NO_ANSWER` ("未找到相关内容", no relevant content found): 0.5
    - otherwise lowercase and delete all whitespace on both sides, then
      `difflib.SequenceMatcher(None, answer, gold).ratio() >= 0.5` gives 1.0, else 0.0.
    """
    if final_answer is None or not final_answer.strip():
        return 0.0
    answer = final_answer.strip()
    golds = [g.strip() for g in gold_answers(ground_truth) if g.strip()]
    if answer in golds:
        return 2.0
    if answer == NO_ANSWER:
        return 0.5
    key = _similarity_key(answer)
    for gold in golds:
        if difflib.SequenceMatcher(None, key, _similarity_key(gold)).ratio() >= 0.5:
            return 1.0
    return 0.0


def compute_reward(
    trajectory_or_text: Any,
    ground_truth: Any,
    valid: float = FORMAT_VALID,
    invalid: float = FORMAT_INVALID,
) -> float:
    """The seed reward: `check_format_correctness + check_answer_correctness(extract_answer(.))`.

    Range [-1.0, 2.5] with the default format values: -1.0 (malformed, wrong) to 0.5 + 2.0.
    `trajectory_or_text` is the response text or an object with `.response_text` / `.text`.
    """
    text = response_text_of(trajectory_or_text)
    return check_format_correctness(text, valid, invalid) + check_answer_correctness(
        extract_answer(text), ground_truth
    )


# --------------------------------------------------------------------------- QA metrics


def normalize_answer(s: str) -> str:
    """Standard QA normalization: lowercase, drop punctuation, drop articles a/an/the, collapse spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_PUNCTUATION = frozenset(string.punctuation)


def exact_match(prediction: str | None, ground_truth: Any) -> float:
    """1.0 if the normalized prediction equals a normalized gold alias, else 0.0 (None -> 0.0)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in gold_answers(ground_truth)))


def substring_match(prediction: str | None, ground_truth: Any) -> float:
    """1.0 if a normalized (non-empty) gold alias occurs inside the normalized prediction, else 0.0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    golds = (normalize_answer(g) for g in gold_answers(ground_truth))
    return float(any(g and g in pred for g in golds))


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    n_same = sum(common.values())
    if n_same == 0:
        return 0.0
    precision = n_same / len(pred_tokens)
    recall = n_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str | None, ground_truth: Any) -> float:
    """Token-level F1 between normalized prediction and gold, best over aliases (None -> 0.0).

    F1 = 2 P R / (P + R), P = |common| / |pred tokens|, R = |common| / |gold tokens|, where
    `common` is the multiset intersection of whitespace tokens after `normalize_answer`.
    """
    if prediction is None:
        return 0.0
    pred_tokens = normalize_answer(prediction).split()
    return max((_token_f1(pred_tokens, normalize_answer(g).split()) for g in gold_answers(ground_truth)), default=0.0)


def em_score(response_text: str, ground_truth: Any) -> float:
    """Exact match of the response's last `<answer>` (see `extract_answer`); 0.0 if it has none."""
    return exact_match(extract_answer(response_text), ground_truth)


def subem_score(response_text: str, ground_truth: Any) -> float:
    """Sub-EM of the response's last `<answer>`: a gold alias is contained in it."""
    return substring_match(extract_answer(response_text), ground_truth)


def f1_score(response_text: str, ground_truth: Any) -> float:
    """Token F1 of the response's last `<answer>`, best over gold aliases."""
    return token_f1(extract_answer(response_text), ground_truth)


# --------------------------------------------------------------------------- registry

RewardFn = Callable[[str, Any], float]

REWARD_FNS: dict[str, RewardFn] = {
    "seed": compute_reward,
    "em": em_score,
    "subem": subem_score,
    "f1": f1_score,
}


def get_reward_fn(name: str = "seed") -> RewardFn:
    """The reward `fn(response_text, ground_truth) -> float` registered as `name`.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if name not in REWARD_FNS:
        raise ValueError(f"unknown reward {name!r}; valid rewards: {sorted(REWARD_FNS)} (algorithm.reward)")
    return REWARD_FNS[name]


def batch_scores(fn: RewardFn, responses: Iterable[str], ground_truths: Iterable[Any]) -> list[float]:
    """`[fn(r, g) for r, g in zip(responses, ground_truths)]`, refusing lists of unequal length."""
    responses, ground_truths = list(responses), list(ground_truths)
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    return [fn(r, g) for r, g in zip(responses, ground_truths)]
