"""`SearchR1AgentLoop`: the Search-R1 multi-turn rollout as a verl agent loop (registered `search_r1`).

verl's `AgentLoopWorker` runs one `run()` coroutine per trajectory; this loop drives the same
`search_r1.rollout.episode.Episode` state machine and `search_r1.protocol` (parsing, observation
encoding, stop strings) as the batch driver `LLMGenerationManager.run_llm_loop`, so a trajectory gets
the same tokens and masks on both paths (tests/verl_ext/test_agent_loop_equivalence.py checks it):

    prompt ids (chat template, verl's Continuous Token builder)
    while episode active:
        generate(context, max_tokens=turn budget, stop=[</search>, </answer>])   # sampled ids kept
        trim anything past the first stop string (servers that ignore `stop`)
        parse the action -> search: await the shared coalescing retriever client
                          -> invalid: the corrective message; answer: done
        append the observation with mask 0

Lengths (verl pads prompts to `rollout.prompt_length` and responses to `rollout.response_length`):
a prompt longer than `rollout.prompt_length` keeps its last `prompt_length` tokens and is rolled out
(verl's own loops and `max_start_length` in run_llm_loop cut alike; an empty response would break
verl's reward placement for the whole group); the response (generated + observation tokens) never
exceeds `rollout.response_length`; prompt + response never exceeds `search_r1.max_context_length`
(null = prompt_length + response_length; it must exceed prompt_length, so every trajectory can
generate); one turn generates at most `search_r1.max_tokens_per_turn`.

Statistics go to `extra_fields["search_r1"]` (turns, valid actions, searches, search failures,
truncated, answered, token counts, prompt tokens cut), which verl stores per trajectory and the
`search_r1` trainer mode
(verl_ext/trainer.py) aggregates per step.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass, fields
from typing import Any
from uuid import uuid4

from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.profiler import simple_timer

from search_r1.protocol import ObservationEncoder, stop_strings
from search_r1.rollout.episode import Episode
from search_r1.rollout.generation import GenerationConfig, batch_decoder, keep_through_stop
from search_r1.search import RetrieverClient
from search_r1.search.async_client import CoalescingSearch
from search_r1.search.base import SearchError
from search_r1.logs import quiet_library_loggers

log = logging.getLogger(__name__)
quiet_library_loggers()  # this runs in verl's agent-loop workers: no httpx line per search request

AGENT_NAME = "search_r1"


@dataclass(frozen=True)
class RetrieverSettings:
    """`search_r1.retriever` of the verl config (see configs/grpo_verl.yaml for each field)."""

    urls: tuple[str, ...] = ("http://127.0.0.1:8000/retrieve",)
    topk: int = 3
    timeout: float = 30.0
    retries: int = 3
    backoff: float = 0.5
    cache_size: int = 4096
    coalesce_window_s: float = 0.01
    coalesce_max_batch: int = 64

    def __post_init__(self):
        if isinstance(self.urls, str):
            object.__setattr__(self, "urls", (self.urls,))
        object.__setattr__(self, "urls", tuple(self.urls))
        if not self.urls:
            raise ValueError("search_r1.retriever.urls is empty; give at least one retriever URL, "
                             "e.g. search_r1.retriever.urls=[http://127.0.0.1:8000]")


@dataclass(frozen=True)
class SearchR1Settings:
    """The `search_r1:` group of the verl config (defaults = configs/grpo_verl.yaml)."""

    protocol: str = "tags"
    max_turns: int = 2
    max_obs_length: int = 500
    max_tokens_per_turn: int | None = 500
    max_context_length: int | None = None
    retriever: RetrieverSettings = RetrieverSettings()

    @classmethod
    def from_config(cls, config: DictConfig) -> "SearchR1Settings":
        """Read `config.search_r1`; an unknown key fails naming it and the allowed ones."""
        group = config.get("search_r1") if isinstance(config, DictConfig) else None
        if group is None:
            raise ValueError("the verl config has no `search_r1:` group, which the search_r1 agent loop "
                             "reads; compose configs/grpo_verl.yaml (bash scripts/train_grpo.sh "
                             "--config-name grpo_verl) or add the group as in that file")
        raw = OmegaConf.to_container(group, resolve=True)
        retriever = raw.pop("retriever", {}) or {}
        _check_keys("search_r1", raw, cls)
        _check_keys("search_r1.retriever", retriever, RetrieverSettings)
        return cls(**raw, retriever=RetrieverSettings(**retriever))

    def generation_config(self, rollout) -> GenerationConfig:
        """The `GenerationConfig` (limits, protocol) these settings and verl's `rollout` config give;
        its validation errors are reported under the verl config keys."""
        keys = {"max_start_length": "actor_rollout_ref.rollout.prompt_length",
                "max_response_length": "actor_rollout_ref.rollout.response_length",
                "max_prompt_length": "search_r1.max_context_length",
                "max_turns": "search_r1.max_turns", "max_obs_length": "search_r1.max_obs_length",
                "max_tokens_per_turn": "search_r1.max_tokens_per_turn", "topk": "search_r1.retriever.topk",
                "protocol": "search_r1.protocol"}
        try:
            return GenerationConfig(
                max_turns=self.max_turns,
                max_start_length=int(rollout.prompt_length),
                max_prompt_length=self.max_context_length or int(rollout.prompt_length) + int(rollout.response_length),
                max_response_length=int(rollout.response_length),
                max_obs_length=self.max_obs_length,
                topk=self.retriever.topk,
                protocol=self.protocol,
                max_tokens_per_turn=self.max_tokens_per_turn,
            )
        except ValueError as err:
            named = [f"{field} is {key}" for field, key in keys.items() if field in str(err)]
            raise ValueError(f"{err} ({'; '.join(named) or 'see search_r1.* and actor_rollout_ref.rollout.*'})") from None


def _check_keys(prefix: str, raw: dict, cls) -> None:
    allowed = {f.name for f in fields(cls)} - {"retriever"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"unknown key(s) {[f'{prefix}.{k}' for k in unknown]}; allowed: "
                         f"{sorted(f'{prefix}.{k}' for k in allowed)}")


# One coalescing client per (event loop, retriever settings): verl builds a new agent-loop object for
# every trajectory, while the coroutines of one AgentLoopWorker share its event loop, so they share
# one client and their searches coalesce into batched /retrieve requests.
_SHARED: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = weakref.WeakKeyDictionary()


def shared_search(settings: RetrieverSettings) -> CoalescingSearch:
    """The coalescing retriever client of the running event loop for `settings` (created once)."""
    per_loop = _SHARED.setdefault(asyncio.get_running_loop(), {})
    if settings not in per_loop:
        engine = RetrieverClient(list(settings.urls), topk=settings.topk, timeout=settings.timeout,
                                 retries=settings.retries, backoff=settings.backoff,
                                 cache_size=settings.cache_size)
        per_loop[settings] = CoalescingSearch(engine, settings.coalesce_window_s, settings.coalesce_max_batch)
    return per_loop[settings]


@register(AGENT_NAME)
class SearchR1AgentLoop(AgentLoopBase):
    """One Search-R1 trajectory per `run()`; see the module docstring for the turn loop and limits."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("tools", None)  # verl hands every loop its tool list; searches are ours, not tools
        super().__init__(*args, **kwargs)
        # verl builds one loop object per trajectory from the worker's config objects: parse them once
        # (the cache keeps the configs alive, so their ids cannot be reused by other objects)
        _, _, self.settings, self.gen_config = _cached(
            ("settings", id(self.config), id(self.rollout_config)),
            lambda: (self.config, self.rollout_config, *_settings_and_limits(self.config, self.rollout_config)))
        self.limits = self.gen_config.limits
        self.stops = list(stop_strings(self.settings.protocol))
        self.encoder = _cached(("encoder", id(self.tokenizer), self.settings.protocol),
                               lambda: ObservationEncoder(self.tokenizer, self.settings.protocol))
        self.decode = _cached(("decoder", id(self.tokenizer)), lambda: batch_decoder(self.tokenizer))

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        metrics: dict[str, Any] = {}
        want_logprobs = bool(sampling_params.get("logprobs"))
        full_prompt = await self.loop.run_in_executor(
            None, lambda: self.continuous_token_builder.build_initial_tokens(list(kwargs["raw_prompt"])))
        # verl's own cap (its loops' rule): the last rollout.prompt_length tokens, with a warning;
        # data.filter_overlong_prompts=true drops such rows at load time instead.
        prompt_ids = self._cap_text_prompt_length(full_prompt)
        episode = Episode(prompt_ids, self.limits, self.settings.protocol)
        episode.prompt_cut = len(full_prompt) - len(prompt_ids)

        request_id = uuid4().hex  # one id per trajectory: sticky routing to one server (prefix cache)
        extra: dict[str, Any] = {}
        counts = {"sampled_tokens": 0, "overshoot_tokens": 0, "shortened_observations": 0}
        while episode.active:
            await self._generate_turn(episode, request_id, sampling_params, metrics, extra, counts)
            if episode.needs_observation:
                with simple_timer("tool_calls", metrics):
                    await self._observe(episode, counts)

        extra.setdefault("min_global_steps", kwargs.get("global_steps"))
        extra.setdefault("max_global_steps", kwargs.get("global_steps"))
        extra["turn_scores"], extra["tool_rewards"] = [], []  # the keys verl's own loops always set
        extra[AGENT_NAME] = episode_stats(episode, counts)
        return AgentLoopOutput(
            prompt_ids=episode.prompt_ids,
            response_ids=episode.response_ids,
            response_mask=episode.info_mask,
            response_logprobs=list(episode.logprobs) if want_logprobs else None,
            # verl counts chat turns (user + assistant + tool); here: the prompt, each generation
            # turn and each observation.
            num_turns=1 + episode.turns + sum(1 for a, b in zip(episode.info_mask, episode.info_mask[1:]) if a > b),
            metrics=metrics,
            extra_fields=extra,
        )

    async def _generate_turn(self, episode: Episode, request_id: str, sampling_params: dict,
                             metrics: dict, extra: dict, counts: dict) -> None:
        budget = episode.generation_budget()
        params = {**sampling_params, "max_tokens": budget, "stop": self.stops,
                  "include_stop_str_in_output": True}
        with simple_timer("generate_sequences", metrics):
            out = await self.server_manager.generate(
                request_id=request_id, prompt_ids=episode.context_ids(), sampling_params=params)
        metrics["num_preempted"] = metrics.get("num_preempted", 0) + (out.num_preempted or 0)
        steps = out.extra_fields.get("global_steps")
        extra.setdefault("min_global_steps", out.extra_fields.get("min_global_steps", steps))
        extra["max_global_steps"] = out.extra_fields.get("max_global_steps", steps)

        counts["sampled_tokens"] += len(out.token_ids)
        ids = list(out.token_ids[:budget])
        logprobs = list(out.log_probs[:budget]) if out.log_probs else None
        kept, text = keep_through_stop(ids, self.decode([ids])[0], self.stops, self.decode)
        counts["overshoot_tokens"] += len(ids) - len(kept)
        episode.apply_generation(kept, logprobs[: len(kept)] if logprobs else None, text)

    async def _observe(self, episode: Episode, counts: dict) -> None:
        kind, passages = "invalid", None
        if episode.pending == "search":
            try:
                passages, kind = await shared_search(self.settings.retriever).search(episode.last_action.content), "search"
            except SearchError as err:
                log.warning("search failed: %s", err)
                episode.record_search_failure()
                counts["search_error"] = str(err)[:500]  # the cause, for the trainer's outage stop
                kind = "failed"
        obs = self.encoder.encode([kind], [passages], [episode.observation_budget()])[0]
        counts["shortened_observations"] += self.encoder.last_shortened
        episode.apply_observation(obs)


def _settings_and_limits(config, rollout_config) -> tuple[SearchR1Settings, GenerationConfig]:
    settings = SearchR1Settings.from_config(config)
    return settings, settings.generation_config(rollout_config)


def episode_stats(episode: Episode, counts: dict) -> dict[str, int | str]:
    """The per-trajectory statistics `run_llm_loop` reports in its meta_info, for one episode (and
    `search_error`, the last failed search's message, when one failed)."""
    return {
        "turns": episode.turns,
        "valid_actions": episode.valid_actions,
        "valid_searches": episode.valid_searches,
        "search_failures": episode.search_failures,
        "truncated": int(episode.truncated),
        "answered": int(episode.answered),
        "generated_tokens": episode.generated_tokens,
        "observation_tokens": episode.observation_tokens,
        "prompt_cut": episode.prompt_cut,
        **counts,
    }


# Per-process caches of objects every trajectory would otherwise rebuild (the observation encoder
# tokenizes its constant texts and caches passage lines; the decoder builds a byte table).
_CACHE: dict = {}


def _cached(key, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]
