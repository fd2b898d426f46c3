"""The chat-model seam of the agents: one call, `chat(messages, stop=..., max_tokens=...) -> ChatReply`.

Two implementations, both thin adapters over the project's generators:

- `ServerChatModel`: any OpenAI-compatible `/v1/chat/completions` endpoint (a hosted API, `vllm
  serve`), through `search_r1.grpo.openai_chat.OpenAIChatGenerator.chat` (its retries, backoff and
  key scrubbing). The key comes from an environment variable and is never logged.
- `LocalChatModel`: a transformers model (an alias such as the bundled `smollm2-135m-instruct`, an HF
  directory, one of our checkpoints or training runs) through `search_r1.rollout.backends.HFGenerator`,
  which stops on the exact token that completes a stop string (the stopping criterion) or on EOS.

Conversations are `{"role", "content"}` dicts. One that ends with an assistant message is continued
(the model writes more of that message) rather than answered with a new turn: that is how a model
trained by our rollout reads its own turns and the tool responses inserted between them. Such a
message may list `parts`, text pieces whose concatenation is its content; a local model tokenizes
them one by one, as the rollout tokenizes generated text and observations separately. Servers
continue a message through vLLM's `continue_final_message` and never see `parts`.

Scripted models for tests live in tests/search_r1/agents/, not here.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

FINISH_REASONS = ("stop", "end", "length")


@dataclass(frozen=True)
class ChatReply:
    """One reply. text: what the model wrote (ending with the stop string when one ended it; no EOS
    marker); finish_reason: "stop" (a stop string), "end" (the model ended its turn: EOS /
    <|im_end|>), "length" (max_tokens); stop: the stop string ("" otherwise); token counts."""

    text: str
    finish_reason: str
    stop: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ContextOverflow(ValueError):
    """The conversation no longer fits the model's context window (a local model's limit, or a
    server's 400 saying so: `backends.ContextLengthError`)."""


# How the agents' users opt in to a key over plain http (named in the refusal; search_r1.transport).
AGENT_INSECURE_HTTP_OPT_IN = ("--allow-insecure-http (or --no-api-key when the server needs no key)")


@runtime_checkable
class ChatModel(Protocol):
    name: str

    def chat(self, messages: list[dict], *, stop: Sequence[str] = (), max_tokens: int = 512,
             temperature: float = 0.0, seed: int | None = None) -> ChatReply:
        ...


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be {{'role': system|user|assistant, 'content': str}}, got {m!r:.120}")


