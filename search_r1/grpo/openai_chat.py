"""`OpenAIChatGenerator`: the rollout's `Generator` over an OpenAI-style `/v1/chat/completions` API.

api.openai.com's chat models (gpt-4o-mini, the config default) offer only chat completions, while
the rollout speaks token ids (`Generator.generate(prompts: list[list[int]], params)`). This backend
maps each token context back to chat messages, asks for one assistant turn, and re-encodes the
reply with the local tokenizer:

    context ids = prompt ids (registered with their messages) + response so far
    response    = assistant text ... </search>  \\n\\n<information>...</information>\\n\\n  assistant text ...
    messages    = system, user (the prompt)   + assistant, user (the block),                   ...

Inference only: the ids are a re-tokenization (`token_ids_exact=False`), so no policy update can use
them (`GRPOTrainer.update_policy` refuses anyway with use_openai).

`resolve_openai_api(mode, base_url)` decides which API a config uses (`auto`: chat for
api.openai.com, completions for everything else, e.g. vLLM, SGLang, llama.cpp servers).
"""
from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

from search_r1.protocol import (decode_ids, encode_texts, invalid_action_observation, search_observation,
                                stop_strings)
from search_r1.rollout.backends import (INSECURE_HTTP_OPT_IN, GenerationError, GenOutput, OpenAIGenerator,
                                        SamplingParams, _check_prompts, drop_empty, endpoint_url, post_json)
from search_r1.transport import check_key_transport

OPENAI_APIS = ("auto", "completions", "chat")  # SearchR1Config.openai_api
CHAT_HOSTS = frozenset({"api.openai.com"})  # hosts that serve chat completions only (for `auto`)
KEY_ENV = "OPENAI_API_KEY"


def resolve_openai_api(mode: str, base_url: str) -> str:
    """"completions" or "chat" for `SearchR1Config.openai_api` = `mode` and its `openai_base_url`.

    auto: chat when the host is api.openai.com or the URL names ".../chat/completions"; otherwise
    completions (vLLM / SGLang / llama.cpp speak token-id /v1/completions, which keeps exact ids).
    """
    if mode not in OPENAI_APIS:
        raise ValueError(f"SearchR1Config.openai_api={mode!r} is invalid; choose one of {list(OPENAI_APIS)} "
                         "(auto = chat for api.openai.com, completions for other hosts such as a vLLM server)")
    if mode != "auto":
        return mode
    url = (base_url or "").rstrip("/")
    if (urlparse(url).hostname or "").lower() in CHAT_HOSTS or url.endswith("/chat/completions"):
        return "chat"
    return "completions"


def chat_url(base_url: str) -> str:
    """Accept "https://host", "https://host/v1" or the full ".../v1/chat/completions"."""
    return endpoint_url(base_url, "chat/completions")


def missing_stop(text: str, stops: tuple[str, ...]) -> str:
    """The stop tag a chat API cut off the end of `text`, or "".

    OpenAI's chat API stops *before* a stop string and does not return it. A turn that stopped on
    `</search>` (or `</answer>`) therefore ends inside an open `<search>` (`<answer>`): the tag whose
    opening comes last without its closing after it is the one that was hit. For the tags protocol
    the stops are `</search>` and `</answer>`, whose openings are `<search>` and `<answer>`.
    """
    best, best_at = "", -1
    for stop in stops:
        opening = "<" + stop[2:] if stop.startswith("</") else ""
        at = text.rfind(opening) if opening else -1
        if at > best_at and stop not in text[at:]:
            best, best_at = stop, at
    return best


