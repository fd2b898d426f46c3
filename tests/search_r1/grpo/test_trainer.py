"""GRPOTrainer on tiny-random-qwen3 (with a scripted bias that makes it search, see conftest.py)."""
import logging
import math

import pytest
import torch

from search_r1.grpo import GRPOTrainer, MockSearchEngine, PolicyUpdateUnavailable, Trajectory, build_search_engine
from search_r1.models import load_model_and_tokenizer
from search_r1.prompts import apply_chat_template, grpo_messages
from search_r1.search import RetrieverClient

from tests._fixtures.retriever import corpus_titles

from .conftest import GOLD, QUERIES, VELTRA, install_script, tiny_config


def _check_layout(t: Trajectory, trainer: GRPOTrainer) -> None:
    prompt = trainer.prompt_ids(t.query)
    assert t.full_input_ids[:len(prompt)] == prompt
    assert len(t.generated_positions) == len(t.token_steps) > 0
    for p, step in zip(t.generated_positions, t.token_steps):
        assert step.position == p and t.full_input_ids[p] == step.token_id
    # every response token is either generated or inserted information, and the text is their decoding
    inserted = [i for i in range(len(prompt), len(t.full_input_ids)) if i not in set(t.generated_positions)]
    assert trainer.tokenizer.decode([t.full_input_ids[i] for i in inserted]).strip().startswith("<information>")
    assert t.generated_text == trainer.tokenizer.decode(t.full_input_ids[len(prompt):], skip_special_tokens=False)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.95, 50)])
def test_rollout_searches_inserts_information_and_logprobs_match_recompute(scripted_trainer, temperature, top_p,
                                                                           top_k):
    # log-probs are of the sampling distribution (logits / T, top-k, top-p) in both passes
    trainer = scripted_trainer(tiny_config(temperature=temperature, top_p=top_p, top_k=top_k))
    trajectories = trainer.rollout([q for q in QUERIES for _ in range(2)])
    for t in trajectories:
        _check_layout(t, trainer)
        assert t.num_searches == 1 and not t.truncated
        assert "<information>Doc 1(Title: Veltra) Veltra was founded by Ana Osk." in t.generated_text
        assert t.final_answer in ("Ana Osk", "Bob Rell")
    # before any update, the sampling log-probs are the teacher-forced ones
    recomputed = trainer.recompute_log_probs(trajectories)
    for t, new in zip(trajectories, recomputed):
        assert torch.allclose(new, torch.tensor(t.old_log_probs), atol=1e-4)
    # the scripted tokens are near-certain except the answer's first word (two equally biased heads)
    lps = torch.tensor(trajectories[0].old_log_probs)
    assert (lps > -1.0).float().mean() > 0.9


def test_train_step_rewards_advantages_and_update(scripted_trainer):
    trainer = scripted_trainer()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.train_step(QUERIES, GOLD)
    trajectories = m["trajectories"]
    assert len(trajectories) == 2 * 4 and m["step"] == trainer.global_step == 1
    for i, t in enumerate(trajectories):
        _check_layout(t, trainer)
        # well-formed (search + information + answer): 0.5 + 2.0 for the right answer, 0.5 + 0.0 else
        assert t.reward == (2.5 if t.final_answer == "Ana Osk" else 0.5)
    for g in range(2):
        group = trajectories[4 * g:4 * g + 4]
        rewards = [t.reward for t in group]
        expected = GRPOTrainer.compute_advantages(rewards).tolist()
        assert [t.advantage for t in group] == pytest.approx(expected)
    assert len({t.reward for t in trajectories}) == 2, "the seeded rollout should sample both answers"
    assert m["search_trajectories"] == 1.0
    assert m["avg_tokens"] == pytest.approx(sum(len(t.token_steps) for t in trajectories) / 8)
    assert m["avg_reward"] == pytest.approx(sum(t.reward for t in trajectories) / 8)
    assert math.isfinite(m["loss"]) and math.isfinite(m["kl_div"]) and m["skipped"] == 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    # the update moved probability toward the rewarded answer: its log-prob rises
    right = next(t for t in trajectories if t.reward == 2.5)
    k = next(j for j, s in enumerate(right.token_steps) if s.token_text == " Ana")
    new = trainer.recompute_log_probs([right])[0]
    assert new[k] > right.token_steps[k].log_prob


