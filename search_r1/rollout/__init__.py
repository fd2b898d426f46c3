"""Multi-turn rollout: episodes, the batch generation manager, generator backends.

Names are resolved lazily so that importing a light submodule (e.g. `backends`) does not pay for
verl and torch imports it does not need.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Episode": "search_r1.rollout.episode",
    "EpisodeLimits": "search_r1.rollout.episode",
    "GenerationConfig": "search_r1.rollout.generation",
    "LLMGenerationManager": "search_r1.rollout.generation",
    "SamplingParams": "search_r1.rollout.backends",
    "GenOutput": "search_r1.rollout.backends",
    "Generator": "search_r1.rollout.backends",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'search_r1.rollout' has no attribute {name!r}")
