"""Records of the single-process GRPO API: one sampled token (`TokenStep`) and one rollout (`Trajectory`).

Layout of a trajectory's sequence (absolute positions, what the policy is trained on):

    full_input_ids = prompt ids + response ids
    response ids   = generated tokens (policy, trained) interleaved with inserted
                     `<information>` / corrective-message tokens (environment, context only)

`generated_positions[k]` is the index in `full_input_ids` of the k-th generated token, and
`token_steps[k].position` is the same number, so `full_input_ids[generated_positions[k]] ==
token_steps[k].token_id` always holds for a trajectory produced by the trainer. `to_dict` /
`from_dict` round-trip through JSON (log files, sending trajectories between processes); a log-prob
the backend did not report (an API without logprobs) is NaN in memory and null in JSON.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenStep:
    """One generated token: its id, its text, log pi_old(token) at sampling time, its absolute position."""

    token_id: int
    token_text: str
    log_prob: float
    position: int

    def to_dict(self) -> dict:
        lp = self.log_prob if math.isfinite(self.log_prob) else None  # NaN is not JSON
        return {"token_id": self.token_id, "token_text": self.token_text, "log_prob": lp,
                "position": self.position}

    @classmethod
    def from_dict(cls, d: dict) -> "TokenStep":
        _check_keys(cls, d, "TokenStep")
        lp = d["log_prob"]
        return cls(int(d["token_id"]), str(d["token_text"]), float("nan") if lp is None else float(lp),
                   int(d["position"]))


@dataclass
class Trajectory:
    """One rollout of one query (see the module docstring for the sequence layout).

    query: the question as given; token_steps: generated tokens in generation order;
    generated_text: the decoded response, tags and inserted search results included (what the
    reward reads; never the prompt); reward / advantage: filled in by the trainer; final_answer: the
    last `<answer>` content, or the unfinished answer of a truncated response, or "" when none;
    num_searches: searches sent to the engine; truncated: a length limit ended the rollout.
    """

    query: str
    token_steps: list[TokenStep] = field(default_factory=list)
    generated_text: str = ""
    reward: float = 0.0
    final_answer: str = ""
    full_input_ids: list[int] = field(default_factory=list)
    generated_positions: list[int] = field(default_factory=list)
    advantage: float = 0.0
    num_searches: int = 0
    truncated: bool = False

    @property
    def response_text(self) -> str:
        """Alias of `generated_text`: the name `search_r1.rewards.compute_reward` reads."""
        return self.generated_text

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_steps)

    @property
    def old_log_probs(self) -> list[float]:
        return [s.log_prob for s in self.token_steps]

    def layout_problem(self) -> str | None:
        """Why the generated positions do not line up with the sequence, or None when they do."""
        n = len(self.full_input_ids)
        if len(self.generated_positions) != len(self.token_steps):
            return f"{len(self.generated_positions)} generated positions for {len(self.token_steps)} token steps"
        for p, step in zip(self.generated_positions, self.token_steps):
            if not 1 <= p < n:  # position 0 has no preceding token to predict it from
                return f"generated position {p} outside [1, {n})"
            if step.position != p or self.full_input_ids[p] != step.token_id:
                return (f"position {p}: full_input_ids holds {self.full_input_ids[p]}, token step "
                        f"{step.token_id} at {step.position}")
        return None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["token_steps"] = [s.to_dict() for s in self.token_steps]
        d["full_input_ids"] = list(self.full_input_ids)
        d["generated_positions"] = list(self.generated_positions)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        _check_keys(cls, d, "Trajectory", optional={"num_searches", "truncated", "reward", "advantage",
                                                     "final_answer"})
        kwargs = dict(d)
        kwargs["token_steps"] = [s if isinstance(s, TokenStep) else TokenStep.from_dict(s) for s in d["token_steps"]]
        kwargs["full_input_ids"] = [int(t) for t in d["full_input_ids"]]
        kwargs["generated_positions"] = [int(p) for p in d["generated_positions"]]
        return cls(**kwargs)


def _check_keys(cls, d: Any, name: str, optional: set[str] = frozenset()) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{name}.from_dict needs a dict, got {type(d).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    missing = sorted(fields - set(d) - set(optional))
    if unknown or missing:
        raise ValueError(f"{name}.from_dict: unknown keys {unknown}, missing keys {missing}; "
                         f"expected keys {sorted(fields)}")
