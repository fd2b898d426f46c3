"""The GRPO step with known rewards, checked exactly: a scripted policy answers right or wrong, the
real workers (in-process) score and update, and the advantages, the loss and the reward metrics are
the hand-computed numbers. Also: scores sit on the last generated token, and resuming refuses
settings the checkpoint would override and a KL reference that is not the run's.
Model: tiny-random-qwen3; retriever: the real server (no search is made: one round, answers only)."""
import json
import math

import pytest
import torch

from search_r1.trainer.config import TrainConfig
from search_r1.trainer.ray_trainer import RayGRPOTrainer
from search_r1.trainer.workers import PolicyWorker
from tests.search_r1.rollout.scripted import ScriptedGenerator

MODEL = "tiny-random-qwen3"
ONE_TO_ALL = {"init_model", "save_checkpoint", "load_checkpoint", "reference_identity", "update_actor", "set_anchor"}


class InProcessGroup:
    """A one-rank worker group in this process: verl's dispatch for world size 1 (DP_COMPUTE_PROTO
    returns the rank's DataProto; ONE_TO_ALL and DP_COMPUTE_METRIC a list with one result)."""

    world_size = 1

    def __init__(self, worker: PolicyWorker):
        self.worker = worker

    def __getattr__(self, name):
        fn = getattr(self.worker, name)
        return (lambda *a, **k: [fn(*a, **k)]) if name in ONE_TO_ALL else fn


def config(world, out, **sections) -> TrainConfig:
    raw = {
        "model": {"name": MODEL, "compute_dtype": "float32", "rollout_dtype": "float32"},
        "data": {"train_files": [str(world / "train.parquet")], "test_files": [str(world / "test.parquet")]},
        "rollout": {"n": 2, "max_turns": 0, "max_tokens_per_turn": 32},
        "algorithm": {"reward": "em", "kl_coef": 0.01, "entropy_coef": 0.0},
        "trainer": {"batch_size": 2, "mini_batch_size": 2, "micro_batch_size": 2, "output_dir": str(out),
                    "threads_per_worker": 1, "resume": "auto"},
        "warmstart": {"enabled": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return TrainConfig.from_dict(raw)


@pytest.fixture
def make_trainer(local_worker_factory, synth_world, retriever_server, tmp_path):
    from search_r1.data.dataset import PromptDataLoader, PromptDataset
    from search_r1.models import load_tokenizer
    from search_r1.search import RetrieverClient
    from search_r1.trainer.main import worker_spec

    tokenizer = load_tokenizer(MODEL)
    workers = {}

    def make(cfg: TrainConfig, rollout=None, anchor=None) -> RayGRPOTrainer:
        spec = worker_spec(cfg)
        if spec not in workers:  # same spec, same freshly loaded weights: reuse the worker
            workers[spec] = local_worker_factory(spec)
        ds = PromptDataset([str(synth_world / "train.parquet")], tokenizer, cfg.data.max_prompt_length)
        loader = PromptDataLoader(ds, cfg.trainer.batch_size, seed=cfg.trainer.seed, shuffle=True, drop_last=True)
        return RayGRPOTrainer(cfg, tokenizer, InProcessGroup(workers[spec]), RetrieverClient(retriever_server.url),
                              loader, ds, checkpoint_root=tmp_path / "checkpoints", rollout=rollout, anchor=anchor)

    return make


SEARCHES = ["<search> who was it </search>", "<search> a longer query about it all </search>"]


def scripted_turns_step(trainer: RayGRPOTrainer, scripts):
    """One train_step where `scripts(golds)` gives, per prompt, the turn texts its two samples play
    (round 1 serves turns 0 and 1, one per sample, round 2 turns 2 and 3); returns (metrics, batch,
    the scripts played, the token count of a text)."""
    batch = trainer.train_loader.next_batch()
    golds = [list(g)[0] for g in batch.non_tensor_batch["golden_answers"]]
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.batch["input_ids"], batch.batch["attention_mask"])]
    texts = scripts(golds)
    gen = ScriptedGenerator(trainer.tokenizer, prompts, texts)
    gen.seconds = gen.worker_seconds = 0.0  # WorkerGroupGenerator's timing counters
    trainer.generator = gen
    metrics = trainer.train_step(batch, step=1)
    return metrics, batch, texts, lambda text: len(trainer.tokenizer(text, add_special_tokens=False)["input_ids"])


