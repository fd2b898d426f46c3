"""Generator backends: the one interface the rollout uses to sample from a policy.

Contract: `Generator.generate(prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]`.
Every output ends at the first stop string (inclusive): any overshoot is trimmed, so the tokens the
rollout keeps are exactly the sampled ones up to and including the stop string's final token.
"""
from __future__ import annotations

import inspect
import json
import logging
import random
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from search_r1.rollout.tensor_helper import pad_ragged, position_ids_from_mask, shared_prompt_rows
from search_r1.search.retry import backoff_delay
from search_r1.transport import check_key_transport


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


# ================================================================================================
# Implementations. Shared helpers first: sampling math and stop-string handling.

logger = logging.getLogger(__name__)

LOGPROBS_MODES = ("raw", "processed")


class GenerationError(RuntimeError):
    """A generation backend failed after its retries (server down, 5xx, malformed response)."""


class ContextLengthError(GenerationError):
    """The server refused the request because prompt + max tokens exceed the model's context window
    (HTTP 400 from vLLM "This model's maximum context length is ...", OpenAI `context_length_exceeded`,
    llama.cpp "exceeds the available context size"). Retrying the same request cannot succeed."""


# How servers word a context overflow in their 400 body (vLLM, OpenAI, llama.cpp / SGLang).
_CONTEXT_OVERFLOW_RE = re.compile(r"maximum context length|context_length_exceeded|context size|context window|"
                                  r"cannot be greater than max_model_len", re.IGNORECASE)


def drop_empty(body: dict) -> dict:
    """`body` without the fields that are None or an empty list / dict: a request states only what it
    sets (OpenAI's API rejects `"stop": []` with 400; leaving a field out means the server's default)."""
    return {k: v for k, v in body.items() if v is not None and not (isinstance(v, (list, dict)) and not v)}


