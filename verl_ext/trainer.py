"""The `search_r1` trainer mode: verl's v1 sync trainer plus what Search-R1 runs need.

Select it with `trainer.v1.trainer_mode=search_r1` (configs/grpo_verl.yaml does). verl's `fit()`
loop, workers and weight sync are untouched; this subclass only adds, per step and per validation:

- search statistics from the agent loop (`extra_fields["search_r1"]`, verl_ext/agent_loop.py), under
  the embedded CPU trainer's names: `env/turns_mean`, `env/searches_mean`, `env/valid_action_ratio`,
  `env/finish_ratio`, `env/search_failures`, `response/truncated_ratio`, `prompt/cut_ratio`, ...;
- likelihood diagnostics (arXiv 2512.04220; `likelihood_diagnostics`): the mean per-token log-likelihood
  of correct (EM > 0) and incorrect responses under the actor before this step's update (pi_old,
  `likelihood/*_logp_old`) and under the sampler (`likelihood/*_logp_rollout`, when the rollout
  returns log-probs), and the share of non-negative-advantage responses the sampler rated likelier
  than the actor (`likelihood/preserved_fell_frac_old_vs_rollout`). The actor's log-probs after the
  update exist only inside verl's update; the policy loss `search_r1_llds` reports what it sees there
  (`likelihood/preserved_fell_frac`, pi_theta at each micro-batch's update against pi_old);
- `sync/unsynced_log_ppl_abs_diff`: verl's `rollout_corr/log_ppl_abs_diff` computed against the
  reference policy's log-probs instead of the rollout's (`unsynced_rollout_metrics`);
- validation EM / F1 per `data_source` as `val/<source>/em`, `val/<source>/f1` and pooled `val/em`,
  `val/f1` (beside verl's `val-core/...`, `val-aux/...`), and a table of every validation so far,
  printed after each validation and at the end of training.

verl compares its trainer mode with "sync" in several places (replay buffer, data refill, checkpoint
resume); this mode must behave exactly as sync there, so `trainer_mode` always reads "sync".
"""
from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import torch
import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from search_r1.algos import likelihood_metrics, likelihood_sums

log = logging.getLogger(__name__)

MODE_NAME = "search_r1"


def search_metrics(stats: list[dict]) -> dict[str, float]:
    """Step metrics from the agent loop's per-trajectory `search_r1` stats (one dict per trajectory).

    Means are over trajectories; `env/valid_action_ratio` = valid actions / turns and
    `env/search_failure_rate` = failed / issued searches over the whole batch.
    """
    if not stats:
        return {}

    def col(key):
        return np.asarray([s.get(key, 0) for s in stats], dtype=float)

    turns, searches, failures = col("turns"), col("valid_searches"), col("search_failures")
    return {
        "env/turns_mean": float(turns.mean()),
        "env/searches_mean": float(searches.mean()),
        "env/valid_action_ratio": float(col("valid_actions").sum() / max(turns.sum(), 1.0)),
        "env/finish_ratio": float(col("answered").mean()),
        "env/search_failures": float(failures.sum()),
        "env/search_failure_rate": float(failures.sum() / max(searches.sum(), 1.0)),
        "response/generated_tokens_mean": float(col("generated_tokens").mean()),
        "response/obs_tokens_mean": float(col("observation_tokens").mean()),
        "response/truncated_ratio": float(col("truncated").mean()),
        "response/overshoot_tokens": float(col("overshoot_tokens").sum()),
        "response/shortened_observations": float(col("shortened_observations").sum()),
        # prompts longer than rollout.prompt_length, rolled out on their last prompt_length tokens
        "prompt/cut_ratio": float((col("prompt_cut") > 0).mean()),
    }


class SearchOutage(RuntimeError):
    """Every search of a training step failed: the run stops instead of training without retrieval."""


