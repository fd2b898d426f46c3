"""A local fake of an OpenAI-compatible chat completions server shaped like `vllm serve` (the GPU /
hosted server is the boundary tests cannot reach): POST /v1/chat/completions with a bearer key,
OpenAI's request fields plus vLLM's `continue_final_message` / `add_generation_prompt`, replies
cut BEFORE the first stop string (not returned, as vLLM and OpenAI do), `finish_reason` "stop" with
vLLM's `stop_reason` (the matched string, or None at the end of the turn), or "length", and `usage`.

The model is a function `respond(messages) -> str`; with continue_final_message the reply is the
continuation only, as vLLM returns it.
"""
from __future__ import annotations

import threading

from tests._fixtures.json_server import serve_json

FIELDS = {"model", "messages", "stop", "max_completion_tokens", "max_tokens", "temperature", "top_p", "n", "stream",
          "logprobs", "top_logprobs", "seed", "continue_final_message", "add_generation_prompt"}


class FakeChatServer:
    def __init__(self, respond, api_key: str | None = None, model: str = "served-model"):
        self.respond, self.api_key, self.model = respond, api_key, model
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.server, self.base_url = serve_json(self.handle)

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def handle(self, path, headers, body):
        if path != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {path}"}}
        if self.api_key and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"error": {"message": f"bad key {headers.get('Authorization')}", "code": "invalid_api_key"}}
        unknown = set(body) - FIELDS
        if unknown or body.get("model") != self.model:
            return 400, {"error": {"message": f"unknown fields {sorted(unknown)} or model {body.get('model')!r}"}}
        msgs = body["messages"]
        if any(set(m) != {"role", "content"} for m in msgs):
            return 400, {"error": {"message": "messages hold only role and content"}}
        if body.get("continue_final_message") and msgs[-1]["role"] != "assistant":
            return 400, {"error": {"message": "continue_final_message needs a final assistant message"}}
        with self.lock:
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            full = self.respond(msgs)
        finally:
            with self.lock:
                self.in_flight -= 1
        cuts = [(full.find(s), s) for s in body.get("stop") or [] if s in full]
        finish, reason, text = "stop", None, full
        if cuts:
            at, reason = min(cuts)
            text = full[:at]
        words = text.split(" ")
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 10**9
        if len(words) > limit:
            text, finish, reason = " ".join(words[:limit]), "length", None
        return 200, {"id": "chatcmpl-1", "object": "chat.completion", "model": self.model,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish, "stop_reason": reason, "logprobs": None}],
                     "usage": {"prompt_tokens": sum(len(m["content"].split()) for m in msgs),
                               "completion_tokens": len(text.split()), "total_tokens": 0}}
