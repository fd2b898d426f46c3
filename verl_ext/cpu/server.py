"""A token-in/token-out rollout server over our `HFGenerator`, shaped like verl's vLLM server actor.

verl's agent loops call `await server.generate(request_id=..., prompt_ids=..., sampling_params=...)`
through `LLMServerClient` and expect a `TokenOutput`; verl's trainer and checkpoint manager call
`wake_up`, `sleep`, `clear_kv_cache`, `release_kv_cache`, `resume_kv_cache`, `abort_all_requests`,
`resume_generation`, `start_profile`, `stop_profile`, `set_global_steps` and
`wait_for_requests_to_drain` (the methods of `vLLMHttpServer` that `RolloutReplica` and
`vLLMReplica` reach). This class answers all of them on CPU.

Generation: the concurrent requests of an agent-loop worker arrive one trajectory at a time; the
server collects the requests that arrive within `batch_window_s` and runs each group with identical
sampling settings but for `max_tokens` as one `HFGenerator.generate` batch (stop strings exact,
log-probs of the sampled tokens), in a thread so the actor keeps accepting requests. The group runs
to its largest budget and each output is cut back to its own, which is what that request alone would
have produced from the same draws (a token never depends on later ones); without that, trajectories
whose budgets differed by a token (the agent loop asks for what is left of each response) ran one
request per batch. Weight loads wait for the running batch and block new ones (one lock).

Sampling semantics follow vLLM's server in verl (`vLLMHttpServer.generate`): `max_tokens` defaults to
`min(response_length, prompt_length + response_length - len(prompt))`, clamped to the room left in
`max_model_len`; `logprobs` truthy returns the log-prob of each sampled token; a stop string ends
the output at the token that completes it (the stop string is always included, i.e.
`include_stop_str_in_output=True`; asking for False is an error). Unsupported settings with
non-default values raise ValueError naming the key.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

# Sampling keys the server accepts at one value only (the behaviour HFGenerator implements).
_ONLY_AT = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "ignore_eos": False,
    "n": 1,
    "min_tokens": 0,
    "include_stop_str_in_output": True,
}
_PASSTHROUGH = {"skip_special_tokens", "spaces_between_special_tokens", "detokenize"}
# verl's logprobs_mode names -> HFGenerator's (vLLM: "raw" = before temperature/top-k/top-p).
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}


def default_max_tokens(prompt_len: int, prompt_length: int, response_length: int, max_model_len: int) -> int:
    """vLLM server's budget when the request names none: response_length, capped by the total
    prompt_length + response_length and by the model context; at least 1 (as vLLM clamps)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"Prompt length ({prompt_len}) leaves no room to generate within max_model_len "
                         f"({max_model_len}); raise rollout.max_model_len or shorten the prompt")
    budget = min(response_length, prompt_length + response_length - prompt_len)
    return max(1, min(budget, room))


def to_sampling_params(sampling_params: dict[str, Any], prompt_len: int, prompt_length: int,
                       response_length: int, max_model_len: int):
    """(search_r1 SamplingParams, want_logprobs) for one request's vLLM-style `sampling_params`."""
    from search_r1.rollout.backends import SamplingParams

    params = dict(sampling_params)
    max_tokens = params.pop("max_tokens", None)
    if max_tokens is None:
        max_tokens = params.pop("max_new_tokens", None)
    if max_tokens is None:
        max_tokens = default_max_tokens(prompt_len, prompt_length, response_length, max_model_len)
    max_tokens = max(1, min(int(max_tokens), max_model_len - prompt_len))
    want_logprobs = bool(params.pop("logprobs", False))
    stop = params.pop("stop", None) or ()
    if isinstance(stop, str):
        stop = (stop,)
    top_k = params.pop("top_k", -1)
    top_k = -1 if top_k in (None, 0) else int(top_k)
    out = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(params.pop("temperature", 1.0)),
        top_p=float(params.pop("top_p", 1.0)),
        top_k=top_k,
        stop=tuple(stop),
        seed=params.pop("seed", None),
    )
    for key, accepted in _ONLY_AT.items():
        if key in params and params.pop(key) not in (accepted, None):
            raise ValueError(f"HF rollout server: sampling_params[{key!r}] must be {accepted!r} (the only "
                             "value it implements); use rollout.name=vllm for other values")
    for key in _PASSTHROUGH:
        params.pop(key, None)
    if params:
        raise ValueError(f"HF rollout server: unsupported sampling_params keys {sorted(params)}; supported: "
                         f"max_tokens, temperature, top_p, top_k, stop, seed, logprobs, {sorted(_ONLY_AT)}")
    return out, want_logprobs


def within_budget(out, max_tokens: int):
    """`out` (a GenOutput of a batch run to a larger budget) cut to `max_tokens`: the same tokens and
    log-probs a run with that budget samples, finish_reason "length" when the cut removed anything."""
    if len(out.token_ids) <= max_tokens:
        return out
    return dataclasses.replace(out, token_ids=list(out.token_ids[:max_tokens]),
                               logprobs=list(out.logprobs[:max_tokens]) if out.logprobs is not None else None,
                               finish_reason="length")


@dataclass
class _Request:
    prompt_ids: list[int]
    params: Any
    want_logprobs: bool
    future: asyncio.Future = field(repr=False)