def search_outage(stats: list[dict], step: int, urls) -> str | None:
    """The reason to stop when a step issued searches and every one of them failed (else None).

    A step without retrieval still gets rewards and an update, so a run would go on, teaching the
    policy that searching yields nothing; the usual causes (a key the workers did not get, a
    retriever unreachable from the worker nodes) hold for every later step too.
    """
    issued = sum(int(s.get("valid_searches", 0)) for s in stats)
    failed = sum(int(s.get("search_failures", 0)) for s in stats)
    if not issued or failed < issued:
        return None
    cause = next((s["search_error"] for s in stats if s.get("search_error")), "no error message recorded")
    return (f"every search of step {step} failed ({failed} of {issued}); the run stops rather than train "
            f"without retrieval. Last error: {cause}. Fix: check that search_r1.retriever.urls ({', '.join(urls)}) "
            f"answer from every node running agent-loop workers, and that RETRIEVER_API_KEY is set in the "
            f"shell that launches training when the retriever needs a key (it is forwarded to the workers)")


def unsynced_rollout_metrics(old_log_probs, ref_log_probs, response_mask) -> dict[str, float]:
    """What `rollout_corr/log_ppl_abs_diff` would read if no weight sync had reached the rollout.

    verl's metric compares the rollout's log-probs of the sampled tokens with the actor's (`old`):
    mean over sequences of |mean_t log p_rollout - mean_t log p_old|. A rollout that never received
    the trainer's weights still holds the initial weights, which are the reference policy's, so the
    same statistic with the reference log-probs in place of the rollout's is the value a dropped
    sync would produce (up to the rollout's own numerics). Beside the real metric it shows whether a
    small rollout/actor gap means the weights arrived or only that the policy has not moved yet.
    Shapes: all (batch, response_length); response_mask 1 on generated tokens.
    """
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    m = compute_offpolicy_metrics(old_log_prob=old_log_probs, rollout_log_prob=ref_log_probs,
                                  response_mask=response_mask)
    return {"sync/unsynced_log_ppl_abs_diff": float(m["log_ppl_abs_diff"])}


def likelihood_diagnostics(ems: list[float], response_mask: torch.Tensor, old_log_probs: torch.Tensor,
                           advantages: torch.Tensor, rollout_log_probs: torch.Tensor | None = None) -> dict[str, float]:
    """The likelihood diagnostics verl's metric time can compute (search_r1.algos.likelihood_sums):

        likelihood/{correct,incorrect}_logp_old       mean per-token log pi_old over correct (EM > 0) /
                                                      incorrect responses (the actor before the update)
        likelihood/{correct,incorrect}_logp_rollout   the same under the sampler's log-probs
        likelihood/preserved_fell_frac_old_vs_rollout share of responses with A >= 0 whose summed
                                                      log pi_old - log pi_rollout is negative

    Without `rollout_log_probs` only the `_old` means. Shapes: ems (N,), the tensors (N, L).
    """
    correct = torch.tensor([float(e) > 0 for e in ems], dtype=torch.bool)
    sampler = old_log_probs if rollout_log_probs is None else rollout_log_probs
    out = likelihood_metrics(likelihood_sums(old_log_probs, sampler, response_mask, correct, advantages),
                             new="old", old="rollout")
    if rollout_log_probs is None:
        out = {k: v for k, v in out.items() if "rollout" not in k}
    return out


def qa_metrics(data_sources, extra: dict[str, list]) -> dict[str, float]:
    """`val/<source>/<m>`, pooled `val/<m>` (m = em, f1, reward) and `val/<source>/n`, `val/n` from
    verl's per-sample validation lists (`extra` = its reward_extra_infos_dict)."""
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for m in ("em", "f1", "reward"):
        values = extra.get(m) or []
        for source, v in zip(data_sources, values):
            if v is not None:
                per_source[str(source)][m].append(float(v))
    out: dict[str, float] = {}
    pooled: dict[str, list[float]] = defaultdict(list)
    for source, rec in sorted(per_source.items()):
        for m, v in rec.items():
            out[f"val/{source}/{m}"] = float(np.mean(v))
            pooled[m] += v
        out[f"val/{source}/n"] = float(max(len(v) for v in rec.values()))
    out.update({f"val/{m}": float(np.mean(v)) for m, v in pooled.items()})
    if pooled:
        out["val/n"] = float(max(len(v) for v in pooled.values()))
    return out


