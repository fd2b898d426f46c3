"""The Search-R1 action protocol: what the policy writes, what the environment writes back.

Two protocols share one shape (a turn ends in exactly one action):

- `tags` (Search-R1): `<search> query </search>` or `<answer> text </answer>`; results come back as
  `\\n\\n<information>{passages}</information>\\n\\n`.
- `tool_call`: `<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>` (JSON; the
  QwQ form `{"action": "web_search", "action_input": {"query": "..."}}` is read too) or
  `<answer> text </answer>`; results come back as `\\n\\n<tool_response>{passages}</tool_response>\\n\\n`.

The first complete action in a turn's text wins. Anything else (no action, malformed JSON, an empty
query) is an invalid action and gets the corrective message, as in upstream Search-R1.

`ObservationEncoder` turns observations into token ids under a token budget. An overlong search
result is shortened inside the wrapper, so the closing tag always survives (upstream cut the tail
of the whole observation and lost it).
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass

from search_r1.bpe_cache import PieceEncoder

PROTOCOLS = ("tags", "tool_call")
ACTION_KINDS = ("search", "answer", "invalid")


@dataclass(frozen=True)
class Action:
    """One parsed action. `content` is the stripped query / answer ("" for invalid).

    `end` is the character offset just past the action's closing tag in the parsed text (-1 for an
    invalid action); the rollout uses it to detect a backend that kept generating past the stop.
    """

    kind: str
    content: str = ""
    end: int = -1


# Tag regexes: non-greedy so the first complete action wins; DOTALL so queries may span lines.
_TAGS_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_TOOL_RE = re.compile(r"<(tool_call|answer)>(.*?)</\1>", re.DOTALL)

_STOPS = {"tags": ("</search>", "</answer>"), "tool_call": ("</tool_call>", "</answer>")}
# The wrapper around a search result, per protocol: (opening, closing). The leading and trailing
# blank lines separate the environment's text from the policy's in the decoded sequence.
_WRAPPERS = {
    "tags": ("\n\n<information>", "</information>\n\n"),
    "tool_call": ("\n\n<tool_response>", "</tool_response>\n\n"),
}
_INVALID_TEXT = {
    "tags": (
        "\nMy last action was not valid. To look something up I must put the query between "
        "<search> and </search>; to finish I must put the final answer between <answer> and "
        "</answer>. Let me try again.\n"
    ),
    "tool_call": (
        "\nMy last action was not valid. To look something up I must write "
        '<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>; to finish I '
        "must put the final answer between <answer> and </answer>. Let me try again.\n"
    ),
}
SEARCH_FAILED_TEXT = "The search engine did not respond; no results are available for this query."


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; allowed values: {list(PROTOCOLS)}")
    return protocol


def stop_strings(protocol: str = "tags") -> tuple[str, ...]:
    """Strings that end a generation turn (passed to the backend as `SamplingParams.stop`)."""
    return _STOPS[check_protocol(protocol)]


def parse_action(text: str, protocol: str = "tags") -> Action:
    """Parse the first complete action in `text`.

    >>> parse_action("<think>x</think><search> who </search>")
    Action(kind='search', content='who', end=38)
    """
    if check_protocol(protocol) == "tags":
        m = _TAGS_RE.search(text)
        if m is None:
            return Action("invalid")
        kind, content = m.group(1), m.group(2).strip()
        if kind == "search" and not content:
            return Action("invalid")
        return Action(kind, content, m.end())
    m = _TOOL_RE.search(text)
    if m is None:
        return Action("invalid")
    if m.group(1) == "answer":
        return Action("answer", m.group(2).strip(), m.end())
    query = _tool_call_query(m.group(2))
    return Action("search", query, m.end()) if query else Action("invalid")


# Tool names that mean "search" in a tool call: ours, and the QwQ / ReAct agents' `web_search`.
SEARCH_TOOL_NAMES = ("search", "web_search")
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A decoded `<tool_call>` payload: the tool's name and its arguments."""

    name: str
    arguments: dict


