"""A local fake of an OpenAI-compatible chat completions server shaped like `vllm serve` (the GPU /
hosted server is the boundary tests cannot reach): POST /v1/chat/completions with a bearer key,
OpenAI's request fields plus vLLM's `continue_final_message` / `add_generation_prompt`, replies
cut BEFORE the first stop string (not returned, as vLLM and OpenAI do), `finish_reason` "stop" with
vLLM's `stop_reason` (the matched string, or None at the end of the turn), or "length", and `usage`.

Like the real APIs it refuses, with their 400 error shape: a field sent as null or an empty list
(OpenAI answers `"stop": []` with "[] is too short - 'stop'"), and, with `max_model_len`, a request
whose prompt plus max tokens exceeds the context window (vLLM's message). With `reasoning_field`
("reasoning_content", or vLLM >= 0.10's "reasoning") it splits a leading `<think>...</think>` off
the reply into that field, as a server's reasoning parser does (QwQ, Qwen3 thinking).

The model is a function `respond(messages) -> str`, or `-> Fail(status, message)` for an error answer
(a 403, a 503, a context overflow the test wants on one question); with continue_final_message the
reply is the continuation only, as vLLM returns it. Tokens are whitespace words.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from tests._fixtures.json_server import serve_json

FIELDS = {"model", "messages", "stop", "max_completion_tokens", "max_tokens", "temperature", "top_p", "n", "stream",
          "logprobs", "top_logprobs", "seed", "continue_final_message", "add_generation_prompt"}
_THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class Fail:
    """What `respond` returns for an error answer."""

    status: int
    message: str
    code: str | int | None = None


def context_overflow(max_model_len: int, prompt: int, output: int) -> Fail:
    """vLLM's 400 for a request longer than --max-model-len (vllm/renderers/params.py, 0.27)."""
    return Fail(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                     f"{output} output tokens and your prompt contains {prompt} input tokens, for a total of "
                     f"{prompt + output} tokens. Please reduce the length of the input prompt or the number of "
                     "requested output tokens.", 400)


def _error(fail: Fail):
    kind = "BadRequestError" if fail.status == 400 else "AuthenticationError" if fail.status in (401, 403) \
        else "ServiceUnavailableError"
    return fail.status, {"error": {"message": fail.message, "type": kind, "param": None, "code": fail.code}}


class FakeChatServer:
    def __init__(self, respond, api_key: str | None = None, model: str = "served-model",
                 max_model_len: int | None = None, reasoning_field: str | None = None):
        self.respond, self.api_key, self.model = respond, api_key, model
        self.max_model_len, self.reasoning_field = max_model_len, reasoning_field
        self.requests: list[dict] = []
        self.auth: list[str | None] = []  # the Authorization header of every request
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.server, self.base_url = serve_json(self.handle)

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def invalid(self, body) -> str | None:
        unknown = set(body) - FIELDS
        if unknown or body.get("model") != self.model:
            return f"unknown fields {sorted(unknown)} or model {body.get('model')!r}"
        for key, value in body.items():
            if value is None:
                return f"None is not of type 'array', 'string', 'number', 'boolean' - '{key}'"
            if isinstance(value, list) and not value:
                return f"[] is too short - '{key}'"
        msgs = body["messages"]
        if any(set(m) != {"role", "content"} for m in msgs):
            return "messages hold only role and content"
        if body.get("continue_final_message") and msgs[-1]["role"] != "assistant":
            return "continue_final_message needs a final assistant message"
        return None

    def handle(self, path, headers, body):
        with self.lock:
            self.auth.append(headers.get("Authorization"))
        if path != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {path}"}}
        if self.api_key and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"error": {"message": f"bad key {headers.get('Authorization')}", "code": "invalid_api_key"}}
        problem = self.invalid(body)
        if problem:
            return _error(Fail(400, problem, 400))
        msgs = body["messages"]
        prompt = sum(len(m["content"].split()) for m in msgs)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 10**9
        if self.max_model_len is not None and prompt + min(limit, self.max_model_len) > self.max_model_len:
            return _error(context_overflow(self.max_model_len, prompt, limit))
        with self.lock:
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            full = self.respond(msgs)
        finally:
            with self.lock:
                self.in_flight -= 1
        if isinstance(full, Fail):
            return _error(full)
        cuts = [(full.find(s), s) for s in body.get("stop") or [] if s in full]
        finish, reason, text = "stop", None, full
        if cuts:
            at, reason = min(cuts)
            text = full[:at]
        words = text.split(" ")
        if len(words) > limit:
            text, finish, reason = " ".join(words[:limit]), "length", None
        message = {"role": "assistant", "content": text}
        think = _THINK_RE.match(text) if self.reasoning_field else None
        if think:
            message = {"role": "assistant", self.reasoning_field: think.group(1), "content": text[think.end():]}
        return 200, {"id": "chatcmpl-1", "object": "chat.completion", "model": self.model,
                     "choices": [{"index": 0, "message": message,
                                  "finish_reason": finish, "stop_reason": reason, "logprobs": None}],
                     "usage": {"prompt_tokens": prompt, "completion_tokens": len(text.split()), "total_tokens": 0}}
