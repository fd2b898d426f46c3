"""Budgets of one agent run (steps, tool calls, generated tokens, wall time) and the trace of events.

`BudgetMeter` counts what a run used (resuming from saved counts) and records each budget hit once
per phase, with what the agent did about it, both in `hits` and as a "budget" event of the `Trace`.
`Trace` is the run's event log (saved with the run) and, for single questions, its live console view.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

BUDGETS = ("steps", "tool_calls", "tokens", "seconds")


@dataclass(frozen=True)
class Budgets:
    """Limits of one question's run. steps: model turns of the main loop (the tool-call agent's turns,
    the planner's actions); tool_calls: searches and page reads; tokens: generated tokens over every
    model call of the run; seconds: wall time."""

    max_steps: int = 10
    max_tool_calls: int = 5
    max_tokens: int = 8192
    max_seconds: float = 600.0

    def __post_init__(self):
        for name in ("max_steps", "max_tool_calls", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not isinstance(self.max_seconds, (int, float)) or self.max_seconds <= 0:
            raise ValueError(f"--max-seconds must be > 0, got {self.max_seconds!r}")


class Trace:
    """Events of a run: dicts with `t` (seconds since the run began), `phase`, `kind`, `msg` (one
    readable line) and structured fields. `console(line)` (e.g. print) shows each event live."""

    def __init__(self, events: list[dict] | None = None, console: Callable[[str], None] | None = None,
                 t_offset: float = 0.0):
        self.events = list(events or [])
        self.console = console
        self._t0 = time.monotonic() - t_offset

    def add(self, phase: str, kind: str, msg: str, **fields) -> dict:
        event = {"t": round(time.monotonic() - self._t0, 2), "phase": phase, "kind": kind, "msg": msg, **fields}
        self.events.append(event)
        if self.console is not None:
            self.console(f"[{event['t']:7.1f}s] {phase:<9} {kind:<9} {msg}")
        return event


class BudgetMeter:
    """What a run has used of its `Budgets`; `used` resumes the counts of a saved run."""

    def __init__(self, budgets: Budgets, trace: Trace, used: dict | None = None):
        used = dict(used or {})
        self.budgets, self.trace = budgets, trace
        self.steps = int(used.get("steps", 0))
        self.tool_calls = int(used.get("tool_calls", 0))
        self.tokens = int(used.get("tokens", 0))
        self.hits: list[dict] = list(used.get("hits", []))
        self._seconds_before = float(used.get("seconds", 0.0))
        self._t0 = time.monotonic()

    @property
    def seconds(self) -> float:
        return self._seconds_before + time.monotonic() - self._t0

    def limit(self, name: str):
        return asdict(self.budgets)[f"max_{name}"]

    def used(self, name: str):
        return getattr(self, name)

    def spent(self, name: str) -> bool:
        if name not in BUDGETS:
            raise ValueError(f"unknown budget {name!r}; allowed values: {list(BUDGETS)}")
        return self.used(name) >= self.limit(name)

    def exhausted(self, names=("steps", "tokens", "seconds")) -> str | None:
        """The first of `names` whose budget is spent, or None."""
        return next((n for n in names if self.spent(n)), None)

    def tokens_left(self) -> int:
        return max(0, self.budgets.max_tokens - self.tokens)

    def add_call(self, completion_tokens: int, step: bool = True) -> None:
        self.tokens += int(completion_tokens)
        self.steps += int(step)

    def hit(self, name: str, phase: str, then: str) -> None:
        """Record that budget `name` stopped `phase` and what the agent does instead (`then`)."""
        if any(h["budget"] == name and h["phase"] == phase for h in self.hits):
            return
        used = self.used(name)
        record = {"budget": name, "limit": self.limit(name), "used": round(used, 1) if name == "seconds" else used,
                  "phase": phase, "then": then}
        self.hits.append(record)
        self.trace.add(phase, "budget", f"{name} budget reached ({record['used']}/{record['limit']}): {then}",
                       **{k: v for k, v in record.items() if k != "phase"})

    def state(self) -> dict:
        return {"steps": self.steps, "tool_calls": self.tool_calls, "tokens": self.tokens,
                "seconds": round(self.seconds, 2), "hits": list(self.hits)}
