"""Generator backends: the one interface the rollout uses to sample from a policy.

Contract: `Generator.generate(prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]`.
Every output ends at the first stop string (inclusive): any overshoot is trimmed, so the tokens the
rollout keeps are exactly the sampled ones up to and including the stop string's final token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings; temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k filtering (vLLM's convention)
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass
class GenOutput:
    """One sampled continuation.

    token_ids: the sampled ids, ending at (and including) the stop string's final token if one hit.
    logprobs: log p(token) under the sampling policy for each id (same length as token_ids).
    finish_reason: "stop" (stop string or EOS) or "length" (max_tokens reached).
    """

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


@runtime_checkable
class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        ...