@pytest.mark.parametrize("skip", [True, False])
def test_a_batch_without_a_non_zero_advantage_takes_no_step(scripted_trainer, skip):
    trainer = scripted_trainer(tiny_config(update_times=1, skip_zero_advantage=skip))
    informative = trainer.rollout(QUERIES * 2)
    for t, a in zip(informative, (1.0, -1.0, 0.5, -0.5)):
        t.advantage = a
    trainer.update_policy(informative)  # AdamW now holds momentum
    after_first = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    flat = trainer.rollout(QUERIES * 2)
    for t in flat:
        t.advantage = 0.0
    m = trainer.update_policy(flat)
    moved = any(not torch.equal(after_first[k], v) for k, v in trainer.model.state_dict().items())
    assert m["update_skipped"] == (1.0 if skip else 0.0)
    assert moved == (not skip)  # without the skip, momentum moves the weights with no reward asking


def test_update_skips_and_counts_a_misaligned_trajectory(scripted_trainer, caplog):
    trainer = scripted_trainer(tiny_config(update_times=1))
    trajectories = trainer.rollout(QUERIES * 2)
    for t, a in zip(trajectories, (1.0, -1.0, 0.5, -0.5)):
        t.advantage = a
    broken = trajectories[1]
    broken.full_input_ids = broken.full_input_ids[:-3]  # the last generated tokens fall off the sequence
    assert len(trainer.recompute_log_probs([broken])[0]) == len(broken.token_steps) - 3
    with caplog.at_level(logging.WARNING):
        m = trainer.update_policy(trajectories)
    assert m["skipped"] == 1 and trainer.stats["skipped_trajectories"] == 1
    assert "skipping trajectory" in caplog.text and math.isfinite(m["loss"])
    assert set(m) >= {"loss", "kl_div", "avg_reward", "beta"} and m["beta"] == 0.1


def test_out_of_memory_halves_the_micro_batch_and_retries(scripted_trainer, caplog):
    trainer = scripted_trainer(tiny_config(update_times=1, micro_batch_size=4))
    trajectories = trainer.rollout(QUERIES * 2)
    for t, a in zip(trajectories, (1.0, -1.0, 0.5, -0.5)):
        t.advantage = a
    forward = trainer.model.forward
    calls = []

    def tight_memory(*args, **kwargs):  # "out of memory" for any pass over more than 2 sequences
        calls.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(*args, **kwargs)

    trainer.model.forward = tight_memory
    with caplog.at_level(logging.WARNING):
        m = trainer.update_policy(trajectories)
    assert calls == [4, 2, 2]  # failed at 4, then two micro-batches of 2
    assert trainer.micro_batch_size == 2 and trainer.stats["oom_retries"] == 1
    assert "out of memory with micro-batch 4; retrying with micro-batch 2" in caplog.text
    assert math.isfinite(m["loss"])

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    trainer.model.forward = no_memory
    with pytest.raises(RuntimeError, match="out of memory with micro_batch_size=1"):
        trainer.recompute_log_probs(trajectories)