def with_reasoning(message: dict) -> str:
    """A reply message's text with the reasoning a server's reasoning parser split off put back in
    front as `<think>reasoning</think>`: `reasoning_content` (DeepSeek's API, vLLM before 0.10) or
    `reasoning` (vLLM >= 0.10)."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning.strip():
        return content
    return f"<think>{reasoning}</think>" + (f"\n\n{content.lstrip()}" if content.strip() else "")


@dataclass(frozen=True)
class ChatCompletion:
    """One assistant reply of `OpenAIChatGenerator.chat`.

    text: the reply, ending with the stop string that ended it (re-appended: chat APIs cut it off);
    finish_reason: "stop" (a stop string or the model's end of turn) or "length" (max tokens);
    stop: the stop string that ended the reply, "" if none did; prompt_tokens / completion_tokens:
    the server's `usage` counts (None when it sends none).
    """

    text: str
    finish_reason: str
    stop: str
    prompt_tokens: int | None
    completion_tokens: int | None


class OpenAIChatGenerator:
    """Generator over `POST {base_url}/v1/chat/completions` (OpenAI, or any server with its shape).

    Prompts: the chat API takes messages, not ids, so the caller registers each prompt's ids with
    its messages (`register_prompt`, done by `GRPOTrainer.rollout`); a context is that prompt
    followed by the response so far, which `messages_for` splits back into turns.

    Mapping of the response so far (why): the chat API cannot continue a partial assistant message
    (no prefill) and its `tool` role needs native `tool_calls`, which the text protocol does not
    use. So each generated segment (ending with its re-appended `</search>`) is an `assistant`
    message, and each environment block that the rollout inserted after it (`<information>...
    </information>`, or the invalid-action notice) is the next `user` message, verbatim minus the
    blank lines that separate it from the policy's text in the token stream (message boundaries
    separate it here). The model thus reads exactly the text a token-level policy reads, with each
    block attributed to the environment rather than to itself, and answers with the next turn.

    Request: `model`, `messages`, `stop` (the protocol's, e.g. ["</search>", "</answer>"]),
    `max_completion_tokens`, `temperature`, `top_p`, `logprobs=true`, `n=1`, `seed` (params.seed +
    row, so a GRPO group's identical contexts differ) and `extra_body`. top_k has no OpenAI field:
    it is dropped with a warning (pass it in extra_body for servers that accept it).

    Response: `choices[0].message.content`; with finish_reason "stop" the stop tag the API cut off
    is re-appended (`missing_stop`) so the protocol parser sees the action. Token ids are the local
    tokenizer's encoding of the content, then of the re-appended tag (`token_ids_exact` is False).
    Log-probs: `choices[0].logprobs.content[i].logprob` when the API's tokens are the local ones
    (same count and same token texts), else NaN; the re-appended tag's tokens are NaN (the API does
    not report them). Never misaligned.

    Retries: `backends.post_json` (connection errors, timeouts, 408/429/5xx with backoff, a 429's
    Retry-After honoured); 401/403 name OPENAI_API_KEY; the key never appears in an error. With an
    `api_key`, plain http is refused for non-loopback hosts unless `allow_insecure_http=True`.
    """

    def __init__(self, base_url: str, model: str, tokenizer, api_key: str | None = None,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 0.5, max_concurrency: int = 8,
                 protocol: str = "tags", extra_body: dict | None = None, max_registered_prompts: int = 10_000,
                 allow_insecure_http: bool = False, insecure_http_opt_in: str = INSECURE_HTTP_OPT_IN):
        import httpx

        if retries < 0:
            raise ValueError(f"OpenAIChatGenerator retries must be >= 0, got {retries}")
        self.url = chat_url(base_url)
        if api_key:  # insecure_http_opt_in: how the caller's users set allow_insecure_http (for the error)
            check_key_transport(self.url, opt_in=insecure_http_opt_in, allow_insecure_http=allow_insecure_http)
        self.model, self.tokenizer = model, tokenizer
        self.api_key = api_key or ""
        # Where the key comes from, for the 401 message (callers reading another variable set it).
        self.key_source = f"the {KEY_ENV} environment variable (or SearchR1Config.openai_api_key)"
        self.retries, self.backoff = retries, backoff
        self.max_concurrency = max(1, max_concurrency)
        self.extra_body = dict(extra_body or {})
        self.stops = stop_strings(protocol)
        opening, closing = search_observation("\x00", protocol).split("\x00")  # the result's wrapper
        # An environment block: a wrapped search result right after the policy's closing tag, or the
        # invalid-action notice. Anchoring on the closing tag keeps a model that merely writes
        # "<information>" in its own text from being split.
        self._env_re = re.compile("(?<=" + re.escape(self.stops[0]) + ")" + re.escape(opening) + ".*?"
                                  + re.escape(closing) + "|" + re.escape(invalid_action_observation(protocol)),
                                  re.DOTALL)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers)
        self.token_ids_exact = False  # always re-tokenized text
        self.logprobs_available = True
        self.max_registered_prompts = max_registered_prompts
        self._prompts: dict[int, dict[tuple[int, ...], list[dict]]] = {}  # length -> ids -> messages
        self._registered = 0
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # Client lifetime and warn-once are OpenAIGenerator's, shared as plain functions (no inheritance:
    # the two generators share these, not their request or response logic).
    close = OpenAIGenerator.close
    __enter__ = OpenAIGenerator.__enter__
    __exit__ = OpenAIGenerator.__exit__
    _warn_once = OpenAIGenerator._warn_once

    # -- prompts and messages ---------------------------------------------------------------------

    def register_prompt(self, prompt_ids: list[int], messages: list[dict]) -> None:
        """Remember that `prompt_ids` is the tokenized form of `messages` (system/user turns)."""
        key = tuple(int(t) for t in prompt_ids)
        with self._lock:
            if self._registered >= self.max_registered_prompts:  # a long run: forget old prompts
                self._prompts.clear()
                self._registered = 0
            bucket = self._prompts.setdefault(len(key), {})
            if key not in bucket:
                self._registered += 1
            bucket[key] = [dict(m) for m in messages]

    def messages_for(self, context: list[int]) -> list[dict]:
        """The chat messages of one token context (see the class docstring for the mapping)."""
        for length in sorted(self._prompts, reverse=True):  # longest registered prefix wins
            head = self._prompts[length].get(tuple(context[:length]))
            if head is not None:
                break
        else:
            raise GenerationError("OpenAIChatGenerator got a prompt it has no messages for; call "
                                  "register_prompt(prompt_ids, messages) first (GRPOTrainer does this)")
        messages = [dict(m) for m in head]
        response = decode_ids(self.tokenizer, [list(context[length:])])[0] if len(context) > length else ""
        pos = 0
        for match in self._env_re.finditer(response):
            if response[pos:match.start()]:
                messages.append({"role": "assistant", "content": response[pos:match.start()]})
            messages.append({"role": "user", "content": match.group(0).strip()})
            pos = match.end()
        if response[pos:].strip():  # a trailing partial turn (not produced by the rollout) stays assistant
            messages.append({"role": "assistant", "content": response[pos:]})
        return messages

    # -- requests ---------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        _check_prompts(prompts)
        if not prompts:
            return []
        if self.tokenizer is None:
            raise ValueError("OpenAIChatGenerator.generate needs the local tokenizer (to split contexts into "
                             "messages and to turn replies into token ids); pass tokenizer=")
        if params.top_k > 0:
            self._warn_once("top_k", f"{self.url}: the chat completions API has no top_k; sampling without it")
        requests = [self.payload(self.messages_for(list(p)), params,
                                 None if params.seed is None else params.seed + i) for i, p in enumerate(prompts)]
        if len(requests) == 1:
            return [self._complete(requests[0], params)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(lambda body: self._complete(body, params), requests))

    def payload(self, messages: list[dict], params: SamplingParams, seed: int | None) -> dict:
        """The JSON body of one request (public so tests and users can see exactly what is sent)."""
        body = {"model": self.model, "messages": messages, "stop": list(params.stop) or list(self.stops),
                "max_completion_tokens": params.max_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "n": 1, "stream": False, "logprobs": True}
        if seed is not None:
            body["seed"] = seed
        body.update(self.extra_body)
        return drop_empty(body)

    def chat(self, messages: list[dict], params: SamplingParams, continue_final: bool = False) -> ChatCompletion:
        """One assistant reply to `messages` (`{"role", "content"}` dicts), for agents that keep a
        conversation rather than token ids. Stops at `params.stop` only (none: the model's end of
        turn). `continue_final=True` continues the last message, an assistant one, instead of
        starting a new turn (vLLM's `continue_final_message`; APIs without it reject or ignore it).
        No tokenizer needed; same retries and key handling as `generate`. Without stop strings the
        request has no `stop` field (OpenAI rejects an empty list). Reasoning a server's reasoning
        parser split off (`reasoning_content`, vLLM >= 0.10 `reasoning`: QwQ, Qwen3 thinking) comes
        back in front of the content as `<think>...</think>`, so the caller sees the whole turn.
        """
        if continue_final and (not messages or messages[-1].get("role") != "assistant"):
            raise ValueError("continue_final=True needs the conversation to end with an assistant message")
        body = self.payload(messages, params, params.seed)
        body.pop("stop", None)
        body.update(drop_empty({"stop": list(params.stop)}), logprobs=False)
        if continue_final:
            body.update(continue_final_message=True, add_generation_prompt=False)
        choice, usage = self._post(body)
        text = with_reasoning(choice["message"])
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        stop = ""
        if finish == "stop" and params.stop:
            # vLLM names the matched stop string in `stop_reason`; OpenAI does not, so infer it from
            # the tag left open at the end of the reply.
            reason = choice.get("stop_reason")
            stop = reason if isinstance(reason, str) and reason in params.stop else missing_stop(text, params.stop)
            if stop and not text.endswith(stop):
                text += stop
        return ChatCompletion(text, finish, stop, usage.get("prompt_tokens"), usage.get("completion_tokens"))

    def _post(self, body: dict) -> tuple[dict, dict]:
        """POST one request: its `choices[0]` (with a `message` dict) and its integer `usage` counts."""
        response = post_json(
            self._client, self.url, body, retries=self.retries, backoff=self.backoff, secret=self.api_key,
            honor_retry_after=True, rejected=self._rejected,
            hint="Check openai_base_url and that the server offers /v1/chat/completions.")
        choices = response.get("choices") if isinstance(response, dict) else None
        message = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if not isinstance(message, dict):
            raise GenerationError(f"{self.url} returned no choices[0].message: {str(response)[:300]}")
        usage = response.get("usage")
        counts = {k: v for k, v in (usage if isinstance(usage, dict) else {}).items()
                  if k in ("prompt_tokens", "completion_tokens") and isinstance(v, int)}
        return choices[0], counts

    def _complete(self, body: dict, params: SamplingParams) -> GenOutput:
        return self._parse(self._post(body)[0], params)

    def _rejected(self, error: str) -> str:
        if error.startswith(("HTTP 401", "HTTP 403")):
            return f"{self.url} rejected the API key ({error}); set {self.key_source} to a valid key"
        return f"{self.url} rejected the request ({error}); check openai_model {self.model!r} and the sampling parameters"

    # -- responses --------------------------------------------------------------------------------

    def _parse(self, choice: dict, params: SamplingParams) -> GenOutput:
        text = choice["message"].get("content") or ""
        finish = choice.get("finish_reason") or "length"
        stops = tuple(params.stop) or self.stops
        tag = missing_stop(text, stops) if finish == "stop" else ""
        ids = encode_texts(self.tokenizer, [text])[0] if text else []
        tag_ids = encode_texts(self.tokenizer, [tag])[0] if tag else []
        lps = self._aligned_logprobs(choice.get("logprobs"), ids) + [float("nan")] * len(tag_ids)
        return GenOutput(token_ids=ids + tag_ids, logprobs=lps, finish_reason="stop" if finish == "stop" else "length")

    def _aligned_logprobs(self, logprobs, ids: list[int]) -> list[float]:
        """The API's per-token log-probs if its tokens are the local `ids`, else NaN for each id.

        Equal counts are not enough (two tokenizers may split the same text differently at equal
        length), so each API token text must equal the local token's text too.
        """
        nan = [float("nan")] * len(ids)
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if content is None:
            if self.logprobs_available:
                self.logprobs_available = False
                self._warn_once("logprobs", f"{self.url} returned no logprobs; log-probs are NaN")
            return nan
        if len(content) != len(ids):
            return nan
        pieces = decode_ids(self.tokenizer, [[t] for t in ids])
        if any(isinstance(c.get("token"), str) and c["token"] != piece for c, piece in zip(content, pieces)):
            return nan
        return [float(c["logprob"]) if isinstance(c.get("logprob"), (int, float)) else float("nan") for c in content]