class ServerChatModel:
    """A model behind an OpenAI-compatible chat completions endpoint (see the module docstring)."""

    def __init__(self, generator):
        self.generator = generator
        self.name = generator.model

    def chat(self, messages: list[dict], *, stop: Sequence[str] = (), max_tokens: int = 512,
             temperature: float = 0.0, seed: int | None = None) -> ChatReply:
        """One reply; ContextOverflow when the server says the conversation does not fit, any other
        failure after the generator's retries (401/403, other 4xx, server down) a GenerationError."""
        from search_r1.rollout.backends import ContextLengthError, SamplingParams

        _check_messages(messages)
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        continue_final = clean[-1]["role"] == "assistant"
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=tuple(stop), seed=seed)
        try:
            reply = self.generator.chat(clean, params, continue_final=continue_final)
        except ContextLengthError as exc:
            raise ContextOverflow(str(exc)) from exc
        finish = "stop" if reply.stop else "end" if reply.finish_reason == "stop" else "length"
        # Servers without `usage` (rare): about 4 characters per token, so token budgets still bind.
        completion = reply.completion_tokens if reply.completion_tokens is not None else max(1, len(reply.text) // 4)
        return ChatReply(reply.text, finish, reply.stop, reply.prompt_tokens or 0, completion)

    def close(self) -> None:
        self.generator.close()


class LocalChatModel:
    """A local transformers model behind the chat seam (see the module docstring).

    Calls are serialized (one forward pass at a time; agents running several questions at once share
    the model and still overlap their searches). A conversation longer than the model's context
    (`max_position_embeddings`) raises ContextOverflow; max_tokens shrinks to what still fits.
    """

    def __init__(self, model, tokenizer, name: str = "local"):
        from search_r1.rollout.backends import HFGenerator

        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.generator = HFGenerator(model, tokenizer)
        self.context_limit = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self._lock = threading.Lock()

    def encode(self, messages: list[dict]) -> list[int]:
        """Prompt ids: the chat template with the generation prompt, plus a continued assistant message."""
        from search_r1.prompts import apply_chat_template
        from search_r1.protocol import encode_texts

        _check_messages(messages)
        if messages[-1]["role"] != "assistant":
            return apply_chat_template(self.tokenizer, messages)
        head = apply_chat_template(self.tokenizer, messages[:-1])
        parts = messages[-1].get("parts") or [messages[-1]["content"]]
        if "".join(parts) != messages[-1]["content"]:
            raise ValueError("an assistant message's parts must concatenate to its content")
        return head + [t for ids in encode_texts(self.tokenizer, [p for p in parts if p]) for t in ids]

    def chat(self, messages: list[dict], *, stop: Sequence[str] = (), max_tokens: int = 512,
             temperature: float = 0.0, seed: int | None = None) -> ChatReply:
        from search_r1.rollout.backends import SamplingParams

        ids = self.encode(messages)
        room = self.context_limit - len(ids)
        if room < 1:
            raise ContextOverflow(f"the conversation is {len(ids)} tokens; {self.name} holds {self.context_limit}")
        params = SamplingParams(max_tokens=min(max_tokens, room), temperature=temperature, stop=tuple(stop), seed=seed)
        with self._lock:
            out = self.generator.generate([ids], params)[0]
        tokens = list(out.token_ids)
        ended = bool(tokens) and tokens[-1] in self.generator.eos_token_ids
        text = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
        hit = ""
        if not ended and stop:
            # The last token completed the stop string; it may carry a few characters past it.
            found = [(text.find(s), s) for s in stop if s in text]
            if found:
                at, hit = min(found)
                text = text[: at + len(hit)]
        finish = "end" if ended else "stop" if hit else "length"
        return ChatReply(text, finish, hit, len(ids), len(tokens))

    def close(self) -> None:
        pass


def load_chat_model(model: str, base_url: str | None = None, api_key_env: str | None = "OPENAI_API_KEY",
                    dtype: str = "float32", timeout: float = 300.0, max_concurrency: int = 8, retries: int = 3,
                    allow_insecure_http: bool = False):
    """A ChatModel: the server at `base_url` serving `model`, or the local model `model` (alias, HF
    directory, checkpoint or training run directory) in `dtype` (float32 | bfloat16).

    The API key is read from the environment variable `api_key_env` (never from the command line,
    never logged); None sends no key (a server that needs none, e.g. `vllm serve` without
    --api-key). A key is refused over plain http to anything but loopback unless
    `allow_insecure_http`. `timeout`: seconds per request; `retries`: extra attempts after a
    connection error, timeout, 408/429 or 5xx.
    """
    if base_url:
        from search_r1.grpo.openai_chat import OpenAIChatGenerator

        key = (os.environ.get(api_key_env) or None) if api_key_env else None
        generator = OpenAIChatGenerator(base_url, model, tokenizer=None, api_key=key, timeout=timeout, retries=retries,
                                        max_concurrency=max_concurrency, allow_insecure_http=allow_insecure_http,
                                        insecure_http_opt_in=AGENT_INSECURE_HTTP_OPT_IN)
        generator.key_source = (f"the {api_key_env} environment variable" if api_key_env else
                                "OPENAI_API_KEY (or the variable --api-key-env names, without --no-api-key)")
        return ServerChatModel(generator)
    import torch

    from search_r1.evaluation.runner import resolve_model_dir
    from search_r1.models import load_model_and_tokenizer

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype {dtype!r}; choose float32 or bfloat16")
    hf_model, tokenizer = load_model_and_tokenizer(resolve_model_dir(model),
                                                   dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    return LocalChatModel(hf_model, tokenizer, name=model)