def filtered_logits(logits, temperature: float, top_p: float = 1.0, top_k: int = -1):
    """Logits of the distribution actually sampled from: `logits / T`, then top-k, then top-p.

    logits: (n, V) float. Returns (n, V) float32 with removed tokens at -inf. temperature must be > 0.
    top-k keeps the k largest (ties at the k-th value are kept); top-p keeps the smallest prefix of
    the descending-probability order whose mass reaches top_p (the first token is always kept).
    Order and semantics follow vLLM's sampler.
    """
    z = logits.float() / temperature                                   # (n, V)
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]              # (n, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)       # (n, V)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = probs.cumsum(-1) - probs                         # (n, V) mass of better tokens
        sorted_z = sorted_z.masked_fill(mass_before >= top_p, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    return z


def sample_from_logits(z, uniforms):
    """Inverse-CDF sampling: one token per row of (n, V) logits `z` given (n,) uniforms in (0, 1].

    Picks the first token whose cumulative probability reaches u * total, in float64 so a 50k-token
    vocabulary sums without drift. Zero-probability tokens are never picked because u > 0.
    Using one externally drawn uniform per row makes each row's draw independent of the batch.
    """
    cum = torch.softmax(z.float(), dim=-1).double().cumsum(-1)        # (n, V)
    target = uniforms.double().to(cum.device) * cum[:, -1]             # (n,)
    idx = torch.searchsorted(cum, target[:, None])                    # (n, 1)
    return idx.squeeze(-1).clamp_(max=z.shape[-1] - 1)


def find_stop(token_ids: list[int], tokenizer, stop: tuple[str, ...] | list[str], decode=None) -> int | None:
    """Number of tokens to keep so the output ends at the token completing the first stop string.

    For outputs that ran past a stop string (backends that cannot stop on line): the smallest k
    with a stop string inside decode(token_ids[:k]), or None; binary search, log2(n) decodes.
    `decode(ids) -> text` replaces `tokenizer.decode(ids, skip_special_tokens=False)` (the rollout
    passes its exact byte-table decoder). The one stop-string search of the rollout and backends.
    """
    if decode is None:
        def decode(ids):
            return tokenizer.decode(ids, skip_special_tokens=False)
    if not stop or not token_ids:
        return None
    text = decode(token_ids)
    if not any(s in text for s in stop):
        return None
    lo, hi = 1, len(token_ids)  # "contains a stop string" is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(token_ids[:mid]) for s in stop):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


@dataclass
class _SavedKV:
    """One row's KV cache kept from the previous generate call, per layer (keys, values) of shape
    (heads, length, head_dim). It covers the prompt and every sampled token but the last (never
    fed); those tokens are its key in `HFGenerator._saved`."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[1]


def _check_prompts(prompts) -> None:
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")


def _row_rng(base_seed: int, index: int) -> random.Random:
    # String seeds go through sha512 in CPython, so streams are stable across processes.
    return random.Random(f"search-r1:{base_seed}:{index}")


# ================================================================================================
# HFGenerator: transformers model, own decoding loop


class HFGenerator:
    """Batched generation with a transformers causal LM on CPU/GPU, exact stop strings.

    The decoding loop is ours (one forward per step over a KV cache) rather than `model.generate`, so
    that each row stops on the exact token that completes a stop string or is EOS, and finished rows
    leave the batch (their KV cache rows are dropped) instead of sampling to the budget.

    - Prompts are left-padded into batches of `batch_size` (None = all at once), longest first to
      limit padding; outputs come back in input order. Identical prompts in one batch (a GRPO
      group) are prefilled once and their KV cache rows repeated.
    - Multi-turn reuse (`reuse_kv`, default on): each call keeps its rows' KV caches until the next
      call. A prompt that extends one of them (a rollout's next round: context + sampled tokens +
      observation) prefills only the new tokens on top of that cache. A cache is used only while the
      model's weights are the ones that computed it (every parameter's storage and version counter
      are compared, so an optimizer step or a weight sync in between drops it), and only for an
      exact token prefix. Memory: the previous call's rows (~46 KB per token for SmolLM2-135M fp32).
    - Sampling: temperature 0 is greedy (argmax); otherwise temperature, top-k, top-p as in vLLM.
      Each row draws from its own RNG seeded by (params.seed, row index), so a row's sample does
      not depend on batch size, batch order or the other rows; identical prompts in one call (a GRPO
      group) still get different samples. params.seed None draws the base seed from torch's RNG.
    - logprobs_mode "raw" (default, vLLM's default too): log-softmax of the unmodified logits, i.e.
      log pi(token) at temperature 1 without top-k/top-p. It equals a teacher-forced forward pass
      over the same tokens, which is what a trainer recomputes as old/ref log-probs.
      "processed": log-probs under the distribution actually sampled from (logits / T, filtered);
      with greedy decoding it is the raw value.
    - EOS (generation_config and tokenizer EOS ids) ends a row and is kept in token_ids.
    - Stop strings are checked every step on the decoded tail of each active row (the last
      max-stop-bytes + 1 tokens, one batched decode per step), so the kept tokens end exactly at the
      token that completes the stop string; nothing is ever generated past it.

    Args: `eos_token_ids` overrides the EOS set ([] = never stop on EOS, for benchmarks);
    `sort_by_length=False` keeps input order inside batches. `stats` accumulates calls, prompts,
    prefilled prompts (distinct ones per batch), prompt tokens taken from a kept cache
    (`reused_tokens`), generated tokens, forward passes and seconds. The
    model's train/eval mode is restored after each call, so a trainer can share the module.
    """

    def __init__(self, model, tokenizer, batch_size: int | None = None,
                 eos_token_ids: list[int] | None = None, logprobs_mode: str = "raw",
                 sort_by_length: bool = True, reuse_kv: bool = True):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"HFGenerator batch_size must be None or >= 1, got {batch_size}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"HFGenerator logprobs_mode={logprobs_mode!r}; choose one of {LOGPROBS_MODES}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.logprobs_mode = logprobs_mode
        self.sort_by_length = sort_by_length
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else _eos_token_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids, default=0)
        self.token_ids_exact = True  # ids are the sampled ones, never re-tokenized
        self.stats = {"calls": 0, "prompts": 0, "prefilled_prompts": 0, "reused_tokens": 0, "generated_tokens": 0,
                      "forward_passes": 0, "seconds": 0.0}
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.reuse_kv = reuse_kv
        self._saved: dict[tuple[int, ...], _SavedKV] = {}  # the previous call's rows, by their tokens
        self._saved_weights: tuple | None = None  # _weights_key() when they were computed

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        _check_prompts(prompts)
        if not prompts:
            return []
        start = time.perf_counter()
        order = list(range(len(prompts)))
        if self.sort_by_length:
            order.sort(key=lambda i: -len(prompts[i]))
        size = self.batch_size or len(prompts)
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        results: list[GenOutput | None] = [None] * len(prompts)
        previous = self._take_saved()
        # The same module may be trained between calls (the CPU trainer shares it): switch to eval
        # for sampling and restore the caller's mode afterwards.
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for first in range(0, len(order), size):
                    rows = order[first:first + size]
                    rngs = [_row_rng(base_seed, i) for i in rows]
                    outs = self._generate_batch([prompts[i] for i in rows], params, rngs, previous)
                    for i, out in zip(rows, outs):
                        results[i] = out
        finally:
            self.model.train(was_training)
        del previous
        if self.reuse_kv:
            self._saved_weights = self._weights_key()
        self.stats["calls"] += 1
        self.stats["prompts"] += len(prompts)
        self.stats["generated_tokens"] += sum(len(r.token_ids) for r in results)
        self.stats["seconds"] += time.perf_counter() - start
        return results

    def _weights_key(self) -> tuple:
        # In-place updates (optimizer steps, load_state_dict, weight syncs) bump a tensor's version
        # counter; a re-assigned .data changes its storage.
        return tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def _take_saved(self) -> dict[tuple[int, ...], _SavedKV]:
        """The previous call's kept caches if the weights are unchanged since, else {}; none are kept after."""
        saved, self._saved = self._saved, {}
        if not saved or self._weights_key() != self._saved_weights:
            return {}
        return saved

    @staticmethod
    def _longest_saved_prefix(prompt: list[int], previous: dict, lengths: list[int]) -> _SavedKV | None:
        for n in lengths:  # longest first
            if n < len(prompt) and (hit := previous.get(tuple(prompt[:n]))) is not None:
                return hit
        return None

    def _keep(self, cache, attention_mask, rows: list[tuple[int, list[int]]]) -> None:
        """Save the KV cache of finished batch rows: rows = [(batch index, tokens it covers)]."""
        for j, tokens in rows:
            live = attention_mask[j].bool()
            # Boolean indexing copies, so the kept tensors do not pin the batch's whole cache.
            layers = [(layer.keys[j][:, live], layer.values[j][:, live]) for layer in cache.layers]
            if layers and layers[0][0].shape[1] == len(tokens):  # else a layout this code does not know
                self._saved[tuple(tokens)] = _SavedKV(layers)

    def _prefill_on_saved(self, cache, prompts: list[list[int]], hits: list[_SavedKV | None], device):
        """Prefill the rows' new tokens on top of their saved caches (rows without one: the whole prompt).

        Layout, per row: its saved cache right-aligned in the first C columns (C = the longest
        saved), then its new tokens right-aligned in the next S columns (S = the longest suffix);
        the mask is 0 on the gaps, positions continue from the saved length. Returns (logits (n, V),
        attention_mask (n, C + S), next positions (n,)).
        """
        n = len(prompts)
        cached = [h.length if h is not None else 0 for h in hits]
        C = max(cached)
        input_ids, new_mask = map(torch.from_numpy, pad_ragged([p[c:] for p, c in zip(prompts, cached)],
                                                                pad_value=self.pad_token_id, left=True))
        old_mask = torch.from_numpy(pad_ragged([[1] * c for c in cached], width=C, left=True)[1])
        attention_mask = torch.cat([old_mask, new_mask], dim=1)          # (n, C + S)
        position_ids = position_ids_from_mask(attention_mask)[:, C:]     # continues from each saved length
        ref = next(h for h in hits if h is not None).layers
        for layer, (k0, v0) in enumerate(ref):
            keys = k0.new_zeros((n, k0.shape[0], C, k0.shape[2]))
            values = v0.new_zeros((n, v0.shape[0], C, v0.shape[2]))
            for r, (h, c) in enumerate(zip(hits, cached)):
                if h is not None:
                    keys[r, :, C - c:], values[r, :, C - c:] = h.layers[layer]
            cache.update(keys, values, layer)
        self.stats["reused_tokens"] += sum(cached)
        self.stats["prefilled_prompts"] += n
        attention_mask, position_ids = attention_mask.to(device), position_ids.to(device)
        logits = self._forward(cache, input_ids=input_ids.to(device), attention_mask=attention_mask,
                               position_ids=position_ids)
        return logits, attention_mask, position_ids[:, -1] + 1

    def _prefill(self, cache, prompts: list[list[int]], device):
        """Prefill left-padded prompts; returns (logits (n, V), attention_mask (n, width), next positions (n,))."""
        n = len(prompts)
        input_ids, attention_mask = map(torch.from_numpy, pad_ragged(prompts, pad_value=self.pad_token_id, left=True))
        position_ids = position_ids_from_mask(attention_mask)            # (n, width)
        input_ids, attention_mask, position_ids = (t.to(device) for t in (input_ids, attention_mask, position_ids))
        # A GRPO group asks for several samples of one prompt: prefill each distinct prompt once and
        # repeat its cache rows (the prefill is most of a short rollout's compute on a CPU).
        first, inverse = shared_prompt_rows(input_ids, attention_mask, position_ids)
        if len(first) < n:
            logits = self._forward(cache, input_ids=input_ids[first], attention_mask=attention_mask[first],
                                   position_ids=position_ids[first])[inverse]
            cache.batch_select_indices(inverse)
            self.stats["prefilled_prompts"] += len(first)
        else:
            self.stats["prefilled_prompts"] += n
            logits = self._forward(cache, input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids)
        return logits, attention_mask, position_ids[:, -1] + 1

    def _forward(self, cache, **inputs):
        extra = {"logits_to_keep": 1} if self._keeps_logits else {}
        out = self.model(**inputs, past_key_values=cache, use_cache=True, **extra)
        self.stats["forward_passes"] += 1
        return out.logits[:, -1, :]                                      # (n, V)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        rngs: list[random.Random], previous: dict | None = None) -> list[GenOutput]:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        device = next(self.model.parameters()).device
        n = len(prompts)
        cache = DynamicCache(config=self.model.config)
        reusable = self.reuse_kv and all(type(layer) is DynamicLayer for layer in cache.layers)
        lengths = sorted({len(t) for t in previous}, reverse=True) if previous and reusable else []
        hits = [self._longest_saved_prefix(p, previous, lengths) for p in prompts] if lengths else [None] * n
        if any(h is not None for h in hits):
            logits, attention_mask, next_pos = self._prefill_on_saved(cache, prompts, hits, device)
        else:
            logits, attention_mask, next_pos = self._prefill(cache, prompts, device)

        tokens_out: list[list[int]] = [[] for _ in range(n)]
        logprobs_out: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        active = list(range(n))                                          # batch row -> prompt row
        window = max((len(s.encode("utf-8")) for s in params.stop), default=0) + 1
        for _ in range(params.max_tokens):
            tokens, logps = self._sample(logits, params, [rngs[r] for r in active])
            tok_list, lp_list = tokens.tolist(), logps.tolist()
            for j, r in enumerate(active):
                tokens_out[r].append(tok_list[j])
                logprobs_out[r].append(lp_list[j])
            done = self._finished_rows(active, tok_list, tokens_out, params.stop, window, finish)
            spent = len(tokens_out[active[0]]) >= params.max_tokens  # all active rows have the same length
            if reusable:  # a finished row's cache covers its prompt and all but its last token
                self._keep(cache, attention_mask, [(j, prompts[r] + tokens_out[r][:-1]) for j, r in enumerate(active)
                                                   if spent or r in done])
            if spent:
                break
            keep = [j for j, r in enumerate(active) if r not in done]
            if not keep:
                break
            if len(keep) < len(active):                                  # drop finished rows
                idx = torch.as_tensor(keep, device=device)
                cache.batch_select_indices(idx)
                attention_mask, next_pos, tokens = attention_mask[idx], next_pos[idx], tokens[idx]
                active = [active[j] for j in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            logits = self._forward(cache, input_ids=tokens[:, None].to(device), attention_mask=attention_mask,
                                   position_ids=next_pos[:, None])
            next_pos = next_pos + 1
        return [GenOutput(token_ids=tokens_out[r], logprobs=logprobs_out[r], finish_reason=finish[r])
                for r in range(n)]

    def _sample(self, logits, params: SamplingParams, rngs: list[random.Random]):
        """(tokens (n,), logprobs (n,)) for one step; see the class docstring for the logprob modes."""
        raw = torch.log_softmax(logits.float(), dim=-1)                  # (n, V)
        if params.temperature == 0:
            tokens = torch.argmax(logits, dim=-1)
            chosen = raw
        else:
            z = filtered_logits(logits, params.temperature, params.top_p, params.top_k)
            # 1 - random() lies in (0, 1]: u = 0 could select a zero-probability first token.
            uniforms = torch.tensor([1.0 - g.random() for g in rngs], dtype=torch.float64)
            tokens = sample_from_logits(z, uniforms)
            chosen = raw if self.logprobs_mode == "raw" else torch.log_softmax(z, dim=-1)
        logps = chosen.gather(-1, tokens[:, None]).squeeze(-1)           # (n,)
        return tokens, logps

    def _finished_rows(self, active, tok_list, tokens_out, stop, window, finish) -> set[int]:
        """Rows (prompt indices) that ended this step by EOS or by completing a stop string."""
        done = {r for j, r in enumerate(active) if tok_list[j] in self.eos_token_ids}
        candidates = [r for r in active if r not in done]
        if stop and candidates:
            tails = self.tokenizer.batch_decode([tokens_out[r][-window:] for r in candidates],
                                                skip_special_tokens=False)
            done.update(r for r, text in zip(candidates, tails) if any(s in text for s in stop))
        for r in done:
            finish[r] = "stop"
        return done


# ================================================================================================
# OpenAIGenerator: an OpenAI-compatible /v1/completions server (vLLM, SGLang, llama.cpp server)

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# How a user opts in to sending a key over plain http to a non-loopback server, per entry point.
INSECURE_HTTP_OPT_IN = ("allow_insecure_http=True (SearchR1Config(openai_allow_insecure_http=True); "
                        "python -m search_r1.evaluation --allow-insecure-http)")
_TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids spelling of logprobs.tokens


class OpenAIGenerator:
    """Generator over `POST {base_url}/v1/completions` with token-id prompts.

    Request: `prompt` as token ids (a list of id lists for a batch), `max_tokens`, `temperature`,
    `top_p`, `stop`, `logprobs=1`, plus vLLM extensions `top_k`, `seed`, `return_token_ids`,
    `return_tokens_as_token_ids`, `include_stop_str_in_output`, `skip_special_tokens=False`
    (servers that do not know an extension ignore it).

    Response token ids, best source first: `choices[i].token_ids` (vLLM >= 0.10.2 with
    return_token_ids); `logprobs.tokens` spelled "token_id:N" (return_tokens_as_token_ids); otherwise
    the tokenizer re-encodes `text`, which may not be the sampled ids: a warning is logged once and
    `token_ids_exact` turns False. `logprobs_available` turns False when the server sends no
    logprobs (GenOutput.logprobs is then NaN). If a tokenizer is given, outputs that run past a stop
    string (servers without stop support) are trimmed to the token that completes it.

    Seeds: vLLM seeds each prompt of a batched request with the same `seed`, which would make the
    samples of identical prompts (a GRPO group) identical. With `params.seed` set, each prompt is
    therefore sent as its own request with seed + row index (concurrently, `max_concurrency`).
    Without a seed, prompts go in batched requests of up to `max_prompts_per_request`.

    Transient failures (connection errors, timeouts, HTTP 408/429/5xx) are retried `retries` times
    with exponential backoff; then GenerationError. Other 4xx fail at once with the server's message.

    With an `api_key`, a plain-http `base_url` must be a loopback host (search_r1.transport) unless
    `allow_insecure_http=True`: the key would cross the network in clear.
    """

    def __init__(self, base_url: str, model: str, tokenizer=None, api_key: str | None = None,
                 timeout: float = 300.0, retries: int = 3, backoff: float = 0.5,
                 max_prompts_per_request: int | None = None, max_concurrency: int = 16,
                 extra_body: dict | None = None, allow_insecure_http: bool = False):
        import httpx

        if retries < 0:
            raise ValueError(f"OpenAIGenerator retries must be >= 0, got {retries}")
        if max_prompts_per_request is not None and max_prompts_per_request < 1:
            raise ValueError(f"OpenAIGenerator max_prompts_per_request must be None or >= 1, "
                             f"got {max_prompts_per_request}")
        self.url = _completions_url(base_url)
        if api_key:
            check_key_transport(self.url, opt_in=INSECURE_HTTP_OPT_IN, allow_insecure_http=allow_insecure_http)
        self.model = model
        self.tokenizer = tokenizer
        self.retries, self.backoff = retries, backoff
        self.max_prompts_per_request = max_prompts_per_request
        self.max_concurrency = max(1, max_concurrency)
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers)
        self.token_ids_exact = True
        self.logprobs_available = True
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests ---------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        _check_prompts(prompts)
        if not prompts:
            return []
        prompts = [[int(t) for t in p] for p in prompts]
        if params.seed is not None:
            jobs = [([i], params.seed + i) for i in range(len(prompts))]
        else:
            size = self.max_prompts_per_request or len(prompts)
            jobs = [(list(range(s, min(s + size, len(prompts)))), None) for s in range(0, len(prompts), size)]

        def run(job):
            rows, seed = job
            return rows, self._complete([prompts[i] for i in rows], params, seed)

        results: list[GenOutput | None] = [None] * len(prompts)
        if len(jobs) == 1:
            finished = [run(jobs[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(jobs))) as pool:
                finished = list(pool.map(run, jobs))
        for rows, outs in finished:
            for i, out in zip(rows, outs):
                results[i] = out
        return results

    def payload(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> dict:
        """The JSON body for one request (public so tests and users can see exactly what is sent)."""
        body = {
            "model": self.model,
            "prompt": prompts[0] if len(prompts) == 1 else prompts,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": 1,
            "stream": False,
            "logprobs": 1,
            "stop": list(params.stop),
            # vLLM extensions: exact output ids, stop string kept in the text, specials kept.
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if seed is not None:
            body["seed"] = seed
        body.update(self.extra_body)
        return drop_empty(body)

    def _complete(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> list[GenOutput]:
        response = self._post(self.payload(prompts, params, seed))
        choices = response.get("choices") if isinstance(response, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise GenerationError(f"{self.url} returned {0 if not isinstance(choices, list) else len(choices)} "
                                  f"choices for {len(prompts)} prompts: {json.dumps(response)[:300]}")
        choices = sorted(choices, key=lambda c: c.get("index", 0))
        return [self._parse_choice(c, params) for c in choices]

    def _post(self, body: dict) -> dict:
        return post_json(self._client, self.url, body, retries=self.retries, backoff=self.backoff,
                         rejected=lambda error: (f"{self.url} rejected the request ({error}); check the model "
                                                 f"name {self.model!r} and the sampling parameters"),
                         hint="Is the server running (e.g. `vllm serve MODEL --port PORT`)?")

    # -- responses --------------------------------------------------------------------------------

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning(message)

    def _parse_choice(self, choice: dict, params: SamplingParams) -> GenOutput:
        text = choice.get("text") or ""
        logprobs = choice.get("logprobs") or {}
        server_tokens = logprobs.get("tokens") or []
        token_logprobs = logprobs.get("token_logprobs")
        finish = choice.get("finish_reason") or "length"

        if isinstance(choice.get("token_ids"), list):
            ids = [int(t) for t in choice["token_ids"]]
        elif server_tokens and all(isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) for t in server_tokens):
            ids = [int(t[len(_TOKEN_ID_PREFIX):]) for t in server_tokens]
        else:
            ids = self._retokenize(choice, text, params)

        if token_logprobs is None:
            if self.logprobs_available:
                self.logprobs_available = False
                self._warn_once("logprobs", f"{self.url} returned no logprobs; GenOutput.logprobs are NaN")
            lps = [float("nan")] * len(ids)
        else:
            lps = [float("nan") if v is None else float(v) for v in token_logprobs]
            if len(lps) != len(ids):  # re-tokenized text: server logprobs no longer line up
                lps = [float("nan")] * len(ids)

        if self.tokenizer is not None and params.stop:
            keep = find_stop(ids, self.tokenizer, params.stop)
            if keep is not None and keep < len(ids):
                ids, lps, finish = ids[:keep], lps[:keep], "stop"
        return GenOutput(token_ids=ids, logprobs=lps, finish_reason=finish)

    def _retokenize(self, choice: dict, text: str, params: SamplingParams) -> list[int]:
        if self.tokenizer is None:
            raise GenerationError(f"{self.url} returned text without token ids; pass tokenizer= to "
                                  "OpenAIGenerator so the text can be tokenized (inexact), or use a server "
                                  "that supports return_token_ids (vLLM >= 0.10.2)")
        self.token_ids_exact = False
        self._warn_once("ids", f"{self.url} returned no output token ids; re-tokenizing the text, which may "
                               "differ from the sampled ids (OpenAIGenerator.token_ids_exact = False)")
        stop_reason = choice.get("stop_reason")
        # Servers that ignore include_stop_str_in_output drop the stop string from the text.
        if isinstance(stop_reason, str) and stop_reason in params.stop and not text.endswith(stop_reason):
            text += stop_reason
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def post_json(client, url: str, body: dict, *, retries: int, backoff: float, rejected, hint: str,
              secret: str | None = None, honor_retry_after: bool = False) -> dict:
    """POST `body` as JSON and return the decoded 200 response; the retry loop of the OpenAI clients.

    Transient failures (connection errors, timeouts, HTTP 408/429/5xx) are retried `retries` times,
    sleeping `backoff_delay(attempt, backoff)` (the retriever client's pacing) or, with
    `honor_retry_after`, the 429's Retry-After seconds when the server sends them; then
    GenerationError ending with `hint`. Any other status fails at once with `rejected(error)`, where
    error is "HTTP <status>: <body>", except a 400 that says the context window is exceeded:
    ContextLengthError. `secret` (an API key) is blanked out of every error text.
    """
    import httpx

    def scrub(text: str) -> str:
        return text.replace(secret, "***") if secret else text

    last_error, wait = "no attempt made", None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(wait if wait is not None else backoff_delay(attempt, backoff))
        wait = None
        try:
            resp = client.post(url, json=body)
        except httpx.HTTPError as exc:  # connection refused, timeouts, protocol errors
            last_error = scrub(f"{type(exc).__name__}: {exc}")
            continue
        if resp.status_code == 200:
            try:
                return resp.json()
            except ValueError:
                raise GenerationError(f"{url} returned non-JSON: {scrub(resp.text[:300])!r}") from None
        last_error = scrub(f"HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code == 400 and _CONTEXT_OVERFLOW_RE.search(resp.text):
            raise ContextLengthError(f"{url} refused the request: the conversation does not fit the model's "
                                     f"context window ({last_error})")
        if resp.status_code not in _RETRYABLE_STATUS:
            raise GenerationError(rejected(last_error))
        if honor_retry_after and resp.status_code == 429:
            from search_r1.search.web import _retry_after  # one Retry-After parser (capped at 60 s)

            wait = _retry_after(resp)
        logger.warning("%s attempt %d/%d failed: %s", url, attempt + 1, retries + 1, last_error)
    raise GenerationError(f"{url} failed after {retries + 1} attempts; last error: {last_error}. {hint}")


def endpoint_url(base_url: str, path: str) -> str:
    """`path` ("completions", "chat/completions") under an OpenAI-style base URL: accepts
    "http://h:p", "http://h:p/v1" or the full ".../v1/<path>"."""
    url = base_url.rstrip("/")
    if url.endswith("/" + path):
        return url
    if url.endswith("/v1"):
        return f"{url}/{path}"
    return f"{url}/v1/{path}"


def _completions_url(base_url: str) -> str:
    return endpoint_url(base_url, "completions")
