"""One trajectory's state machine: generate, act, observe, until an answer or a limit.

An `Episode` owns the token layout of one rollout: the prompt ids, then the response, in which every
token carries a mask bit (1 = sampled by the policy, trained; 0 = written by the environment,
masked from the loss) and a log-prob (0.0 for environment tokens). It never sees a tokenizer or a
search engine: the driver (the batch `LLMGenerationManager`, or later a per-trajectory async agent
loop) decodes text, runs searches and encodes observations, then feeds the results in:

    ep = Episode(prompt_ids, limits)
    while ep.active:
        out = generator.generate([ep.context_ids()], SamplingParams(max_tokens=ep.generation_budget(), ...))[0]
        action = ep.apply_generation(out.token_ids, out.logprobs, text_of(out.token_ids))
        if ep.needs_observation:
            ids = encoder.encode([...], [...], [ep.observation_budget()])[0]
            ep.apply_observation(ids)     # None = it does not fit: the episode ends truncated

Turn rules (upstream Search-R1): a search action is answered by an observation; an answer ends the
episode; anything else gets the invalid-action message and another turn. After `max_turns`
generation rounds with search allowed, one last round runs with search disallowed, and whatever
it produces ends the episode.

Limits: the rolling context (prompt + response) never exceeds `max_prompt_length` and the response
never exceeds `max_response_length`. An episode that cannot fit another generated token or its
next observation ends with `truncated=True`. The drivers left-truncate a prompt longer than
`max_start_length` before the episode starts (`prompt_cut` counts the tokens dropped), and
`max_start_length < max_prompt_length`, so every episode has room for its first generated token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from search_r1.protocol import Action, parse_action


@dataclass(frozen=True)
class EpisodeLimits:
    """Token budgets of one trajectory (see `GenerationConfig` for the meaning of each)."""

    max_prompt_length: int
    max_response_length: int
    max_obs_length: int
    max_tokens_per_turn: int
    max_turns: int


@dataclass
class Episode:
    """Per-trajectory rollout state. Lists are response-aligned: `response_ids[i]` has `info_mask[i]`
    (1 generated / 0 observation) and `logprobs[i]` (0.0 on observation tokens)."""

    prompt_ids: list[int]
    limits: EpisodeLimits
    protocol: str = "tags"
    response_ids: list[int] = field(default_factory=list)
    info_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0  # generation rounds taken
    valid_actions: int = 0  # well-formed search or answer actions
    valid_searches: int = 0  # searches sent to the engine
    search_failures: int = 0  # searches the engine could not answer
    prompt_cut: int = 0  # tokens the driver cut from the left of an over-long prompt
    generated_tokens: int = 0  # tokens kept from the generator (info_mask == 1)
    observation_tokens: int = 0  # environment tokens appended (info_mask == 0)
    first_turn_tokens: int = 0  # tokens of the first generation round (the response's first tokens)
    finished: bool = False
    answered: bool = False
    truncated: bool = False
    pending: str | None = None  # "search" | "invalid" while an observation is owed
    last_action: Action | None = None

    def __post_init__(self):
        self.prompt_ids = list(self.prompt_ids)
        # The response may grow to the smaller of its own limit and what the context leaves.
        self._cap = min(self.limits.max_response_length, self.limits.max_prompt_length - len(self.prompt_ids))
        if self.generation_budget() == 0:
            # The prompt alone fills the context: nothing can be generated.
            self.finished = self.truncated = True

    # -- queries ----------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return not self.finished

    @property
    def needs_observation(self) -> bool:
        return self.pending is not None

    def context_ids(self) -> list[int]:
        """The rolling context the policy continues: prompt + response so far."""
        return self.prompt_ids + self.response_ids

    def _room(self) -> int:
        """Tokens that may still be appended without breaking either length limit."""
        return self._cap - len(self.response_ids)

    def generation_budget(self) -> int:
        """max_tokens for the next turn (0 when nothing fits)."""
        return max(0, min(self.limits.max_tokens_per_turn, self._room()))

    def observation_budget(self) -> int:
        """The most tokens the owed observation may take. One token of room is kept back for the
        policy's next turn, since an observation with no reply after it teaches nothing."""
        return max(0, min(self.limits.max_obs_length, self._room() - 1))

    # -- transitions ------------------------------------------------------------------------------
    def apply_generation(self, token_ids: list[int], logprobs: list[float] | None, text: str,
                         allow_search: bool | None = None) -> Action:
        """Append one turn's sampled tokens (mask 1) and act on the parsed action.

        token_ids: the sampled ids exactly as the backend produced them (never re-tokenized).
        logprobs: one per token (None -> zeros, for backends that do not report them).
        text: the decoded `token_ids`, used only to parse the action.
        allow_search: whether a search may follow; default: this turn is one of the first
            `max_turns`. On the final round a search ends the episode unanswered.
        """
        if not self.active or self.pending is not None:
            raise ValueError("apply_generation on an episode that is finished or owes an observation; "
                             "check `active` and apply the pending observation first")
        budget = self.generation_budget()
        if len(token_ids) > budget:
            raise ValueError(f"generator returned {len(token_ids)} tokens but the turn budget was {budget}; "
                             "the backend must honour SamplingParams.max_tokens")
        if hasattr(logprobs, "tolist"):  # a tensor / array from the backend
            logprobs = logprobs.tolist()
        if logprobs is None or len(logprobs) == 0:
            logprobs = [0.0] * len(token_ids)  # a backend without logprobs
        elif len(logprobs) != len(token_ids):
            raise ValueError(f"got {len(logprobs)} logprobs for {len(token_ids)} tokens; "
                             "a backend must return one logprob per sampled token")
        self.response_ids += token_ids
        self.info_mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.generated_tokens += len(token_ids)
        if self.turns == 0:
            self.first_turn_tokens = len(token_ids)
        if allow_search is None:
            allow_search = self.turns < self.limits.max_turns
        self.turns += 1

        action = parse_action(text, self.protocol)
        self.last_action = action
        if action.kind == "answer":
            self.valid_actions += 1
            self.finished = self.answered = True
        elif action.kind == "search":
            self.valid_actions += 1
            if allow_search:
                self.valid_searches += 1
                self.pending = "search"
            else:
                self.finished = True
        elif allow_search:
            self.pending = "invalid"
        else:
            self.finished = True
        if self.pending is not None and self.observation_budget() == 0:
            self.pending = None
            self.finished = self.truncated = True
        return action

    def record_search_failure(self) -> None:
        """The engine failed on this episode's query; the observation will say so."""
        self.search_failures += 1

    def apply_observation(self, obs_ids: list[int] | None) -> None:
        """Append the owed observation (mask 0, logprob 0). None means it did not fit: end truncated."""
        if self.pending is None:
            raise ValueError("apply_observation without a pending search or invalid action")
        self.pending = None
        if obs_ids is None:
            self.finished = self.truncated = True
            return
        if len(obs_ids) > self.observation_budget():
            raise ValueError(f"observation of {len(obs_ids)} tokens exceeds the budget "
                             f"{self.observation_budget()}; shorten it with ObservationEncoder")
        self.response_ids += obs_ids
        self.info_mask += [0] * len(obs_ids)
        self.logprobs += [0.0] * len(obs_ids)
        self.observation_tokens += len(obs_ids)
        if self.generation_budget() == 0:
            self.finished = self.truncated = True

    def end_truncated(self) -> None:
        """Stop here because a limit leaves no room for the next step."""
        self.pending = None
        self.finished = self.truncated = True
