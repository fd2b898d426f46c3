"""The GRPO fit loop of the embedded CPU trainer (single controller: this process drives Ray workers).

One step, top to bottom (each phase timed under its name in `timing/*`):

    batch of B prompts (uid per prompt)
      -> repeat n, interleaved (uid kept: the GRPO group)                      (B*n rows)
      -> gen:          run_llm_loop, the policy sampling on the workers, searches on the retriever
      -> old_log_prob: log pi_old(response tokens)        (workers)
      -> ref:          log pi_ref(response tokens)        (workers)
      -> reward:       one scalar per trajectory from the response text, on its last generated token
      -> adv:          GRPO advantage within each uid group, broadcast over generated tokens
      -> update_actor: PPO-clip + K3 KL - entropy bonus over mini-batches (workers, data parallel)
      -> metrics, validation every test_freq steps, checkpoint every save_freq steps
      -> alarms (search_r1/trainer/alarms.py): warn, or stop / roll back (trainer.on_alarm, `_on_alarm`)

The worker group, search engine, data loaders and metrics logger are built by
`search_r1.trainer.main` and passed in, so tests can build small ones.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from verl import DataProto

from search_r1.algos import (broadcast_to_tokens, compute_grpo_advantages, leading_token_values, signal_group_rows,
                             zero_leading_tokens)
from search_r1.data.dataset import repeat_interleave
from search_r1.scoring import OVERALL, aggregate, score_response
from search_r1.rewards import check_format_correctness, em_score, get_reward_fn
from search_r1.rollout.generation import GenerationConfig, LLMGenerationManager
from search_r1.trainer.alarms import AlarmStop, RunAlarms
from search_r1.trainer.config import TrainConfig
from search_r1.trainer.metrics import per_source_training_metrics
from search_r1.trainer.workers import WorkerGroupGenerator, arrange_for_dp, worker_seconds

log = logging.getLogger(__name__)

# Tensors the workers need; everything else (text, stats) stays on the driver.
LOGPROB_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
UPDATE_KEYS = LOGPROB_KEYS + ["response_mask", "old_log_probs", "ref_log_prob", "rollout_log_probs", "advantages",
                              "correct"]
# Sampling seeds: step s, round r uses seed * SEED_STRIDE + s * ROUND_STRIDE + r (pure function of
# the step, so a resumed run samples exactly what the uninterrupted run would have).
SEED_STRIDE = 1_000_000
ROUND_STRIDE = 100


def _drop_meta(out: DataProto) -> DataProto:
    """A worker result without its timing metrics (union() refuses differing meta_info)."""
    out.meta_info.pop("metrics", None)
    return out


@contextmanager
def timed(timing: dict, name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


# trainer.time_budget_minutes's clock (a module attribute, so a scripted test can drive it)
_clock = time.monotonic


def budget_stop_reason(budget_s: float, elapsed_s: float, step_s: float, val_s: float) -> str | None:
    """Why the next step must not start under a wall-time budget, or None when it fits.

    It fits when elapsed_s + step_s + val_s <= budget_s: the step (estimated by the run's slowest so
    far, 0 before the first) and the final validation after it (estimated by the run's first one) end
    inside the budget. budget_s = 0 means no budget.
    """
    if budget_s <= 0 or elapsed_s + step_s + val_s <= budget_s:
        return None
    return (f"{elapsed_s / 60:.1f} min spent, a step takes up to {step_s:.0f} s and the final validation "
            f"about {val_s:.0f} s: together past the {budget_s / 60:g} min budget")


def _mean(xs) -> float:
    xs = list(xs)
    return float(np.mean(xs)) if xs else 0.0


class RayGRPOTrainer:
    """GRPO over a PolicyWorker group.

    Args:
        config: the validated TrainConfig.
        tokenizer: the policy's tokenizer (decodes actions and rewards on the driver).
        worker_group: a RayWorkerGroup of PolicyWorker (init_model already called).
        search_engine: a SearchEngine (RetrieverClient to the real server).
        train_loader: PromptDataLoader over the training prompts.
        val_dataset: PromptDataset of the test split (validation uses its first data.val_size rows).
        metrics_logger: MetricsLogger (console/jsonl/tensorboard/wandb) or None.
        checkpoint_root: directory of CheckpointManager checkpoints.
    """

    def __init__(self, config: TrainConfig, tokenizer, worker_group, search_engine, train_loader,
                 val_dataset, metrics_logger=None, checkpoint_root: str | Path | None = None, rollout=None,
                 anchor: list | None = None, started_at: float | None = None):
        self.cfg = config
        # the wall clock of trainer.time_budget_minutes (time.monotonic(); the caller's start, e.g.
        # before its warm-start, or this trainer's construction)
        self.started_at = _clock() if started_at is None else started_at
        self.tokenizer = tokenizer
        self.wg = worker_group
        self.search_engine = search_engine
        self.train_loader = train_loader
        self.val_dataset = val_dataset
        self.logger = metrics_logger
        self.checkpoint_root = Path(checkpoint_root or Path(config.trainer.output_dir) / "checkpoints")
        # rollout.backend=vllm: a VLLMRollout (search_r1/trainer/vllm_rollout.py) samples, re-synced
        # after every update; otherwise the workers' HFGenerator samples with the policy itself.
        self.rollout = rollout
        self.generator = rollout.generator if rollout is not None else WorkerGroupGenerator(worker_group)
        # trainer.val_sampler=hf: validation samples with the workers even when a vLLM server rolls out
        self._hf_val_generator = WorkerGroupGenerator(worker_group) if config.trainer.val_sampler == "hf" else None
        self.reward_fn = get_reward_fn(config.algorithm.reward)
        r = config.rollout
        self.gen_config = GenerationConfig(
            max_turns=r.max_turns, max_start_length=r.max_start_length, max_prompt_length=r.max_prompt_length,
            max_response_length=r.max_response_length, max_obs_length=r.max_obs_length,
            topk=config.retriever.topk, protocol=config.data.protocol, temperature=r.temperature,
            top_p=r.top_p, max_tokens_per_turn=r.max_tokens_per_turn, seed=None)
        self.n_mini_batches = config.trainer.batch_size // config.trainer.mini_batch_size
        self.old_is_current = (config.algorithm.old_log_prob == "auto" and self.n_mini_batches == 1
                               and config.trainer.ppo_epochs == 1)
        self.global_step = 0
        self.history: list[dict] = []  # every logged metrics dict, for the caller's summary
        self.alarms = RunAlarms(kl=config.trainer.kl_alarm, window=config.trainer.alarm_window)
        # trainer.on_alarm=rollback: rollbacks so far and the algorithm settings before any of them
        self.rollbacks = 0
        self._base_algorithm = config.algorithm
        # algorithm.anchor_coef: the workers keep the demonstrations; each update names its rows
        self.anchor_size = 0
        if config.algorithm.anchor_coef > 0:
            if not anchor:
                raise ValueError("algorithm.anchor_coef > 0 needs anchor demonstrations (main.anchor_demos)")
            self.anchor_size = self.wg.set_anchor(list(anchor))[0]

    def anchor_rows(self, step: int) -> list[int]:
        """The anchor demonstrations of step `step`: a sample without replacement, a function of
        (trainer.seed, step) only, so a resumed run draws what the uninterrupted one would."""
        if not self.anchor_size:
            return []
        k = self.cfg.algorithm.anchor_batch_size
        return random.Random(f"anchor/{self.cfg.trainer.seed}/{step}").sample(range(self.anchor_size), k)

    @property
    def val_generator(self):
        """The validation sampler: the workers' HF sampler (trainer.val_sampler=hf) or the rollout's."""
        return self._hf_val_generator or self.generator

    # -- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train for trainer.total_steps (continuing after a checkpoint when resuming)."""
        t = self.cfg.trainer
        start = self.maybe_resume()
        if self.rollout is not None:  # the server holds the warm-started weights; a resumed policy differs
            self.rollout.sync(self.wg)
        self._restore_alarms(start)
        summary: dict = {"resumed_from": start}
        if t.val_before_train and start == 0:
            summary["val_before"] = self._log(self.validate(0), step=0)
        last_saved = start
        if t.on_alarm == "rollback" and start == 0:  # a state to roll back to before the first saved step
            self.save_checkpoint(0)
        bar = tqdm(desc="GRPO", unit="step", initial=start, total=t.total_steps, dynamic_ncols=True)
        step = start
        slowest_step = 0.0
        while step < t.total_steps:
            val_s = next((h["timing/validate"] for h in self.history if "timing/validate" in h), 0.0)
            reason = budget_stop_reason(60 * t.time_budget_minutes, _clock() - self.started_at,
                                        slowest_step, val_s)
            if reason:
                bar.write(f"[trainer] time budget: stopping after step {step} of {t.total_steps} "
                          f"(trainer.time_budget_minutes={t.time_budget_minutes:g}: {reason})")
                summary["time_budget_stop"] = step
                break
            step += 1
            self.global_step = step
            batch = self.train_loader.next_batch()
            metrics = self.train_step(batch, step)
            slowest_step = max(slowest_step, metrics.get("timing/step", 0.0))
            if t.test_freq and step % t.test_freq == 0 and step != t.total_steps:
                metrics.update(self.validate(step))
            if t.on_alarm == "rollback":
                metrics["alarm/rollbacks"] = float(self.rollbacks)
            self._log(metrics, step)
            kl = metrics.get("actor/kl_loss")  # absent when the step's update was skipped (no signal)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl="skipped" if kl is None else f"{kl:.4f}")
            bar.update(1)
            if t.save_freq and step % t.save_freq == 0:
                summary["checkpoint"] = self.save_checkpoint(step)
                last_saved = step
            if self.alarms.fired and t.on_alarm != "warn":
                step = last_saved = self._on_alarm(step, last_saved)
                bar.n = step
                bar.refresh()
        bar.close()
        if t.time_budget_minutes and "time_budget_stop" not in summary:
            tqdm.write(f"[trainer] time budget: all {t.total_steps} steps fit in trainer.time_budget_minutes="
                       f"{t.time_budget_minutes:g} ({(_clock() - self.started_at) / 60:.1f} min spent before the "
                       f"final validation)")
        if self.global_step or start:
            final_step = max(self.global_step, start)
            summary["val_after"] = self._log(self.validate(final_step), step=final_step)
            if last_saved != final_step:
                summary["checkpoint"] = self.save_checkpoint(final_step)
        summary["history"] = self.history
        return summary

    def train_step(self, batch: DataProto, step: int) -> dict:
        """One GRPO step on a batch of prompts; returns its metrics."""
        timing: dict[str, float] = {}
        with timed(timing, "step"):
            rollout = self.generate_trajectory(batch, step, timing)
            metrics = self.grpo_step(rollout, timing, step)
        metrics.update({f"timing/{k}": v for k, v in timing.items()})
        # model compute = time inside the workers (sampling, forward, forward+backward+AdamW);
        # the rest is rollout bookkeeping, search, scoring and Ray dispatch/serialisation
        model_s = sum(timing.get(k, 0.0) for k in ("gen_worker", "old_log_prob_worker", "ref_worker",
                                                   "update_actor_worker"))
        metrics["perf/non_model_share"] = max(0.0, 1.0 - model_s / timing["step"])
        metrics["train/step"] = step
        metrics["train/epoch"] = self.train_loader.epoch
        return metrics

    def generate_trajectory(self, batch: DataProto, step: int, timing: dict) -> DataProto:
        """Repeat each prompt n times (interleaved, uid kept) and roll the group out with search."""
        gen_batch = repeat_interleave(batch, self.cfg.rollout.n)  # (B*n) rows: a,a,..,b,b,..
        seed = self.cfg.trainer.seed * SEED_STRIDE + step * ROUND_STRIDE
        manager = LLMGenerationManager(self.tokenizer, self.generator,
                                       dataclasses.replace(self.gen_config, seed=seed), self.search_engine)
        gen_before, worker_before = self.generator.seconds, self.generator.worker_seconds
        with timed(timing, "gen"):
            rollout = manager.run_llm_loop(gen_batch)
        timing["search"] = rollout.meta_info["timing"]["search_s"]
        timing["gen_model"] = self.generator.seconds - gen_before  # worker round trips incl. sampling
        timing["gen_worker"] = self.generator.worker_seconds - worker_before  # sampling alone
        return rollout

    def grpo_step(self, batch: DataProto, timing: dict, step: int = 0) -> dict:
        """rewards -> GRPO advantages -> (drop flat groups) -> old and ref log-probs -> policy update;
        returns metrics (reward and rollout statistics over every sampled trajectory)."""
        alg = self.cfg.algorithm
        with timed(timing, "reward"):
            scores, texts = self.score(batch, self.reward_fn)
            batch.batch["token_level_scores"] = self.place_on_last_token(scores, batch.batch["response_mask"])
            # correct responses (EM > 0) for the likelihood diagnostics (likelihood/*, workers.update_actor)
            golds = batch.non_tensor_batch["golden_answers"]
            ems = [em_score(t, list(g)) for t, g in zip(texts, golds)]
            batch.batch["correct"] = torch.tensor([float(e > 0) for e in ems])  # (N,)
        with timed(timing, "adv"):
            # the sum of token-level scores is the trajectory score (only the last token is non-zero)
            adv = compute_grpo_advantages(batch.batch["token_level_scores"].sum(-1), batch.non_tensor_batch["uid"],
                                          eps=alg.eps, std=alg.grpo_std)  # (N,)
            batch.batch["advantages"] = broadcast_to_tokens(adv, batch.batch["response_mask"])  # (N, R)
            if not alg.pg_first_turn:  # the plan turn keeps its KL term, loses its policy gradient
                batch.batch["advantages"] = zero_leading_tokens(batch.batch["advantages"],
                                                                batch.meta_info["first_turn_token_stats"])
            if alg.plan_kl != alg.kl_coef:  # per-token KL coefficients: plan_kl on the first round
                batch.batch["kl_weights"] = leading_token_values(
                    batch.batch["response_mask"].shape, batch.meta_info["first_turn_token_stats"],
                    lead=alg.plan_kl, rest=alg.kl_coef)
        # A row's signal is in its token advantages: with pg_first_turn=false a trajectory that ended in
        # its first round (answered without searching) has a non-zero advantage but no token carrying it.
        row_signal = batch.batch["advantages"].ne(0).any(-1).float()  # (N,) 1 = some token has A != 0
        train = batch
        if alg.drop_flat_groups:  # train on the groups with a signal only (and the forward passes too)
            rows = signal_group_rows(row_signal, batch.non_tensor_batch["uid"], self.n_mini_batches * self.wg.world_size)
            if 0 < len(rows) < len(batch):
                train = batch.select_idxs(rows)
        if self.old_is_current:  # one update per batch: the update's own forward gives pi_old
            train.batch["old_log_probs"] = torch.zeros_like(train.batch["responses"], dtype=torch.float32)
        else:
            with timed(timing, "old_log_prob"):
                out = self.wg.compute_log_prob(train.select(batch_keys=LOGPROB_KEYS))
            timing["old_log_prob_worker"] = worker_seconds(out)
            train = train.union(_drop_meta(out))
        # Reference log-probs feed only the update's KL term: when the workers will skip every
        # mini-batch (all advantages 0, algorithm.skip_zero_advantage), that forward pass is not needed.
        informative = bool(row_signal.any())
        if alg.uses_ref and (informative or not alg.skip_zero_advantage):
            with timed(timing, "ref"):
                out = self.wg.compute_ref_log_prob(train.select(batch_keys=LOGPROB_KEYS))
            timing["ref_worker"] = worker_seconds(out)
            train = train.union(_drop_meta(out))
        else:
            train.batch["ref_log_prob"] = train.batch["old_log_probs"].clone()
        with timed(timing, "update_actor"):
            keys = UPDATE_KEYS + (["kl_weights"] if "kl_weights" in train.batch.keys() else [])
            update = arrange_for_dp(train.select(batch_keys=keys), self.n_mini_batches, self.wg.world_size)
            update.meta_info["n_mini_batches"] = self.n_mini_batches
            update.meta_info["old_is_current"] = self.old_is_current
            update.meta_info["anchor_rows"] = self.anchor_rows(step)
            per_rank = self.wg.update_actor(update)  # identical actor/* metrics on every rank
        timing["update_actor_worker"] = max(m.pop("perf/update_worker_s") for m in per_rank)
        if self.rollout is not None and per_rank[0]["actor/skipped_updates"] < 1.0:  # else the weights did not change
            with timed(timing, "rollout_sync"):
                self.rollout.sync(self.wg)
        metrics = dict(per_rank[0])
        metrics.update(self.rollout_metrics(batch, scores, texts, ems))
        self._write_samples(batch, scores, texts)
        metrics["adv/abs_mean"] = float(adv.abs().mean())
        metrics["adv/zero_group_share"] = float((adv == 0).float().mean())
        # trajectories the update trained on (0 when every mini-batch was skipped for lack of a signal)
        metrics["train/trajectories_updated"] = 0.0 if metrics["actor/skipped_updates"] >= 1.0 else float(len(train))
        metrics.update(per_source_training_metrics(batch.non_tensor_batch["data_source"], ems, adv.tolist(), scores,
                                                   batch.meta_info["valid_search_stats"]))
        return metrics

    # -- rewards ------------------------------------------------------------------------------------
    def response_texts(self, batch: DataProto) -> list[str]:
        """Decoded responses (generated + observation tokens, no prompt, no padding)."""
        responses = batch.batch["responses"]
        lengths = batch.batch["attention_mask"][:, -responses.shape[1]:].sum(-1).tolist()
        return self.tokenizer.batch_decode([responses[i, :n].tolist() for i, n in enumerate(lengths)],
                                           skip_special_tokens=True)

    def score(self, batch: DataProto, fn) -> tuple[list[float], list[str]]:
        texts = self.response_texts(batch)
        golds = batch.non_tensor_batch["golden_answers"]
        return [float(fn(text, list(g))) for text, g in zip(texts, golds)], texts

    @staticmethod
    def place_on_last_token(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
        """(N, R) zeros with score_i on trajectory i's last generated token (mask == 1).

        A trajectory with no generated token (prompt too long to roll out) keeps all zeros.
        """
        n, r = response_mask.shape
        out = torch.zeros(n, r, dtype=torch.float32)
        idx = torch.arange(r).expand(n, r)
        last = torch.where(response_mask.bool(), idx, torch.full_like(idx, -1)).max(dim=1).values  # (N,)
        has = last >= 0
        out[has.nonzero().flatten(), last[has]] = torch.tensor(scores, dtype=torch.float32)[has]
        return out

    def rollout_metrics(self, batch: DataProto, scores: list[float], texts: list[str], ems: list[float]) -> dict:
        """Reward, environment and response statistics of a step (the rollout's stats: a missing
        key is a bug in the rollout, so it fails here instead of reading as 0)."""
        meta = batch.meta_info
        turns = np.asarray(meta["turns_stats"], dtype=float)
        valid = np.asarray(meta["valid_action_stats"], dtype=float)
        resp_len = batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1]:].sum(-1).float()
        return {
            "reward/mean": _mean(scores),
            "reward/std": float(np.std(scores)) if scores else 0.0,
            "reward/max": float(np.max(scores)) if scores else 0.0,
            "reward/em": _mean(ems),
            "reward/format_valid": _mean(check_format_correctness(t) > 0 for t in texts),
            "env/turns_mean": float(turns.mean()),
            "env/searches_mean": _mean(meta["valid_search_stats"]),
            "env/valid_action_ratio": float(valid.sum() / max(turns.sum(), 1.0)),
            "env/finish_ratio": 1.0 - _mean(meta["active_mask"]),
            "env/search_failures": float(sum(meta["search_failure_stats"])),
            "response/length_mean": float(resp_len.mean()),
            "response/length_max": float(resp_len.max()),
            "response/generated_tokens_mean": _mean(meta["generated_token_stats"]),
            "response/obs_tokens_mean": _mean(meta["observation_token_stats"]),
            "response/truncated_ratio": _mean(meta["truncated_mask"]),
        }

    # -- validation ---------------------------------------------------------------------------------
    def validate(self, step: int = 0) -> dict:
        """Greedy rollouts on the first data.val_size test prompts: EM / F1 / reward per data_source.

        Each question's record (the eval CLI's fields, plus `step`) is appended to
        val_predictions.jsonl in the output directory, so two validations compare question by question
        (`search_r1.evaluation.compare`: `Run.load_validations`, `changed`).
        """
        ds = self.val_dataset
        n = len(ds) if self.cfg.data.val_size == 0 else min(self.cfg.data.val_size, len(ds))
        bs = self.cfg.trainer.val_batch_size
        manager = LLMGenerationManager(self.tokenizer, self.val_generator, self.gen_config, self.search_engine,
                                       is_validation=True)
        records = []
        t0 = time.perf_counter()
        # leave=False: the bar disappears once done, the GRPO bar below it stays readable
        bar = tqdm(total=n, desc="validation", unit="q", leave=False, dynamic_ncols=True)
        for start in range(0, n, bs):
            out = manager.run_llm_loop(ds.collate(list(range(start, min(start + bs, n)))))
            bar.update(len(out))
            texts = self.response_texts(out)
            nt = out.non_tensor_batch
            for i, (text, gold, searches) in enumerate(zip(texts, nt["golden_answers"],
                                                            out.meta_info["valid_search_stats"])):
                gold = list(gold)
                # the eval CLI's scores; `reward` is the training reward (algorithm.reward), not the seed one
                records.append({"step": step, "id": str(nt["uid"][i]), "data_source": str(nt["data_source"][i]),
                                "question": nt["question"][i], "golden_answers": gold, **score_response(text, gold),
                                "searches": float(searches), "reward": float(self.reward_fn(text, gold)),
                                "response": text})
        bar.close()
        self._append_jsonl("val_predictions.jsonl", records)
        agg = aggregate(records)
        metrics: dict[str, float] = {f"val/{source}/{k}": float(v) for source, stats in agg["per_source"].items()
                                     for k, v in stats.items()}  # per-source n feeds the per-source alarm
        metrics.update({f"val/{k}": v for k, v in agg[OVERALL].items() if k != "n"})
        metrics["val/n"] = float(n)
        metrics["timing/validate"] = time.perf_counter() - t0
        return metrics

    # -- acting on alarms (trainer.on_alarm) ---------------------------------------------------------
    def _on_alarm(self, step: int, last_saved: int) -> int:
        """Stop or roll back after the alarms `self.alarms.fired` started at `step`; returns the step
        training continues after (the restored checkpoint's).

        stop: save a checkpoint (unless this step's is saved) and raise AlarmStop naming the alarms,
        the step and the checkpoint. rollback: restore the newest checkpoint of a step at or before
        step - trainer.alarm_window (saved before the alarm's window began; the run's step-0
        checkpoint at the latest), drop the newer ones (the abandoned branch), multiply the learning
        rate by trainer.rollback_lr_scale and the KL coefficients by trainer.rollback_kl_coef_scale,
        and rebuild the alarms from the steps up to the restored one. The redone steps draw the same
        prompts and sampling seeds (a function of the step), so they differ by the changed settings.
        With trainer.max_rollbacks spent, or no checkpoint old enough, it stops as `stop` does.
        """
        from search_r1.trainer.checkpoint import CheckpointManager

        t = self.cfg.trainer
        names = ", ".join(self.alarms.fired)
        why = f"alarm ({names}) at step {step}"
        target = None
        if t.on_alarm == "rollback":
            if self.rollbacks >= t.max_rollbacks:
                why += f"; the {t.max_rollbacks} rollbacks allowed (trainer.max_rollbacks) are spent"
            else:
                manager = CheckpointManager(self.checkpoint_root, keep_last=None)
                old = [(s, p) for s, p in manager.checkpoints() if s <= step - t.alarm_window]
                if old:
                    target = old[-1]
                else:
                    why += (f"; no checkpoint at or before step {step - t.alarm_window} (before the alarm's "
                            f"{t.alarm_window}-step window) is left: raise trainer.keep_last or lower trainer.save_freq")
        if target is None:
            path = self.save_checkpoint(step) if last_saved != step else str(self.checkpoint_root / f"global_step_{step}")
            message = f"stopping on {why} (trainer.on_alarm={t.on_alarm}); checkpoint {path}"
            tqdm.write(f"[trainer] {message}")
            raise AlarmStop(message)
        restored, path = target
        manager.discard_after(restored)
        self._load_checkpoint(path)
        self.rollbacks += 1
        lr = self._apply_rollback_scales(lr_factor=t.rollback_lr_scale)
        self.alarms = RunAlarms(kl=t.kl_alarm, window=t.alarm_window)
        self.history = [h for h in self.history if h["step"] <= restored]
        self._restore_alarms(0)
        self.alarms.replay(self.history)
        if self.rollout is not None:
            self.rollout.sync(self.wg)
        alg = self.cfg.algorithm
        message = (f"ROLLBACK {self.rollbacks}/{t.max_rollbacks} on {why}: restored step {restored} ({path}); "
                   f"lr x{t.rollback_lr_scale} -> {lr:.3g}, kl_coef x{t.rollback_kl_coef_scale} -> {alg.kl_coef:.3g}")
        tqdm.write(f"[trainer] {message}")
        log.warning(message)
        self.global_step = restored
        return restored

    def _apply_rollback_scales(self, lr_factor: float) -> float:
        """Set the KL coefficients to the run's base ones x rollback_kl_coef_scale ** rollbacks (on the
        driver, which builds per-token KL weights, and on the workers) and multiply the workers' lr by
        `lr_factor` (the optimizer and scheduler state carry it on). Returns the new lr."""
        t, base = self.cfg.trainer, self._base_algorithm
        k = t.rollback_kl_coef_scale ** self.rollbacks
        alg = dataclasses.replace(base, kl_coef=base.kl_coef * k,
                                  plan_kl_coef=None if base.plan_kl_coef is None else base.plan_kl_coef * k)
        self.cfg = dataclasses.replace(self.cfg, algorithm=alg)
        return self.wg.rescale(lr_factor, alg.kl_coef)[0]

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> str:
        from search_r1.trainer.checkpoint import capture_rng_state

        extra = {"step": step, "config": self.cfg.to_dict(), "reference": self.wg.reference_identity()[0],
                 "rollbacks": self.rollbacks}
        paths = self.wg.save_checkpoint(str(self.checkpoint_root), step, self.cfg.trainer.keep_last, extra,
                                        self.train_loader.state_dict(), capture_rng_state())
        return paths[0]

    def _restore_alarms(self, start: int) -> None:
        """Give the alarms the validation to compare with (trainer.val_baseline) and, after a resume,
        this run's logged steps up to the checkpoint, so they judge the run as a whole."""
        from search_r1.trainer.alarms import first_validation, read_history

        if self.cfg.trainer.val_baseline:
            self.alarms.set_baseline(first_validation(Path(self.cfg.trainer.val_baseline).expanduser()))
        own = getattr(self.logger, "jsonl_path", None)
        if start and own is not None and Path(own).is_file():
            self.alarms.replay(read_history(own, upto_step=start))

    def maybe_resume(self) -> int:
        """Load the checkpoint trainer.resume points at; returns the step it ends (0 = fresh start)."""
        from search_r1.trainer.checkpoint import CheckpointManager, read_extra_state

        resume = self.cfg.trainer.resume
        if resume == "none":
            return 0
        if resume == "auto":
            if not self.checkpoint_root.is_dir():
                return 0
            path = CheckpointManager(self.checkpoint_root, keep_last=self.cfg.trainer.keep_last).latest()
            if path is None:
                return 0
        else:
            path = Path(resume).expanduser()
        self.check_resumable(path)
        step = self._load_checkpoint(path)
        rollbacks = int(read_extra_state(path).get("rollbacks", 0))
        if rollbacks:  # the lr is in the optimizer state; the KL coefficients follow the count
            self.rollbacks = rollbacks
            self._apply_rollback_scales(lr_factor=1.0)
        log.warning("resumed from %s (step %d)", path, step)
        self.global_step = step
        return step

    def _load_checkpoint(self, path) -> int:
        """Weights, optimizer, scheduler, data-loader position and RNG from `path`; returns its step."""
        from search_r1.trainer.checkpoint import restore_rng_state

        state = self.wg.load_checkpoint(str(path))[0]
        if state["dataloader"] is not None:
            self.train_loader.load_state_dict(state["dataloader"])
        if state["rng"] is not None:
            restore_rng_state(state["rng"])
        return int(state["step"])

    def check_resumable(self, path: Path) -> None:
        """Refuse to resume when the saved state would override a changed setting, or the KL
        reference is not the one the run was trained against (ValueError naming key, values, fix)."""
        from search_r1.trainer.checkpoint import read_extra_state
        from search_r1.trainer.config import resume_conflicts

        extra = read_extra_state(path)
        new = self.cfg.to_dict()
        problems = resume_conflicts(extra.get("config", {}), new)
        saved_ref, ref = extra.get("reference"), self.wg.reference_identity()[0]
        if saved_ref is not None and ref is not None and saved_ref != ref and not problems:
            # same settings, other weights: the warm-start cache or the model directory was rebuilt
            problems.append(f"KL reference: saved {saved_ref['path']} (sha256 {saved_ref['sha256'][:12]}), "
                            f"new {ref['path']} (sha256 {ref['sha256'][:12]}) (the reference model's weights "
                            f"changed: model.name={new['model']['name']!r}, warmstart.enabled="
                            f"{new['warmstart']['enabled']}; a rebuilt warm-start cache under "
                            f"$SEARCH_R1_HOME/warmstart or a changed model directory)")
        if problems:
            raise ValueError(
                f"cannot resume from {path}: these settings differ from the run's saved ones, which the "
                f"checkpoint would override or which define the KL reference:\n  - " + "\n  - ".join(problems)
                + f"\nFix: set them back to the saved values to continue the run, or start a new run "
                f"(trainer.experiment_name=NEW, a new output directory; or trainer.resume=none)")

    def _write_samples(self, batch: DataProto, scores: list[float], texts: list[str], k: int = 2) -> None:
        """Append the first k trajectories of the step to samples.jsonl (what the policy writes)."""
        nt = batch.non_tensor_batch
        self._append_jsonl("samples.jsonl", [
            {"step": self.global_step, "uid": str(nt["uid"][i]),
             "question": str(nt["question"][i]) if "question" in nt else None,
             "golden_answers": list(nt["golden_answers"][i]), "score": scores[i], "response": texts[i]}
            for i in range(min(k, len(texts)))])

    def _append_jsonl(self, name: str, records: list[dict]) -> None:
        """Append records to `name` in the output directory (nothing when there is none)."""
        out = Path(self.cfg.trainer.output_dir)
        if out.is_dir():
            with open(out / name, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)

    def _log(self, metrics: dict, step: int) -> dict:
        for message in self.alarms.check(metrics):  # adds alarm/* to metrics
            tqdm.write(f"[trainer] step {step}: {message}")
            log.warning("step %d: %s", step, message)
        # non-finite values are kept: MetricsLogger records them as null and warns, tests catch them
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating))}
        self.history.append({"step": step, **clean})
        if self.logger is not None:
            self.logger.log(clean, step=step)
        return clean
