"""Retry pacing shared by the HTTP clients (retriever client, web search, OpenAI-compatible backend).

Exponential backoff with jitter: many clients that failed together must not retry in lockstep.
"""
from __future__ import annotations

import random


def backoff_delay(attempt: int, base: float, jitter: tuple[float, float] = (1.0, 1.5)) -> float:
    """Seconds to sleep before retry `attempt` (1-based): `base * 2**(attempt - 1) * U(jitter)`.

    attempt 1 -> base * [1, 1.5), attempt 2 -> 2 base * [1, 1.5), ...; base 0 disables the wait.
    """
    if attempt < 1:
        raise ValueError(f"attempt counts retries from 1, got {attempt}")
    return base * 2 ** (attempt - 1) * random.uniform(*jitter)