class HFRolloutServer:
    """Ray actor (async): verl's token-in/token-out server contract over `HFGenerator` on CPU.

    Args: `config` (verl RolloutConfig or its DictConfig), `model_config` (verl HFModelConfig),
    `replica_rank`, `servers_per_node` (this node's servers, which generate at once: the torch threads
    are `compute_threads(servers_per_node)`). Loads the model from `model_config.local_path` in float32.
    """

    def __init__(self, config, model_config, replica_rank: int = 0, batch_window_s: float = 0.02,
                 max_batch: int = 64, servers_per_node: int = 1):
        import torch
        from transformers import AutoModelForCausalLM

        from search_r1.models import load_tokenizer
        from search_r1.rollout.backends import HFGenerator
        from verl.utils.config import omega_conf_to_dataclass
        from verl_ext.cpu.platform import compute_threads

        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)
        self.replica_rank = replica_rank
        mode = self.config.logprobs_mode or "raw_logprobs"
        if mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout.logprobs_mode={mode!r}: the HF server implements {sorted(LOGPROBS_MODES)}")
        # The node's servers generate at once while the training workers wait (compute_threads)
        torch.set_num_threads(compute_threads(servers_per_node))
        path = self.model_config.local_path
        self.tokenizer = load_tokenizer(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        self.model.eval()
        self.generator = HFGenerator(self.model, self.tokenizer, logprobs_mode=LOGPROBS_MODES[mode])
        self.prompt_length = int(self.config.prompt_length)
        self.response_length = int(self.config.response_length)
        self.max_model_len = int(self.config.max_model_len or (self.prompt_length + self.response_length))
        self.batch_window_s = batch_window_s
        self.max_batch = max_batch
        self.global_steps: Optional[int] = None
        self.awake = True
        self.weight_loads = 0
        self._pending: list[_Request] = []
        self._lock = asyncio.Lock()
        self._flusher: Optional[asyncio.Task] = None
        self.stats = {"requests": 0, "batches": 0, "generated_tokens": 0, "seconds": 0.0}

    # -- generation -------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError("HF rollout server serves text only; got image/video/audio data")
        prompt_ids = [int(t) for t in prompt_ids]
        params, want_logprobs = to_sampling_params(sampling_params, len(prompt_ids), self.prompt_length,
                                                   self.response_length, self.max_model_len)
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(prompt_ids, params, want_logprobs, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_after_window())
        out = await future
        return TokenOutput(
            token_ids=out.token_ids,
            log_probs=list(out.logprobs) if want_logprobs else None,
            stop_reason="completed",  # vLLM maps both "stop" and "length" to "completed"
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps, "finish_reason": out.finish_reason},
        )

    async def _flush_after_window(self) -> None:
        await asyncio.sleep(self.batch_window_s)
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            groups: dict[Any, list[_Request]] = {}
            for req in batch:
                groups.setdefault(dataclasses.replace(req.params, max_tokens=1), []).append(req)
            for params, reqs in groups.items():
                longest = max(r.params.max_tokens for r in reqs)
                await self._run_group(dataclasses.replace(params, max_tokens=longest), reqs)

    async def _run_group(self, params, reqs: list[_Request]) -> None:
        start = time.perf_counter()
        try:
            async with self._lock:
                outs = await asyncio.to_thread(self.generator.generate, [r.prompt_ids for r in reqs], params)
            outs = [within_budget(out, r.params.max_tokens) for r, out in zip(reqs, outs)]
        except Exception as exc:  # hand the error to every waiting request instead of losing it
            for r in reqs:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        for r, out in zip(reqs, outs):
            if not r.future.done():
                r.future.set_result(out)
        self.stats["requests"] += len(reqs)
        self.stats["batches"] += 1
        self.stats["generated_tokens"] += sum(len(o.token_ids) for o in outs)
        self.stats["seconds"] += time.perf_counter() - start

    # -- weights ----------------------------------------------------------------------------------

    async def load_weights(self, named_tensors: dict, global_steps: Optional[int] = None) -> int:
        """Copy the trainer's weights (HF parameter names -> full tensors) into the model.

        Every name must be a parameter or buffer of the model (else ValueError naming it); returns the
        number of tensors loaded.
        """
        import torch

        state = self.model.state_dict()
        unknown = sorted(set(named_tensors) - set(state))
        if unknown:
            raise ValueError(f"HF rollout server: weights {unknown[:5]} are not in the model "
                             f"{type(self.model).__name__} (does actor_rollout_ref.model.path match?)")
        async with self._lock:
            with torch.no_grad():
                for name, tensor in named_tensors.items():
                    target = state[name]
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(f"HF rollout server: weight {name} has shape {tuple(tensor.shape)}, "
                                         f"the model expects {tuple(target.shape)}")
                    target.copy_(tensor.to(target.dtype))
        self.weight_loads += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return len(named_tensors)

    async def get_weight_checksum(self) -> float:
        """Sum of all parameters (a cheap fingerprint tests use to see a weight sync arrive)."""
        import torch

        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model.parameters()))

    # -- lifecycle calls verl makes (CPU meaning: state flags; no device memory to free) ----------

    async def wake_up(self, tags: Optional[list[str]] = None):
        self.awake = True

    async def sleep(self):
        self.awake = False

    async def clear_kv_cache(self):
        return None  # HFGenerator builds a fresh KV cache per batch

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def wait_for_requests_to_drain(self):
        while self._pending or self._lock.locked():
            await asyncio.sleep(0.01)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        # Batches are short and not interruptible; sync training never aborts mid-rollout.
        await self.wait_for_requests_to_drain()
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def get_stats(self) -> dict:
        return {**self.stats, "weight_loads": self.weight_loads, "global_steps": self.global_steps,
                "awake": self.awake}