def format_qa_table(history: list[tuple[int, dict[str, float]]]) -> str:
    """One row per (validation step, data source): n, EM, F1; the pooled row is `all`."""
    lines = [f"{'step':>6}  {'data_source':<24} {'n':>6} {'EM':>7} {'F1':>7}"]
    for step, m in history:
        sources = sorted({k.split("/")[1] for k in m if k.count("/") == 2})
        for source in sources + ["all"]:
            key = "val" if source == "all" else f"val/{source}"
            if f"{key}/em" in m:
                lines.append(f"{step:>6}  {source:<24} {m.get(f'{key}/n', 0):>6.0f} {m[f'{key}/em']:>7.3f} "
                             f"{m.get(f'{key}/f1', float('nan')):>7.3f}")
    return "\n".join(lines)


@register_trainer(MODE_NAME)
class SearchR1Trainer(PPOTrainerSync):
    """verl's sync trainer with Search-R1 metrics and the validation EM/F1 table (module docstring)."""

    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        # PPOTrainer.__init__ assigns config.trainer.v1.trainer_mode ("search_r1") here; keep the
        # registered name for logs, behave as "sync" everywhere verl compares.
        self.registered_mode = value

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        # On VERL_PLATFORM=cpu, verl's hybrid worker becomes verl_ext/cpu's gloo variant; no-op elsewhere.
        from verl_ext.cpu.worker import cpu_role_worker_mapping

        cpu_role_worker_mapping(self.role_worker_mapping)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps:  # verl logs this at INFO only; a resumed run should say so on the console
            print(f"[search_r1] resumed from {self.config.trainer.default_local_dir}/global_step_{self.global_steps}",
                  flush=True)

    def fit(self, agent_loop_manager):
        self.qa_history: list[tuple[int, dict[str, float]]] = []
        super().fit(agent_loop_manager)
        if self.qa_history:
            print(f"[search_r1] validation EM/F1 per data_source:\n{format_qa_table(self.qa_history)}", flush=True)

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        keys = [k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
        if not keys:
            return
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        # pop, as verl's _validate does: indexing a non-tensor stack gives a LinkedList (no .tolist()).
        extra = [ef if isinstance(ef, dict) else {} for ef in data.pop("extra_fields").tolist()]
        stats = [s for s in (ef.get(MODE_NAME) for ef in extra) if s]
        ems = [(ef.get("reward_extra_info") or {}).get("em") for ef in extra]  # verl_ext.reward's em
        metrics.update(search_metrics(stats))
        outage = search_outage(stats, global_steps, self.config.search_r1.retriever.urls)
        if outage:
            raise SearchOutage(outage)
        if ems and all(e is not None for e in ems):
            with_rollout = bool(self.config.actor_rollout_ref.rollout.get("calculate_log_probs", False))
            fields = ["response_mask", "old_log_probs", "advantages"] + (["rollout_log_probs"] if with_rollout else [])
            t = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
            metrics.update(likelihood_diagnostics(ems, t["response_mask"], t["old_log_probs"], t["advantages"],
                                                  t["rollout_log_probs"] if with_rollout else None))
        if self.use_reference_policy:
            fields = ["response_mask", "old_log_probs", "ref_log_prob"]
            logp = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
            metrics.update(unsynced_rollout_metrics(logp["old_log_probs"], logp["ref_log_prob"], logp["response_mask"]))

    def _val_metrics_update(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns,
                            expected_acc_counts=None):
        metrics = super()._val_metrics_update(data_sources, sample_uids, reward_extra_infos_dict, sample_turns,
                                              expected_acc_counts=expected_acc_counts)
        ours = qa_metrics(data_sources, reward_extra_infos_dict)
        metrics.update(ours)
        history = getattr(self, "qa_history", None)
        if history is not None and ours:
            history.append((self.global_steps, ours))
            print(f"[search_r1] validation at step {self.global_steps}:\n{format_qa_table([history[-1]])}", flush=True)
        return metrics
