"""`SearchR1Config`: every setting of the single-process GRPO API, validated on construction.

    cfg = SearchR1Config(model_name_or_path="tiny-random-qwen3", group_size=4, max_tokens=128)
    cfg = SearchR1Config.from_yaml("grpo.yaml")        # unknown keys are errors
    cfg.to_yaml("grpo.yaml")                           # secrets are never written

Secrets come from the environment when the field is empty: `openai_api_key` from OPENAI_API_KEY,
`web_api_key` from the provider's variable (GOOGLE_API_KEY / SERPER_API_KEY / TAVILY_API_KEY) and
the retriever's bearer token from RETRIEVER_API_KEY (read by `RetrieverClient`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SEARCH_BACKENDS = ("retriever", "web", "synthetic")
CHAT_FORMATS = ("chatml", "tokenizer")
DTYPES = ("auto", "float32", "float16", "bfloat16")
SECRET_FIELDS = ("openai_api_key", "web_api_key")
OPENAI_KEY_ENV = "OPENAI_API_KEY"


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class SearchR1Config:
    # --- generation backend -----------------------------------------------------------------------
    # Generate through an OpenAI-compatible API instead of local weights (inference only: no policy
    # update is possible then). Which API: see openai_api.
    use_openai: bool = False
    # auto | completions | chat. completions: /v1/completions with token-id prompts of
    # model_name_or_path's tokenizer (vLLM, SGLang, llama.cpp serving that model; exact ids).
    # chat: /v1/chat/completions with the prompt's system/user messages, the policy's turns as
    # assistant messages and each <information> block as a user message; replies are re-tokenized
    # with the local tokenizer (inexact ids, log-probs NaN where the tokens differ). auto = chat for
    # api.openai.com (gpt-4o-mini offers only chat), completions for any other host.
    openai_api: str = "auto"
    # API key of that server; empty = env OPENAI_API_KEY (or no key).
    openai_api_key: str = ""
    # Model name sent to the server.
    openai_model: str = "gpt-4o-mini"
    # Base URL of the OpenAI-compatible server ("http://host:port", ".../v1", or the full
    # ".../v1/completions" / ".../v1/chat/completions").
    openai_base_url: str = "https://api.openai.com/v1"
    # Send openai_api_key over plain http to a non-loopback host (a server on a network you trust).
    # Off: such a URL is refused while a key is set (the key would cross the network in clear).
    openai_allow_insecure_http: bool = False
    # Policy weights: an alias (`smollm2-135m-instruct`, `tiny-random-qwen3`), an HF directory or a
    # .gguf file (see search_r1.models); with use_openai, only its tokenizer is used.
    model_name_or_path: str = "smollm2-135m-instruct"
    # Torch device; default cuda when available, else cpu.
    device: str = field(default_factory=_default_device)
    # Compute dtype of the forward passes (sampling, log-probs, update) under autocast; the weights and
    # AdamW's state stay float32 (mixed precision). auto = bfloat16 on a CUDA device that supports
    # it, else float16 there, float32 on CPU. float16 trains with a gradient scaler (its range is
    # too small for unscaled gradients).
    dtype: str = "auto"
    # Prompt format: chatml (the built-in ChatML text with two examples) or tokenizer (the same
    # system + user messages through the tokenizer's own chat template).
    chat_format: str = "chatml"
    # Token budget of one response: generated tokens plus inserted <information> tokens.
    max_tokens: int = 500
    # Longest prompt in tokens; a longer one keeps its last max_prompt_length tokens.
    max_prompt_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 = no top-k filtering.
    top_k: int = -1
    # Base seed of sampling and data order (None = unseeded); step s samples with seed + 10007 * s.
    seed: int | None = 0
    # Prompts per generation batch (None = all samples of a step at once).
    generation_batch_size: int | None = None

    # --- GRPO -------------------------------------------------------------------------------------
    # Samples per query; advantages compare the samples of one query (>= 2).
    group_size: int = 2
    # PPO iterations (optimizer steps) per batch of trajectories.
    update_times: int = 4
    clip_epsilon: float = 0.2
    # Weight of the K3 KL penalty to the policy that sampled the batch.
    beta: float = 0.1
    learning_rate: float = 1e-5
    # Queries per train step in `train`.
    batch_size: int = 1
    num_epochs: int = 10
    max_grad_norm: float = 0.5
    # No optimizer step when every advantage of the batch is 0 (every group scored alike): AdamW would
    # still move each weight by about learning_rate (momentum of the last step, weight decay) in a
    # direction no reward chose. False = always step.
    skip_zero_advantage: bool = True
    # Trajectories per forward/backward pass; halved automatically on out-of-memory.
    micro_batch_size: int = 4

    # --- reward (search_r1.rewards tiers, values configurable) ------------------------------------
    # Well-formed response (tags in protocol order, answer last).
    format_reward: float = 0.5
    # Malformed response.
    format_penalty: float = -1.0
    # Answer similar to a gold answer (difflib ratio >= 0.5 after lowercasing, no whitespace).
    answer_reward: float = 1.0
    # Answer exactly equal to a gold answer.
    exact_match_bonus: float = 2.0

    # --- logging / checkpoints --------------------------------------------------------------------
    # Print a metrics line every N steps in `train` (0 = never).
    log_interval: int = 1
    # Save a checkpoint under output_dir every N steps in `train` (0 = never).
    save_interval: int = 0
    output_dir: str = ""
    # Show a tqdm progress bar in `train`.
    progress: bool = True

    # --- search -----------------------------------------------------------------------------------
    # Engine built when GRPOTrainer gets none: retriever (our HTTP server), web (a web search API) or
    # synthetic (a MockSearchEngine over the synthetic world's passages, no server needed).
    search_backend: str = "retriever"
    # The retriever server (`python -m retriever_server serve`); GRPOTrainer checks at construction
    # that it answers (with RETRIEVER_API_KEY when the server needs a key).
    retriever_url: str = "http://127.0.0.1:8000"
    # Passages per search.
    topk: int = 3
    # Search rounds per trajectory; one more round without search follows.
    max_turns: int = 2
    # Most tokens of one inserted <information> block (longer results are shortened inside the tags).
    max_obs_length: int = 256
    search_timeout: float = 10.0
    search_retries: int = 3
    # Web search: provider (google | serper | tavily), key (empty = provider env variable), Google's
    # Programmable Search Engine id (cx), requests per second.
    web_provider: str = "google"
    web_api_key: str = ""
    web_cx: str = ""
    web_rate_limit: float = 5.0

    def __post_init__(self):
        if not self.openai_api_key:
            self.openai_api_key = os.environ.get(OPENAI_KEY_ENV, "")
        if not isinstance(self.device, str):
            raise ValueError(f"SearchR1Config.device must be a string like 'cpu' or 'cuda:0', got {self.device!r}")
        _choice("device", self.device.split(":")[0], ("cpu", "cuda", "mps", "xpu"))
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"SearchR1Config.device={self.device!r} but CUDA is not available; set device='cpu'")
        _choice("dtype", self.dtype, DTYPES)
        _choice("chat_format", self.chat_format, CHAT_FORMATS)
        _choice("search_backend", self.search_backend, SEARCH_BACKENDS)
        for name, low in (("max_tokens", 1), ("max_prompt_length", 1), ("group_size", 2), ("update_times", 1),
                          ("batch_size", 1), ("num_epochs", 1), ("micro_batch_size", 1), ("log_interval", 0),
                          ("save_interval", 0), ("topk", 1), ("max_turns", 0), ("max_obs_length", 1),
                          ("search_retries", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                hint = " (GRPO compares samples of one query)" if name == "group_size" else ""
                raise ValueError(f"SearchR1Config.{name} must be an int >= {low}{hint}, got {value!r}")
        for name, low, open_low in (("clip_epsilon", 0.0, True), ("beta", 0.0, False), ("learning_rate", 0.0, True),
                                    ("max_grad_norm", 0.0, True), ("temperature", 0.0, False),
                                    ("search_timeout", 0.0, True), ("web_rate_limit", 0.0, True)):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value < low or (open_low and value == low)):
                raise ValueError(f"SearchR1Config.{name} must be a number {'>' if open_low else '>='} {low}, "
                                 f"got {value!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SearchR1Config.top_p must be in (0, 1], got {self.top_p!r}")
        if self.generation_batch_size is not None and self.generation_batch_size < 1:
            raise ValueError(f"SearchR1Config.generation_batch_size must be None or >= 1, "
                             f"got {self.generation_batch_size!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SearchR1Config.seed must be an int or None, got {self.seed!r}")
        if self.save_interval and not self.output_dir:
            raise ValueError("SearchR1Config.save_interval > 0 needs output_dir (where checkpoints go); "
                             "set output_dir or save_interval=0")
        if self.use_openai and not self.openai_base_url:
            raise ValueError("SearchR1Config.use_openai=True needs openai_base_url, e.g. 'http://127.0.0.1:8000/v1'")
        self.resolved_openai_api  # validates openai_api (a clear ValueError listing the choices)
        for name in ("format_reward", "format_penalty", "answer_reward", "exact_match_bonus"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"SearchR1Config.{name} must be a finite number, got {value!r}")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        """The autocast dtype `dtype` names on `device` (float32 = no autocast)."""
        if self.dtype == "auto":
            if self.device.startswith("cuda"):
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return torch.float32
        return getattr(torch, self.dtype)

    @property
    def resolved_openai_api(self) -> str:
        """"completions" or "chat": `openai_api` with auto decided from `openai_base_url`."""
        from search_r1.grpo.openai_chat import resolve_openai_api

        return resolve_openai_api(self.openai_api, self.openai_base_url)

    # -- serialization ---------------------------------------------------------------------------
    def to_dict(self, include_secrets: bool = False) -> dict:
        """Plain dict of every field; secrets are blanked unless `include_secrets`."""
        d = dataclasses.asdict(self)
        if not include_secrets:
            for name in SECRET_FIELDS:
                d[name] = ""
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SearchR1Config":
        if not isinstance(d, dict):
            raise ValueError(f"SearchR1Config needs a mapping of settings, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"SearchR1Config: unknown keys {unknown}; valid keys: {names}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "SearchR1Config":
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.from_dict(data)

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "SearchR1Config":
        """From a JSON file path, or a JSON object string."""
        text = str(path_or_text)
        data = json.loads(text) if text.lstrip().startswith("{") else json.loads(Path(text).read_text())
        return cls.from_dict(data)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """YAML text of the config (secrets blanked); also written to `path` when given."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"SearchR1Config.{name}={value!r} is invalid; choose one of {list(choices)}")