def test_empty_query_and_max_tokens():
    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    trainer = GRPOTrainer(tiny_config(), search_engine=MockSearchEngine({}), model=model, tokenizer=tokenizer)
    empty = trainer.generate_trajectory("   ")
    assert empty.token_steps == [] and empty.full_input_ids == [] and empty.generated_text == ""
    t = trainer.generate_trajectory("What is Osk?", max_tokens=7, ground_truth="x")
    assert len(t.token_steps) <= 7 and t.truncated  # the random model does not answer in 7 tokens
    assert t.reward == -1.0  # malformed, no answer
    # a batch mixing blank and real queries keeps order; blank rows get no tokens
    out = trainer.rollout(["", "Who?"], max_tokens=5)
    assert out[0].token_steps == [] and len(out[1].token_steps) == 5
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        trainer.train_step(["Who?"], [["x"]], group_size=1)
    with pytest.raises(ValueError, match="one entry per query"):
        trainer.train_step(["Who?", "What?"], [["x"]])
    with pytest.raises(ValueError, match="target"):
        trainer.train_step(["Who?"], [{"answers": ["x"]}])


def test_chatml_prompt_equals_the_tokenizers_chat_template():
    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    trainer = GRPOTrainer(tiny_config(), search_engine=MockSearchEngine({}), model=model, tokenizer=tokenizer)
    ids = trainer.prompt_ids("Who founded Veltra")
    assert ids == apply_chat_template(tokenizer, grpo_messages("Who founded Veltra"))
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<search> Veltra Systems founder </search>" in text and "<answer> Paris </answer>" in text


def test_save_load_resume_reproduces_the_uninterrupted_run(scripted_trainer, tmp_path):
    queries, gold = QUERIES, GOLD
    # skip_zero_advantage off: a group of 2 may score alike, and this checks that AdamW's moments resume
    cfg = tiny_config(group_size=2, update_times=1, num_epochs=1, batch_size=1, save_interval=1,
                      output_dir=str(tmp_path / "a"), log_interval=0, skip_zero_advantage=False)
    a = scripted_trainer(cfg)
    history = a.train(queries, gold)
    assert [h["step"] for h in history] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "a").glob("global_step_*")) == ["global_step_1", "global_step_2"]

    b = scripted_trainer(tiny_config(group_size=2, update_times=1, num_epochs=1, batch_size=1, log_interval=0,
                                     skip_zero_advantage=False))
    state = b.load(tmp_path / "a" / "global_step_1")
    assert b.global_step == b.data_step == 1 and state["optimizer"] is not None and len(b.history) == 1
    assert b.optimizer.state_dict()["state"][0]["step"] == 1  # AdamW moments came back
    resumed = b.train(queries, gold)  # only the missing step runs
    assert [h["step"] for h in resumed] == [2]
    assert resumed[0]["loss"] == pytest.approx(history[1]["loss"], abs=1e-6)
    assert resumed[0]["avg_reward"] == history[1]["avg_reward"]
    for k, v in a.model.state_dict().items():
        assert torch.allclose(v, b.model.state_dict()[k], atol=1e-6), k
    # a root directory loads its newest checkpoint
    c = scripted_trainer(tiny_config(log_interval=0))
    c.load(tmp_path / "a")
    assert c.global_step == 2
    # a train_step made by hand is an update, not a batch of train's schedule
    d = scripted_trainer(tiny_config(group_size=2, update_times=1, num_epochs=1, log_interval=0))
    d.train_step(queries[:1], gold[:1])
    assert [h["step"] for h in d.train(queries, gold)] == [2, 3] and d.data_step == 2


def test_float16_trains_float32_master_weights_under_autocast():
    """dtype=float16 (what auto picks on a CUDA device without bf16), on CPU: the weights and AdamW's
    state stay float32, forward passes run in float16 with a gradient scaler; after updates every
    weight is finite and the policy moved. (float16 weights under AdamW turned NaN in one step.)"""
    trainer = GRPOTrainer(tiny_config(dtype="float16", update_times=2, learning_rate=1e-4),
                          search_engine=MockSearchEngine({"veltra": VELTRA}))  # loads the model itself
    install_script(trainer, QUERIES)
    trajectories = trainer.rollout(QUERIES)
    assert all(math.isfinite(lp) for t in trajectories for lp in t.old_log_probs)
    for t, a in zip(trajectories, (1.0, -1.0)):
        t.advantage = a
    before = trainer.recompute_log_probs(trajectories)
    m = trainer.update_policy(trajectories)
    assert m["skipped"] == 0 and math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in trainer.optimizer.state.values())
    after = trainer.recompute_log_probs(trajectories)
    # the update moved the policy: toward the +1 trajectory, away from the -1 one
    assert after[0].sum() > before[0].sum() and after[1].sum() < before[1].sum()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32} and trainer.scaler.is_enabled()


