"""Episode: the per-trajectory state machine, driven by hand with plain id lists (no tokenizer)."""
import pytest

from search_r1.rollout.episode import Episode, EpisodeLimits


def limits(**kw):
    base = dict(max_prompt_length=100, max_response_length=50, max_obs_length=10, max_tokens_per_turn=20,
                max_turns=2)
    base.update(kw)
    return EpisodeLimits(**base)


def test_search_then_answer_layout():
    ep = Episode([1, 2, 3], limits())
    assert ep.active and ep.context_ids() == [1, 2, 3] and ep.generation_budget() == 20
    action = ep.apply_generation([10, 11], [-0.1, -0.2], "<search> q </search>")
    assert (action.kind, action.content) == ("search", "q")
    assert ep.needs_observation and ep.pending == "search"
    with pytest.raises(ValueError, match="owes an observation"):
        ep.apply_generation([1], [0.0], "x")
    ep.apply_observation([90, 91, 92])
    assert ep.context_ids() == [1, 2, 3, 10, 11, 90, 91, 92]
    ep.apply_generation([12], [-0.3], "<answer> a </answer>")
    assert ep.finished and ep.answered and not ep.truncated
    assert ep.response_ids == [10, 11, 90, 91, 92, 12]
    assert ep.info_mask == [1, 1, 0, 0, 0, 1]
    assert ep.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert (ep.turns, ep.valid_actions, ep.valid_searches) == (2, 2, 1)
    assert (ep.generated_tokens, ep.observation_tokens) == (3, 3)
    assert ep.first_turn_tokens == 2  # the first round's tokens open the response; later rounds leave it


def test_invalid_action_then_final_round_without_search():
    ep = Episode([1], limits(max_turns=1))
    assert ep.apply_generation([5], None, "no action").kind == "invalid"
    assert ep.pending == "invalid" and ep.logprobs == [0.0]  # no logprobs -> zeros
    ep.apply_observation([70, 71])
    # Round 2 is the final one (max_turns=1): a search there ends the episode, unanswered.
    assert ep.apply_generation([6], [0.0], "<search> q </search>").kind == "search"
    assert ep.finished and not ep.answered and not ep.needs_observation
    assert (ep.turns, ep.valid_actions, ep.valid_searches) == (2, 1, 0)


def test_explicit_allow_search_overrides_turn_count():
    ep = Episode([1], limits(max_turns=0))
    ep.apply_generation([5], None, "<search> q </search>", allow_search=True)
    assert ep.pending == "search"


def test_budgets_respect_both_limits():
    # Response budget: 50 total; context budget: 100 - prompt(60) = 40 -> the context is the binding one.
    ep = Episode(list(range(60)), limits())
    assert ep.generation_budget() == 20
    ep.apply_generation([1] * 20, None, "<search> q </search>")
    # Room left 20 tokens, of which one is reserved for the next reply; obs cap 10 wins.
    assert ep.observation_budget() == 10
    ep.apply_observation([0] * 10)
    assert ep.generation_budget() == 10
    ep.apply_generation([1] * 8, None, "<search> r </search>")
    assert ep.observation_budget() == 1  # room 2, minus the reserved token
    with pytest.raises(ValueError, match="exceeds the budget 1"):
        ep.apply_observation([0, 0])


def test_observation_that_does_not_fit_ends_truncated():
    ep = Episode([1], limits())
    ep.apply_generation([1], None, "<search> q </search>")
    ep.apply_observation(None)
    assert ep.finished and ep.truncated and not ep.answered and ep.response_ids == [1]


def test_generation_filling_the_budget_ends_truncated_when_an_observation_is_owed():
    ep = Episode([1], limits(max_response_length=5, max_tokens_per_turn=5))
    ep.apply_generation([1] * 5, None, "<search> q </search>")
    assert ep.finished and ep.truncated and not ep.needs_observation
    # ...but an answer that exactly fills the budget is a clean finish.
    ep = Episode([1], limits(max_response_length=5, max_tokens_per_turn=5))
    ep.apply_generation([1] * 5, None, "<answer> a </answer>")
    assert ep.finished and ep.answered and not ep.truncated


def test_prompt_that_fills_the_context_is_never_generated():
    ep = Episode(list(range(100)), limits())
    assert ep.finished and ep.truncated and ep.generation_budget() == 0


def test_backend_contract_violations_are_clear_errors():
    ep = Episode([1], limits(max_tokens_per_turn=3))
    with pytest.raises(ValueError, match="turn budget was 3"):
        ep.apply_generation([1, 2, 3, 4], None, "x")
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        ep.apply_generation([1], [0.0, 0.0], "x")
    with pytest.raises(ValueError, match="without a pending"):
        ep.apply_observation([1])


def test_one_episode_at_a_time_matches_the_batch_manager():
    """Driving Episodes one by one (as a per-trajectory async agent loop will) gives the same ids,
    masks and logprobs as `run_llm_loop` over the batch."""
    import torch

    from search_r1.protocol import ObservationEncoder, decode_ids, stop_strings
    from search_r1.rollout.backends import SamplingParams
    from search_r1.rollout.generation import GenerationConfig, LLMGenerationManager
    from search_r1.rollout.tensor_helper import pad_ragged
    from search_r1.search import MockSearchEngine
    from verl import DataProto

    from tests.search_r1.rollout.scripted import ScriptedGenerator, smollm2_tokenizer

    tok = smollm2_tokenizer()
    engine = MockSearchEngine({"veltra": "Doc 1(Title: Veltra) Veltra was founded by Ana Osk.\n"})
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("Q: Veltra?", "Q: Paris?", "Q: loop?")]
    scripts = [["<search> Veltra </search>", "<answer> Ana Osk </answer>"], ["<answer> Paris </answer>"],
               ["hmm", "<search> Veltra </search>", "<search> again Veltra </search>"]]
    config = GenerationConfig(max_turns=2, max_response_length=300, max_obs_length=20)

    ids, mask = (torch.from_numpy(a) for a in pad_ragged(prompts, left=True))
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})
    out = LLMGenerationManager(tok, ScriptedGenerator(tok, prompts, scripts), config, engine).run_llm_loop(batch)

    gen = ScriptedGenerator(tok, prompts, scripts)
    encoder = ObservationEncoder(tok, config.protocol)
    for row, prompt in enumerate(prompts):
        ep = Episode(prompt, config.limits, config.protocol)
        while ep.active:
            o = gen.generate([ep.context_ids()], SamplingParams(max_tokens=ep.generation_budget(),
                                                                stop=stop_strings(config.protocol)))[0]
            action = ep.apply_generation(o.token_ids, o.logprobs, decode_ids(tok, [o.token_ids])[0])
            if ep.needs_observation:
                kind = "search" if ep.pending == "search" else "invalid"
                passages = engine.search(action.content) if kind == "search" else None
                ep.apply_observation(encoder.encode([kind], [passages], [ep.observation_budget()])[0])
        n = len(ep.response_ids)
        assert out.batch["responses"][row, :n].tolist() == ep.response_ids
        assert out.batch["response_mask"][row, :n].tolist() == ep.info_mask
        assert out.batch["rollout_log_probs"][row, :n].tolist() == pytest.approx(ep.logprobs)
        assert out.batch["attention_mask"][row, ids.shape[1] + n:].sum() == 0
        assert out.meta_info["turns_stats"][row] == ep.turns