def scripted_step(trainer: RayGRPOTrainer, all_right: bool = False):
    """One train_step where, per prompt, the first sample answers with the gold answer and the second
    answers it for prompt 0 only ("nothing" for prompt 1): em rewards [1, 0 | 1, 1] ([1, 1 | 1, 1]
    with all_right)."""
    def scripts(golds):
        return [[f"<answer> {golds[0]} </answer>", f"<answer> {golds[0] if all_right else 'nothing'} </answer>"],
                [f"<answer> {golds[1]} </answer>", f"<answer> {golds[1]} </answer>"]]

    metrics, batch, texts, n = scripted_turns_step(trainer, scripts)
    return metrics, [n(t) for row in texts for t in row], [str(s) for s in batch.non_tensor_batch["data_source"]]


def test_place_on_last_token_puts_each_score_on_the_last_generated_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0],   # generated, observation, generated, padding
                         [1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0]])  # nothing generated: no score anywhere
    out = RayGRPOTrainer.place_on_last_token([2.0, -1.0, 5.0], mask)
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 5] = 2.0, -1.0
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("std, eps", [("population", 1e-8), ("unbiased", 0.5)])
def test_grpo_step_with_known_rewards_gives_the_hand_computed_advantages_and_loss(make_trainer, synth_world,
                                                                                   tmp_path, std, eps):
    trainer = make_trainer(config(synth_world, tmp_path, algorithm={"grpo_std": std, "eps": eps}))
    m, tokens, sources = scripted_step(trainer)
    # em rewards [1, 0 | 1, 1]; group 0: mean 0.5, deviations +-0.5, std 0.5 (population) or
    # sqrt(0.5) (unbiased, n - 1 = 1); group 1 is constant: advantage 0 for both samples
    a = 0.5 / ((0.5 if std == "population" else math.sqrt(0.5)) + eps)
    adv = [a, -a, 0.0, 0.0]
    assert m["reward/mean"] == 0.75 and m["reward/em"] == 0.75 and m["reward/format_valid"] == 1.0  # a bare answer block is well formed
    assert m["adv/abs_mean"] == pytest.approx(2 * a / 4, rel=1e-6)
    assert m["adv/zero_group_share"] == 0.5
    # per data source: prompt 0 (em [1, 0], informative) and prompt 1 (em [1, 1], uniform group)
    if sources[0] == sources[1]:
        expected = {sources[0]: (0.75, 0.5)}
    else:
        expected = {sources[0]: (0.5, 0.0), sources[1]: (1.0, 1.0)}
    for source, (em, zero) in expected.items():
        assert (m[f"reward/{source}/em"], m[f"adv/{source}/zero_group_share"]) == (em, zero), source
        # bare answers: no search, so every trajectory falls in the zero-search split
        assert (m[f"env/{source}/searches_mean"], m[f"env/{source}/share_searches0"]) == (0.0, 1.0), source
        assert m[f"reward/{source}/em_searches0"] == em and f"env/{source}/share_searches1" not in m, source
    # first update on-policy (ratio 1) and the reference is the policy: pg = -token_mean(A), KL 0
    assert m["actor/update_tokens"] == sum(tokens)
    assert m["actor/pg_loss"] == pytest.approx(-sum(x * n for x, n in zip(adv, tokens)) / sum(tokens), rel=1e-5)
    assert m["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9)
    assert m["actor/pg_clipfrac"] == 0.0
    # fp32 sampler = trainer: the scripted log-probs are not the model's, and the metric says so
    assert m["training/rollout_log_probs_diff_max"] > 1.0


def test_a_resumed_run_and_a_baseline_give_the_alarms_the_validation_before_training(make_trainer, synth_world,
                                                                                      tmp_path):
    from search_r1.trainer.metrics import MetricsLogger

    run = tmp_path / "run"
    logger = MetricsLogger(run, loggers=["jsonl"])
    for step, record in [(0, {"val/em": 0.6, "val/n": 64.0}), (1, {"reward/em": 0.5}), (2, {"reward/em": 0.5}),
                         (3, {"reward/em": 0.1, "val/em": 0.1, "val/n": 64.0})]:  # after the checkpoint
        logger.log(record, step)
    logger.close()
    # resumed from the step-2 checkpoint: steps 0-2 replayed, step 3 (to be redone) not
    trainer = make_trainer(config(synth_world, run))
    trainer.logger = MetricsLogger(run, loggers=["jsonl"])
    trainer._restore_alarms(2)
    assert [m["reward/em"] for m in trainer.alarms._train] == [0.5, 0.5]
    got = trainer.alarms.check({"val/em": 0.1, "val/n": 64.0})
    assert len(got) == 1 and "first validation's 0.600" in got[0], got
    # a fresh run that does not validate before training, given that run as its baseline
    other = make_trainer(config(synth_world, tmp_path / "seed1",
                                trainer={"val_baseline": str(run), "val_before_train": False}))
    other._restore_alarms(0)
    got = other.alarms.check({"val/em": 0.1, "val/n": 64.0})
    assert len(got) == 1 and "first validation's 0.600" in got[0], got
    trainer.logger.close()


def test_resume_applies_free_settings_and_refuses_state_bound_ones(make_trainer, synth_world, tmp_path):
    trainer = make_trainer(config(synth_world, tmp_path))
    path = trainer.save_checkpoint(3)
    saved = json.loads((tmp_path / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    ref = saved["extra_state"]["reference"]
    assert ref["path"].endswith(MODEL) and len(ref["sha256"]) == 64
    # steps, logging, validation and the algorithm apply to the resumed run
    free = make_trainer(config(synth_world, tmp_path, trainer={"total_steps": 40, "test_freq": 5},
                               algorithm={"kl_coef": 0.02}))
    assert free.maybe_resume() == 3
    # lr (AdamW state), batch shape (data loader) and seed: refused, naming key, both values and the fix
    for sections, key, old, new in [({"optim": {"lr": 2e-5}}, "optim.lr", "3e-06", "2e-05"),
                                    ({"trainer": {"batch_size": 4, "mini_batch_size": 4}}, "trainer.batch_size", "2", "4"),
                                    ({"rollout": {"n": 4}}, "rollout.n", "2", "4"),
                                    ({"warmstart": {"steps": 7}}, "warmstart.steps", "6", "7")]:
        with pytest.raises(ValueError) as err:
            make_trainer(config(synth_world, tmp_path, **sections)).maybe_resume()
        msg = str(err.value)
        assert f"{key}: saved {old}, new {new}" in msg, msg
        assert "trainer.resume=none" in msg and "experiment_name" in msg
    # same settings, other reference weights (a rebuilt warm-start cache): refused
    state_file = tmp_path / "checkpoints" / "global_step_3" / "trainer_state.json"
    saved["extra_state"]["reference"]["sha256"] = "0" * 64
    state_file.write_text(json.dumps(saved))
    marker = tmp_path / "checkpoints" / "global_step_3" / "COMPLETE"
    manifest = json.loads(marker.read_text())
    manifest["files"]["trainer_state.json"] = state_file.stat().st_size
    marker.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"KL reference: saved .*sha256 000000000000"):
        make_trainer(config(synth_world, tmp_path)).maybe_resume()
    assert path.endswith("global_step_3")


def test_a_missing_rollout_stat_is_an_error_not_a_zero(make_trainer, synth_world, tmp_path):
    from verl import DataProto

    trainer = make_trainer(config(synth_world, tmp_path))
    batch = DataProto.from_dict({"responses": torch.ones(1, 2, dtype=torch.long),
                                 "attention_mask": torch.ones(1, 4, dtype=torch.long)},
                                non_tensors={"golden_answers": _objects([["x"]])},
                                meta_info={"valid_action_stats": [1]})  # turns_stats missing
    with pytest.raises(KeyError, match="turns_stats"):
        trainer.rollout_metrics(batch, [1.0], ["<answer> x </answer>"], [1.0])


def _objects(values):
    import numpy as np

    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


@pytest.mark.parametrize("skip", [True, False])
def test_a_step_whose_groups_all_scored_alike_does_not_update(make_trainer, synth_world, tmp_path, skip):
    trainer = make_trainer(config(synth_world, tmp_path, algorithm={"skip_zero_advantage": skip}))
    m, _, _ = scripted_step(trainer, all_right=True)
    assert m["adv/zero_group_share"] == 1.0
    assert m["actor/skipped_updates"] == (1.0 if skip else 0.0)
    assert m["train/trajectories_updated"] == (0.0 if skip else 4.0)
    # the reference forward only feeds the skipped update's KL term: not run when skipping
    assert ("timing/ref" in m) == (not skip)


def test_drop_flat_groups_updates_on_the_informative_group_only(make_trainer, synth_world, tmp_path):
    trainer = make_trainer(config(synth_world, tmp_path, algorithm={"drop_flat_groups": True}))
    m, tokens, _ = scripted_step(trainer)
    # em rewards [1, 0 | 1, 1]: group 1 is flat, so the update (and its reference forward) sees
    # group 0's two trajectories only, while the reward metrics still cover all four samples
    assert m["reward/mean"] == 0.75 and m["adv/zero_group_share"] == 0.5
    assert m["train/trajectories_updated"] == 2.0
    assert m["actor/update_tokens"] == tokens[0] + tokens[1]
    # advantages +1, -1 (population std 0.5): pg = -token_mean over group 0's tokens only
    assert m["actor/pg_loss"] == pytest.approx(-(tokens[0] - tokens[1]) / (tokens[0] + tokens[1]), rel=1e-5, abs=1e-7)
    assert m["actor/skipped_updates"] == 0.0 and "timing/ref" in m


@pytest.mark.parametrize("pg_first_turn", [True, False])
def test_pg_first_turn_false_trains_only_the_rounds_after_the_first(make_trainer, synth_world, tmp_path,
                                                                    pg_first_turn):
    trainer = make_trainer(config(synth_world, tmp_path, rollout={"max_turns": 1},
                                  algorithm={"pg_first_turn": pg_first_turn}))

    # Each sample searches, reads the real retriever's passages, then answers. em rewards [1, 0 | 1, 1].
    def scripts(golds):
        return [SEARCHES + [f"<answer> {golds[0]} </answer>", "<answer> nothing at all </answer>"],
                SEARCHES + [f"<answer> {golds[1]} </answer>", f"<answer> {golds[1]} </answer>"]]

    m, batch, texts, n = scripted_turns_step(trainer, scripts)
    first, answers = [n(SEARCHES[0]), n(SEARCHES[1])] * 2, [n(t) for row in texts for t in row[2:]]
    assert m["reward/mean"] == 0.75 and m["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9)
    # every sample searched once: the per-source split by searches reads the rollout's search counts
    for source in set(map(str, batch.non_tensor_batch["data_source"])):
        assert (m[f"env/{source}/searches_mean"], m[f"env/{source}/share_searches1"]) == (1.0, 1.0), source
    # every generated token is in the update and its normaliser; the observations are not
    assert m["actor/update_tokens"] == sum(first) + sum(answers)
    # group 0: advantages +1 (sample 0), -1 (sample 1); with the first round left out, only the
    # answer tokens carry them
    signed = [first[0] + answers[0], -(first[1] + answers[1])] if pg_first_turn else [answers[0], -answers[1]]
    assert m["actor/pg_loss"] == pytest.approx(-sum(signed) / (sum(first) + sum(answers)), rel=1e-5)


@pytest.mark.parametrize("plan_kl_coef", [None, 0.5])
def test_plan_kl_coef_weights_the_first_rounds_kl_apart_from_the_rest(make_trainer, synth_world, tmp_path,
                                                                      plan_kl_coef):
    trainer = make_trainer(config(synth_world, tmp_path, rollout={"max_turns": 1},
                                  algorithm={"pg_first_turn": False, "plan_kl_coef": plan_kl_coef}))
    seen = []
    update = trainer.wg.worker.update_actor
    trainer.wg.worker.update_actor = lambda data: seen.append(data) or update(data)

    def scripts(golds):
        return [SEARCHES + [f"<answer> {golds[0]} </answer>", "<answer> nothing at all </answer>"],
                SEARCHES + [f"<answer> {golds[1]} </answer>", f"<answer> {golds[1]} </answer>"]]

    m, _, _, n = scripted_turns_step(trainer, scripts)
    assert m["actor/skipped_updates"] == 0.0 and len(seen) == 1
    data = seen[0].batch
    if plan_kl_coef is None:  # one coefficient for every token: the worker's kl_coef, no per-token key
        assert "kl_weights" not in data.keys()
        return
    # each row's first round (its search) carries plan_kl_coef, every later token kl_coef (0.01)
    first = torch.tensor([n(SEARCHES[0]), n(SEARCHES[1])] * 2)
    cols = torch.arange(data["kl_weights"].shape[1])[None, :]
    expected = torch.where(cols < first[:, None], torch.tensor(0.5), torch.tensor(0.01))
    torch.testing.assert_close(data["kl_weights"], expected, atol=0, rtol=0)


def test_drop_flat_groups_reads_token_advantages_when_the_first_round_is_left_out(make_trainer, synth_world,
                                                                                   tmp_path):
    """pg_first_turn=false zeroes a trajectory's first round; a group whose samples all answered in
    that round carries no token advantage, so drop_flat_groups must drop it (it used to keep it on
    its non-zero sequence advantages, adding its KL term and tokens to the update)."""
    trainer = make_trainer(config(synth_world, tmp_path, rollout={"max_turns": 1},
                                  algorithm={"pg_first_turn": False, "drop_flat_groups": True}))
    # prompt 0: both samples answer at once, right and wrong (em [1, 0]: sequence advantages +-1, all
    # in the first round); prompt 1: both search, then answer right and wrong (advantages on the answers)
    def scripts(golds):
        return [[f"<answer> {golds[0]} </answer>", "<answer> nothing at all </answer>"],
                SEARCHES + [f"<answer> {golds[1]} </answer>", "<answer> nothing at all </answer>"]]

    m, _, texts, n = scripted_turns_step(trainer, scripts)
    assert m["reward/mean"] == 0.5 and m["adv/zero_group_share"] == 0.0  # both groups have sequence signal
    assert m["train/trajectories_updated"] == 2.0  # ... but only prompt 1's trajectories carry it on tokens
    assert m["actor/update_tokens"] == sum(map(n, texts[1]))


class AnsweringServer:
    """Stands in for a VLLMRollout's generator: answers every context with one fixed text."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.seconds = self.worker_seconds = 0.0
        self.calls = 0

    def generate(self, prompts, params):
        from search_r1.rollout.backends import GenOutput

        self.calls += 1
        return [GenOutput(token_ids=list(self.ids), logprobs=[0.0] * len(self.ids), finish_reason="stop")
                for _ in prompts]


@pytest.mark.parametrize("val_sampler", ["rollout", "hf"])
def test_val_sampler_hf_validates_with_the_workers_while_a_server_rolls_out(make_trainer, synth_world, tmp_path,
                                                                            val_sampler):
    from types import SimpleNamespace

    from search_r1.models import load_tokenizer

    cfg = config(synth_world, tmp_path, data={"val_size": 4}, trainer={"val_batch_size": 4, "val_sampler": val_sampler},
                 rollout={"max_tokens_per_turn": 8})
    server = AnsweringServer(load_tokenizer(MODEL), "<answer> rollout server </answer>")
    trainer = make_trainer(cfg, rollout=SimpleNamespace(generator=server))
    assert trainer.generator is server  # training always samples from the rollout's server
    worker = trainer.wg.worker
    worker_calls = []
    real = worker.generate_sequences
    worker.generate_sequences = lambda data: worker_calls.append(len(data)) or real(data)
    try:
        m = trainer.validate()
    finally:
        del worker.generate_sequences
    assert m["val/n"] == 4.0
    responses = [json.loads(line)["response"] for line in (tmp_path / "val_predictions.jsonl").open()]
    assert len(responses) == 4  # every validated question recorded, with what the judge sampled
    if val_sampler == "rollout":  # one call for the 4 rows, which all answer at once; no worker sampling
        assert (server.calls, worker_calls) == (1, [])
        assert all(r.startswith("<answer> rollout server") for r in responses), responses
    else:  # the workers' HF sampler served every row of the first round; the server was not asked
        assert server.calls == 0 and worker_calls[0] == 4
        assert not any("rollout server" in r for r in responses), responses


def test_anchor_demonstrations_join_every_update_drawn_by_seed_and_step(make_trainer, synth_world, tmp_path,
                                                                        retriever_server):
    """algorithm.anchor_coef: the pool is built from the warm-start's training files in its format,
    single-hop only by default; each step's update names anchor_batch_size rows, a function of
    (trainer.seed, step) alone (a resumed run draws the same), and reports their NLL."""
    from types import SimpleNamespace

    from search_r1.search import RetrieverClient
    from search_r1.trainer.main import anchor_demos

    cfg = config(synth_world, tmp_path, rollout={"max_turns": 1, "max_tokens_per_turn": 64, "max_obs_length": 64},
                 algorithm={"anchor_coef": 1.0, "anchor_examples": 6, "anchor_batch_size": 3})
    from search_r1.models import load_tokenizer

    pool = anchor_demos(cfg, SimpleNamespace(train_files=[synth_world / "train.parquet"]),
                        RetrieverClient(retriever_server.url), load_tokenizer(MODEL))
    assert 3 <= len(pool) <= 6 and all(d.hops == 1 and "<search>" in d.response_text for d in pool)
    again = make_trainer(cfg, anchor=pool)
    assert again.anchor_size == len(pool)
    assert again.anchor_rows(1) == again.anchor_rows(1) and len(set(again.anchor_rows(1))) == 3
    assert any(again.anchor_rows(1) != again.anchor_rows(s) for s in range(2, 6))
    seen = []
    update = again.wg.worker.update_actor
    again.wg.worker.update_actor = lambda data: seen.append(data.meta_info) or update(data)
    m, _, _ = scripted_step(again)
    assert seen[0]["anchor_rows"] == again.anchor_rows(1)
    assert m["actor/anchor_loss"] > 0
    with pytest.raises(ValueError, match="anchor demonstrations"):
        make_trainer(cfg, anchor=[])