def test_prompt_longer_than_max_prompt_length_keeps_its_last_tokens():
    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    trainer = GRPOTrainer(tiny_config(max_prompt_length=40), search_engine=MockSearchEngine({}), model=model,
                          tokenizer=tokenizer)
    full = trainer.prompt_ids(QUERIES[0])
    assert len(full) > 40
    [t] = trainer.rollout([QUERIES[0]], max_tokens=6)
    assert t.full_input_ids[:40] == full[-40:] and len(t.token_steps) == 6
    assert [s.position for s in t.token_steps] == list(range(40, 46))
    # the trajectory is the sequence that was sampled: teacher forcing reproduces its log-probs
    assert torch.allclose(trainer.recompute_log_probs([t])[0], torch.tensor(t.old_log_probs), atol=1e-4)


def test_no_retriever_at_the_configured_url_fails_at_construction(retriever_server, start_retriever, monkeypatch):
    """search_backend=retriever with nothing at retriever_url: an error naming the fixes, not a run
    that trains on "search failed" observations."""
    dead = tiny_config(search_backend="retriever", retriever_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"retriever_url: retriever at http://127.0.0.1:9 is unreachable.*"
                                         r"retriever_server serve.*search_backend='synthetic'.*search_engine="):
        build_search_engine(dead)
    engine = build_search_engine(dead, check=False)  # what the check guards
    assert isinstance(engine, RetrieverClient) and engine.urls == ["http://127.0.0.1:9/retrieve"]
    live = build_search_engine(tiny_config(search_backend="retriever", retriever_url=retriever_server.base_url))
    [title] = corpus_titles(retriever_server.corpus_path, 1)
    assert live.batch_search([title])[0].startswith("Doc 1(Title:")
    monkeypatch.delenv("RETRIEVER_API_KEY", raising=False)
    keyed = start_retriever(retriever_server.index_dir, api_key="s3cret")
    with pytest.raises(ValueError, match="HTTP 401.*RETRIEVER_API_KEY"):
        build_search_engine(tiny_config(search_backend="retriever", retriever_url=keyed.base_url))
    monkeypatch.setenv("RETRIEVER_API_KEY", "s3cret")
    build_search_engine(tiny_config(search_backend="retriever", retriever_url=keyed.base_url))


def test_build_search_engine_from_config(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "k")
    web = build_search_engine(tiny_config(search_backend="web", web_provider="serper", topk=2))
    assert web.provider == "serper" and web.topk == 2


def test_update_policy_explains_itself_without_weights():
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # only the guard is under test here
    trainer.model, trainer.config = None, tiny_config(use_openai=True, openai_base_url="http://127.0.0.1:1")
    with pytest.raises(PolicyUpdateUnavailable, match="no gradient flows through an API"):
        trainer.update_policy([])
    assert VELTRA


def test_trainer_accepts_an_engine_with_search_only():
    """The notebook API's specification writes a SearchEngine with `search(query) -> str` alone."""
    from search_r1.grpo import SearchEngine

    class SpecEngine(SearchEngine):
        def __init__(self):
            self.asked = []

        def search(self, query: str) -> str:
            self.asked.append(query)
            return VELTRA

    model, tokenizer = load_model_and_tokenizer("tiny-random-qwen3")
    engine = SpecEngine()
    trainer = GRPOTrainer(tiny_config(), search_engine=engine, model=model, tokenizer=tokenizer)
    install_script(trainer, QUERIES)
    t = trainer.generate_trajectory(QUERIES[0])
    assert t.num_searches == 1 and engine.asked and "Veltra was founded by Ana Osk" in t.generated_text
