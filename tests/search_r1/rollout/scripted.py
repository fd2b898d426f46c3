"""Test doubles for the rollout: a real tokenizer and a scripted policy.

`ScriptedGenerator` plays canned turns per trajectory with the exact contract of a real backend
(`Generator.generate(prompts, SamplingParams) -> list[GenOutput]`): it tokenizes each canned turn
with the real tokenizer, stops at the first stop string like vLLM / HF do (the token that completes
the stop string is the last one returned), honours `max_tokens`, and reports per-token logprobs.
Trajectories are recognised by their prompt ids, so inactive rows simply never show up in a call.
"""
from __future__ import annotations

import functools

from search_r1.rollout.backends import GenOutput, SamplingParams


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """SmolLM2's tokenizer (from the bundled GGUF, converted once and cached by search_r1.models)."""
    from search_r1.models import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def fake_logprob(token_id: int, position: int) -> float:
    """A deterministic, recognisable logprob so tests can check alignment."""
    return -((token_id % 97) + position + 1) / 1000.0


class ScriptedGenerator:
    """Canned outputs: `scripts[i]` is the list of turn texts of the trajectory whose prompt is
    `prompts[i]`. A trajectory asked for more turns than scripted gets `fallback` text."""

    def __init__(self, tokenizer, prompts: list[list[int]], scripts: list[list[str]],
                 fallback: str = "I have nothing more to say.", honour_stop: bool = True):
        if len(prompts) != len(scripts):
            raise ValueError("one script per prompt")
        self.tokenizer = tokenizer
        self.prompts = [list(p) for p in prompts]
        self.scripts = scripts
        self.fallback = fallback
        self.honour_stop = honour_stop
        self.served = [0] * len(prompts)
        self.calls: list[dict] = []  # one record per generate call: batch rows, params

    def _row_of(self, context: list[int]) -> int:
        # Longest matching prompt wins, so prompts that prefix each other are told apart.
        best = -1
        for i, p in enumerate(self.prompts):
            if context[: len(p)] == p and (best < 0 or len(p) > len(self.prompts[best])):
                best = i
        if best < 0:
            raise AssertionError("generate() got a context that starts with no known prompt")
        return best

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        rows = [self._row_of(c) for c in prompts]
        self.calls.append({"rows": rows, "params": params})
        outs = []
        for row in rows:
            turn = self.served[row]
            self.served[row] += 1
            script = self.scripts[row]
            text = script[turn] if turn < len(script) else self.fallback
            outs.append(self._sample(text, params))
        return outs

    def _sample(self, text: str, params: SamplingParams) -> GenOutput:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        finish = "length"
        if self.honour_stop and params.stop:
            # Emit token by token; stop after the token whose text completes a stop string.
            for k in range(1, len(ids) + 1):
                if any(s in self.tokenizer.decode(ids[:k]) for s in params.stop):
                    ids, finish = ids[:k], "stop"
                    break
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if eos in ids:
            ids, finish = ids[: ids.index(eos) + 1], "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        elif finish == "length" and len(ids) < params.max_tokens:
            finish = "stop"  # the canned text ran out: treat as EOS
        return GenOutput(token_ids=ids, logprobs=[fake_logprob(t, i) for i, t in enumerate(ids)],
                         finish_reason=finish)
