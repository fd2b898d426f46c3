"""The batch multi-turn rollout: `LLMGenerationManager.run_llm_loop(gen_batch) -> DataProto`.

Batch-synchronous per turn, like upstream Search-R1: each round, every still-active trajectory
generates once (one `Generator.generate` call, stop strings set, so nothing is sampled past the
action); all search queries of the round go to the engine in one `batch_search` call; the
observations are tokenized in one tokenizer call and appended with mask 0. After `max_turns` rounds
with search allowed, the trajectories still active get one last round without search.

Where this differs from upstream (defects listed in UPSTREAM_NOTES): the sampled token ids are kept
(text is decoded only to parse the action); the backend stops at `</search>` / `</answer>`; an
overlong observation is shortened inside its wrapper, keeping the closing tag; validation is
greedy; a trajectory that cannot fit more ends with a `truncated` flag instead of being cut from the
left; a failing search engine yields a "search failed" observation and the loop goes on. As upstream
(and verl's own agent loops), a prompt longer than `max_start_length` keeps its last
`max_start_length` tokens and is rolled out.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from verl import DataProto

from search_r1.bpe_cache import ByteDecoder
from search_r1.protocol import ObservationEncoder, check_protocol, decode_ids, stop_strings
from search_r1.rollout.backends import Generator, SamplingParams, find_stop
from search_r1.rollout.episode import Episode, EpisodeLimits
from search_r1.rollout.tensor_helper import pad_ragged, position_ids_from_mask, strip_left_padding
from search_r1.search.base import SearchEngine, SearchError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """Rollout settings; defaults are upstream Search-R1's training defaults.

    max_turns: generation rounds in which a search is allowed; one more round without search follows.
    max_start_length: longest prompt; a longer one keeps its last max_start_length tokens (cut from
        the left, as upstream and verl's agent loops do). Must be below max_prompt_length, so a
        prompt always leaves room to generate.
    max_prompt_length: longest rolling context: prompt + response, including the turn being
        generated, never exceeds it (so neither does any sequence the policy is trained on).
    max_response_length: longest response (generated + observation tokens over all turns). Upstream
        used this number per turn; here it bounds the whole response, so `responses` has a known
        maximum width.
    max_obs_length: longest single observation in tokens; longer search results are shortened.
    topk: passages per search (used when the engine is built from `search_url`).
    protocol: "tags" (<search>/<information>) or "tool_call" (<tool_call> JSON / <tool_response>).
    temperature, top_p, top_k: sampling for training rollouts; validation is always greedy.
    max_tokens_per_turn: generation cap per round; None = whatever the response budget allows.
    seed: base sampling seed (round r uses seed + r); None = unseeded.
    search_url: retriever URL used to build a `RetrieverClient` when no engine is passed.
    """

    max_turns: int = 2
    max_start_length: int = 2048
    max_prompt_length: int = 4096
    max_response_length: int = 500
    max_obs_length: int = 500
    topk: int = 3
    protocol: str = "tags"
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = -1
    max_tokens_per_turn: int | None = None
    seed: int | None = None
    search_url: str | None = None

    def __post_init__(self):
        for name in ("max_start_length", "max_prompt_length", "max_response_length", "max_obs_length", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenerationConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_turns, int) or self.max_turns < 0:
            raise ValueError(f"GenerationConfig.max_turns must be an int >= 0, got {self.max_turns!r}")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ValueError(f"GenerationConfig.max_tokens_per_turn must be >= 1 or None, "
                             f"got {self.max_tokens_per_turn!r}")
        if self.max_start_length >= self.max_prompt_length:
            raise ValueError(f"GenerationConfig.max_start_length ({self.max_start_length}) must be less than "
                             f"max_prompt_length ({self.max_prompt_length}): the prompt is part of the context, "
                             f"and a prompt of max_start_length tokens must leave room to generate")
        check_protocol(self.protocol)
        if self.temperature < 0:
            raise ValueError(f"GenerationConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"GenerationConfig.top_p must be in (0, 1], got {self.top_p}")

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(
            max_prompt_length=self.max_prompt_length,
            max_response_length=self.max_response_length,
            max_obs_length=self.max_obs_length,
            max_tokens_per_turn=self.max_tokens_per_turn or self.max_response_length,
            max_turns=self.max_turns,
        )


def batch_decoder(tokenizer) -> Callable[[list[list[int]]], list[str]]:
    """`decode(id_lists) -> texts`, special tokens kept: search_r1.bpe_cache's exact byte table when
    the tokenizer qualifies (much faster per turn), else the tokenizer's own batch decode."""
    fast = ByteDecoder.for_tokenizer(tokenizer)
    if fast is not None:
        return fast.decode
    return lambda id_lists: decode_ids(tokenizer, id_lists)


def _first_stop_end(text: str, stops) -> int:
    """Character offset just past the earliest stop string in `text`, or -1."""
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return min(ends) if ends else -1


def keep_through_stop(ids: list[int], text: str, stops, decode) -> tuple[list[int], str]:
    """One turn's `(ids, text)` ending at its first stop string, for backends that ignore `stop`.

    Unchanged when no stop string occurs or only whitespace follows the first one (what a conforming
    backend returns); otherwise the shortest prefix of `ids` whose text contains a stop string
    (binary search, log2(n) decodes) and that prefix's text. Used by both rollout drivers
    (`run_llm_loop` and verl_ext's agent loop), so they trim alike.
    """
    end = _first_stop_end(text, stops)
    if end < 0 or not text[end:].strip():
        return ids, text
    kept = ids[:find_stop(ids, None, stops, decode=lambda x: decode([x])[0]) or len(ids)]
    return kept, decode([kept])[0]


@dataclass
class _TurnCounters:
    gen_s: float = 0.0
    search_s: float = 0.0
    rounds: int = 0
    search_calls: int = 0
    sampled_tokens: int = 0  # what the backend returned
    overshoot_tokens: int = 0  # returned past a stop string (a backend that ignores `stop`)
    shortened_observations: int = 0


class LLMGenerationManager:
    """Runs multi-turn search-augmented rollouts for a batch of prompts.

    tokenizer: HF tokenizer of the policy (decodes to parse actions, encodes observations).
    generator: any `Generator` (HF, verl worker group, OpenAI-compatible server, scripted in tests).
    search_engine: a `SearchEngine`; None builds a `RetrieverClient(config.search_url, topk)`.
    is_validation: greedy decoding (temperature 0), as validation should be.
    """

    def __init__(self, tokenizer, generator: Generator, config: GenerationConfig,
                 search_engine: SearchEngine | None = None, is_validation: bool = False):
        self.tokenizer = tokenizer
        self.generator = generator
        self.config = config
        if search_engine is None:
            if not config.search_url:
                raise ValueError("LLMGenerationManager needs a search_engine or GenerationConfig.search_url "
                                 "(e.g. search_url='http://127.0.0.1:8000/retrieve')")
            from search_r1.search import RetrieverClient  # deferred: only this path needs HTTP
            search_engine = RetrieverClient(config.search_url, topk=config.topk)
        self.search_engine = search_engine
        self.is_validation = is_validation
        self.encoder = ObservationEncoder(tokenizer, config.protocol)
        self.stops = stop_strings(config.protocol)
        self._decode = batch_decoder(tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = 0 if pad is None else int(pad)

    # -- the loop ---------------------------------------------------------------------------------
    def run_llm_loop(self, gen_batch: DataProto) -> DataProto:
        """Roll out every prompt of `gen_batch` to an answer or a limit.

        gen_batch: batch `input_ids`, `attention_mask` (B, P), left-padded; non-tensors pass through.
            Rows longer than max_start_length keep their last max_start_length tokens.

        Returns a DataProto with, for N = P + R (R = longest response in the batch, >= 1; P the input
        width, or max_start_length when the input is wider):
          prompts (B, P) left-padded, as given (cut on the left to max_start_length columns);
          responses (B, R) right-padded with the pad id;
          input_ids (B, N) = [prompts, responses]; attention_mask (B, N): 1 on every real token;
          position_ids (B, N) = clip(cumsum(attention_mask) - 1, 0);
          info_mask (B, N): 1 on prompt tokens and generated tokens, 0 on observation tokens and on
            padding (ARCHITECTURE's definition, upstream's `info_mask`);
          response_mask (B, R) = info_mask[:, P:]: 1 exactly on the tokens the policy sampled;
          rollout_log_probs (B, R) float32: sampling log-probs, 0.0 where response_mask is 0;
        and meta_info (added to the input's): per-row lists `turns_stats`, `active_mask` (True = never
        answered), `valid_action_stats`, `valid_search_stats`, `search_failure_stats`,
        `truncated_mask`, `generated_token_stats`, `observation_token_stats`, `prompt_cut_stats`
        (tokens cut from the prompt's left), `first_turn_token_stats` (tokens of the first generation
        round, which open the response); totals in
        `rollout_stats`; seconds in `timing` (`gen_s`, `search_s`, `loop_s` = the rest, `total_s`).
        """
        t_start = time.perf_counter()
        prompts, prompt_mask = gen_batch.batch["input_ids"], gen_batch.batch["attention_mask"]  # (B, P)
        lengths = prompt_mask.sum(dim=-1).tolist()  # (B,)
        # Left-padded rows: the last max_start_length columns are each row's last tokens, so this cut is
        # the left-truncation of every over-long row (upstream's and verl's rule).
        prompts, prompt_mask = prompts[:, -self.config.max_start_length:], prompt_mask[:, -self.config.max_start_length:]
        limits = self.config.limits
        episodes = [Episode(ids, limits, self.config.protocol)
                    for ids in strip_left_padding(prompts, prompt_mask)]
        for ep, n in zip(episodes, lengths):
            ep.prompt_cut = int(n) - len(ep.prompt_ids)
        cut = [ep for ep in episodes if ep.prompt_cut]
        if cut:
            log.warning("%d prompt(s) longer than max_start_length=%d keep their last %d tokens (left-truncated)",
                        len(cut), self.config.max_start_length, self.config.max_start_length)

        counters = _TurnCounters()
        for _ in range(self.config.max_turns + 1):
            live = [ep for ep in episodes if ep.active]
            if not live:
                break
            self._generate_round(live, counters)
            owed = [ep for ep in live if ep.needs_observation]
            if owed:
                self._observe_round(owed, counters)
            counters.rounds += 1

        out = self._to_dataproto(gen_batch, prompts, prompt_mask, episodes)
        total = time.perf_counter() - t_start
        out.meta_info.update(self._stats(episodes, counters, total))
        return out

    def _sampling_params(self, max_tokens: int, round_idx: int) -> SamplingParams:
        if self.is_validation:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1,
                                  stop=self.stops, seed=self.config.seed)
        seed = None if self.config.seed is None else self.config.seed + round_idx
        return SamplingParams(max_tokens=max_tokens, temperature=self.config.temperature,
                              top_p=self.config.top_p, top_k=self.config.top_k, stop=self.stops, seed=seed)

    def _generate_round(self, live: list[Episode], counters: _TurnCounters) -> None:
        """One generate call for all live episodes, then each episode takes its action."""
        budgets = [ep.generation_budget() for ep in live]
        params = self._sampling_params(max(budgets), counters.rounds)
        contexts = [ep.context_ids() for ep in live]  # built outside the timed call: loop work, not gen
        t0 = time.perf_counter()
        outputs = self.generator.generate(contexts, params)
        counters.gen_s += time.perf_counter() - t0
        if len(outputs) != len(live):
            raise ValueError(f"generator returned {len(outputs)} outputs for {len(live)} prompts")

        # One call shares max_tokens = the largest budget; a row near its limit keeps only the prefix
        # that fits (still exactly what was sampled), and its episode then ends on the limit.
        token_lists, logprob_lists = [], []
        for out, budget in zip(outputs, budgets):
            counters.sampled_tokens += len(out.token_ids)
            token_lists.append(list(out.token_ids[:budget]))
            logprob_lists.append(list(out.logprobs[:budget]) if out.logprobs else None)
        texts = self._decode(token_lists)
        for i, text in enumerate(texts):
            kept, texts[i] = keep_through_stop(token_lists[i], text, self.stops, self._decode)
            if len(kept) < len(token_lists[i]):
                counters.overshoot_tokens += len(token_lists[i]) - len(kept)
                token_lists[i] = kept
                if logprob_lists[i] is not None:
                    logprob_lists[i] = logprob_lists[i][: len(kept)]
        for ep, ids, lps, text in zip(live, token_lists, logprob_lists, texts):
            ep.apply_generation(ids, lps, text)

    def _observe_round(self, owed: list[Episode], counters: _TurnCounters) -> None:
        """Run this round's searches as one engine call and append every owed observation."""
        searching = [ep for ep in owed if ep.pending == "search"]
        results: list[str] | None = None
        if searching:
            queries = [ep.last_action.content for ep in searching]
            t0 = time.perf_counter()
            try:
                results = self.search_engine.batch_search(queries)
            except SearchError as err:
                log.warning("search failed for %d queries: %s", len(queries), err)
            counters.search_s += time.perf_counter() - t0
            counters.search_calls += 1
            if results is not None and len(results) != len(queries):
                raise ValueError(f"search engine returned {len(results)} results for {len(queries)} queries")
        by_episode = dict(zip(map(id, searching), results)) if results is not None else {}

        kinds, passages = [], []
        for ep in owed:
            if ep.pending == "invalid":
                kinds.append("invalid")
                passages.append(None)
            elif results is None:
                ep.record_search_failure()
                kinds.append("failed")
                passages.append(None)
            else:
                kinds.append("search")
                passages.append(by_episode[id(ep)])
        observations = self.encoder.encode(kinds, passages, [ep.observation_budget() for ep in owed])
        counters.shortened_observations += self.encoder.last_shortened
        for ep, ids in zip(owed, observations):
            ep.apply_observation(ids)

    # -- output -----------------------------------------------------------------------------------
    def _to_dataproto(self, gen_batch: DataProto, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                      episodes: list[Episode]) -> DataProto:
        prompt_mask = prompt_mask.to(torch.long)  # (B, P)
        responses, response_attn = pad_ragged([ep.response_ids for ep in episodes], pad_value=self.pad_token_id)
        width = responses.shape[1]  # R
        response_mask, _ = pad_ragged([ep.info_mask for ep in episodes], width=width)
        logprobs, _ = pad_ragged([ep.logprobs for ep in episodes], width=width, pad_value=0.0, dtype="float32")

        responses_t = torch.from_numpy(responses).to(prompts.dtype)  # (B, R)
        response_attn_t = torch.from_numpy(response_attn)  # (B, R)
        response_mask_t = torch.from_numpy(response_mask)  # (B, R)
        attention_mask = torch.cat([prompt_mask, response_attn_t], dim=1)  # (B, P + R)
        tensors = {
            "prompts": prompts,
            "responses": responses_t,
            "input_ids": torch.cat([prompts, responses_t], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
            "info_mask": torch.cat([prompt_mask, response_mask_t], dim=1),
            "response_mask": response_mask_t,
            "rollout_log_probs": torch.from_numpy(logprobs),
        }
        return DataProto.from_dict(tensors=tensors, non_tensors=dict(gen_batch.non_tensor_batch),
                                   meta_info=dict(gen_batch.meta_info))

    @staticmethod
    def _stats(episodes: list[Episode], c: _TurnCounters, total_s: float) -> dict:
        generated = sum(ep.generated_tokens for ep in episodes)
        return {
            "turns_stats": [ep.turns for ep in episodes],
            "active_mask": [not ep.answered for ep in episodes],
            "valid_action_stats": [ep.valid_actions for ep in episodes],
            "valid_search_stats": [ep.valid_searches for ep in episodes],
            "search_failure_stats": [ep.search_failures for ep in episodes],
            "truncated_mask": [ep.truncated for ep in episodes],
            "generated_token_stats": [ep.generated_tokens for ep in episodes],
            "observation_token_stats": [ep.observation_tokens for ep in episodes],
            "prompt_cut_stats": [ep.prompt_cut for ep in episodes],
            "first_turn_token_stats": [ep.first_turn_tokens for ep in episodes],
            "rollout_stats": {
                "rounds": c.rounds,
                "search_calls": c.search_calls,
                "sampled_tokens": c.sampled_tokens,
                "kept_generated_tokens": generated,
                "discarded_tokens": c.sampled_tokens - generated,
                "overshoot_tokens": c.overshoot_tokens,
                "observation_tokens": sum(ep.observation_tokens for ep in episodes),
                "shortened_observations": c.shortened_observations,
                "search_failures": sum(ep.search_failures for ep in episodes),
                "truncated": sum(ep.truncated for ep in episodes),
                "prompts_cut": sum(ep.prompt_cut > 0 for ep in episodes),
                "answered": sum(ep.answered for ep in episodes),
            },
            "timing": {"gen_s": c.gen_s, "search_s": c.search_s,
                       "loop_s": max(0.0, total_s - c.gen_s - c.search_s), "total_s": total_s},
        }