def decode_tool_call(payload: str) -> ToolCall:
    """The tool call in a `<tool_call>` payload, in either JSON form:

        {"name": "search", "arguments": {"query": "..."}}            (ours, Qwen / OpenAI style;
                                                                       arguments may be a JSON string)
        {"action": "web_search", "action_input": {"query": "..."}}   (QwQ / ReAct style)

    Raises ValueError saying what is wrong (not JSON, not an object, no tool name, arguments not an
    object), in words a model can act on: agents send it back as the corrective tool response.
    """
    try:
        call = json.loads(payload)
    except (json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(call, dict):
        raise ValueError(f"the tool call must be a JSON object, got a {type(call).__name__}")
    name_key, args_key = ("action", "action_input") if "action" in call else ("name", "arguments")
    name = call.get(name_key)
    if not isinstance(name, str) or not name.strip():
        raise ValueError('the tool call names no tool: write {"name": TOOL, "arguments": {...}} or '
                         '{"action": TOOL, "action_input": {...}}')
    args = call.get(args_key, {})
    if isinstance(args, str):  # OpenAI-style tool calls carry arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, ValueError):
            raise ValueError(f"the {args_key} of the tool call are a string that is not a JSON object") from None
    if not isinstance(args, dict):
        raise ValueError(f"the {args_key} of the tool call must be a JSON object, got {type(args).__name__}")
    return ToolCall(name.strip(), args)


def _tool_call_query(payload: str) -> str:
    """The query of a search tool call (either JSON form, see `decode_tool_call`), or "" if malformed."""
    try:
        call = decode_tool_call(payload)
    except ValueError:
        return ""
    if call.name not in SEARCH_TOOL_NAMES:
        return ""
    query = call.arguments.get("query")
    return query.strip() if isinstance(query, str) else ""


def search_observation(passages: str, protocol: str = "tags") -> str:
    """The text the environment appends after a search: rendered passages inside the wrapper."""
    opening, closing = _WRAPPERS[check_protocol(protocol)]
    return f"{opening}{passages.strip()}{closing}"


def search_rounds(trajectory: str, protocol: str = "tags") -> list[tuple[str, str]]:
    """(query, observation body) of each search round in a decoded trajectory, in order.

    The trajectory is what the rollout wrote: policy turns with the environment's observations between
    them. Each observation is paired with the search action of the policy text before it; an
    observation not preceded by a search action (which the rollout never writes) is skipped. After an
    invalid turn, the turn that searched is the one after the corrective message.

    >>> search_rounds("<search> a </search>\\n\\n<information>Doc 1 x</information>\\n\\n<answer> x </answer>")
    [('a', 'Doc 1 x')]
    """
    opening, closing = (w.strip() for w in _WRAPPERS[check_protocol(protocol)])
    rounds, start = [], 0
    for m in re.finditer(re.escape(opening) + r"(.*?)" + re.escape(closing), trajectory, re.DOTALL):
        # The turn that searched follows the last corrective message (which itself quotes the tags).
        turn = trajectory[start:m.start()].split(_INVALID_TEXT[protocol].strip())[-1]
        action = parse_action(turn, protocol)
        if action.kind == "search":
            rounds.append((action.content, m.group(1).strip()))
        start = m.end()
    return rounds


def mentions_any(text: str, names) -> bool:
    """Whether `text` contains any of `names`, ignoring case; an empty name never counts.

    Used to ask whether an observation showed an entity or a gold answer (the warm-start's evidence
    filter, the two-hop failure analysis), so both read "shown" the same way.

    >>> mentions_any("Doc 1 Paris is ...", ["paris", ""]), mentions_any("anything", [""])
    (True, False)
    """
    lowered = text.lower()
    return any(n and n.lower() in lowered for n in names)


def failed_search_observation(protocol: str = "tags") -> str:
    """What the policy reads when the search engine failed after its retries."""
    return search_observation(SEARCH_FAILED_TEXT, protocol)


def invalid_action_observation(protocol: str = "tags") -> str:
    """The corrective message appended after an invalid action."""
    return _INVALID_TEXT[check_protocol(protocol)]


def _rust_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer, or None.

    Calling it directly skips transformers' per-element input checks, which cost more than the
    tokenization itself for a batch of 512 observations.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if backend is not None and hasattr(backend, "decode_batch") else None


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added; one batched call."""
    if not texts:
        return []
    backend = _rust_tokenizer(tokenizer)
    if backend is not None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def decode_ids(tokenizer, id_lists: list[list[int]]) -> list[str]:
    """Text of each id list (special tokens kept, so an EOS shows up as text); one batched call."""
    if not id_lists:
        return []
    backend = _rust_tokenizer(tokenizer)
    if backend is not None:
        return backend.decode_batch(id_lists, skip_special_tokens=False)
    return tokenizer.batch_decode(id_lists, skip_special_tokens=False)


class ObservationEncoder:
    """Token ids of observations, fitted to a per-row token budget.

    The constant texts (wrapper, invalid-action and search-failed messages) are tokenized once; the
    passages of a whole turn are tokenized in one batched tokenizer call, line by line (one line per
    retrieved document) through a bounded cache: documents recur across a GRPO group and across
    epochs, and tokenizing them is most of the loop's own cost. A search observation longer
    than its budget keeps the wrapper and loses the tail of the passages, so the closing tag stays.
    Pieces are tokenized separately, so the ids decode to exactly the observation text. New ASCII
    lines take `search_r1.bpe_cache.PieceEncoder` (same ids, without the Rust pre-tokenizer's slow
    regex) when the tokenizer qualifies; other lines go through the tokenizer.
    """

    def __init__(self, tokenizer, protocol: str = "tags", cache_lines: int = 100_000):
        self.tokenizer = tokenizer
        self.cache_lines = cache_lines
        self._line_ids: dict[str, list[int]] = {}
        self._pieces = PieceEncoder.for_tokenizer(tokenizer)  # exact fast path for ASCII lines, or None
        self.protocol = check_protocol(protocol)
        opening, closing = _WRAPPERS[protocol]
        self.opening_ids = self._encode([opening])[0]
        self.closing_ids = self._encode([closing])[0]
        self.invalid_ids = self._encode([invalid_action_observation(protocol)])[0]
        self.failed_ids = self.opening_ids + self._encode([SEARCH_FAILED_TEXT])[0] + self.closing_ids

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return encode_texts(self.tokenizer, texts)

    def _encode_passages(self, bodies: list[str]) -> dict[str, list[int]]:
        """body -> ids, the concatenated ids of its lines; unseen lines tokenized in one call."""
        lines_of = {b: b.splitlines(keepends=True) for b in bodies}
        new = [ln for ln in dict.fromkeys(itertools.chain.from_iterable(lines_of.values()))
               if ln not in self._line_ids]
        if len(self._line_ids) + len(new) > self.cache_lines:
            self._line_ids.clear()  # wholesale eviction: cheaper than LRU bookkeeping per lookup
        if self._pieces is not None and new:
            fast = [ln for ln in new if self._pieces.fits(ln)]
            slow = [ln for ln in new if not self._pieces.fits(ln)] if len(fast) < len(new) else []
            self._line_ids.update(zip(fast, self._pieces.encode(fast)))
            self._line_ids.update(zip(slow, self._encode(slow)))
        else:
            self._line_ids.update(zip(new, self._encode(new)))
        cache = self._line_ids
        return {b: list(itertools.chain.from_iterable(cache[ln] for ln in lines)) for b, lines in lines_of.items()}

    @property
    def min_search_tokens(self) -> int:
        """The smallest search observation: the wrapper plus one passage token."""
        return len(self.opening_ids) + len(self.closing_ids) + 1

    def encode(self, kinds: list[str], passages: list[str | None], budgets: list[int]) -> list[list[int] | None]:
        """One observation per row.

        kinds: "search" | "failed" | "invalid"; passages: the rendered results for "search" rows
        (ignored otherwise); budgets: the most tokens each observation may take. Returns the ids, or
        None where even the shortest form does not fit (the caller ends that trajectory).
        Also records `self.last_shortened`: how many rows had passages cut this call.
        """
        # Identical results (a GRPO group asking the same query) are handled once.
        ids_of = self._encode_passages(list(dict.fromkeys(
            passages[i].strip() for i, k in enumerate(kinds) if k == "search")))
        out: list[list[int] | None] = []
        self.last_shortened = 0
        wrap = len(self.opening_ids) + len(self.closing_ids)
        for i, kind in enumerate(kinds):
            budget = budgets[i]
            if kind == "search":
                body = ids_of[passages[i].strip()]
                if wrap + len(body) > budget:
                    if budget < self.min_search_tokens:
                        out.append(None)
                        continue
                    body = body[: budget - wrap]
                    self.last_shortened += 1
                out.append(self.opening_ids + body + self.closing_ids)
            elif kind in ("failed", "invalid"):
                ids = self.failed_ids if kind == "failed" else self.invalid_ids
                out.append(list(ids) if len(ids) <= budget else None)
            else:
                raise ValueError(f"observation kind {kind!r}; allowed values: ['search', 'failed', 'invalid']")
        return out
