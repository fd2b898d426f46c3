"""The actor/rollout/reference worker of the embedded CPU trainer, on verl's single controller.

`PolicyWorker` is one verl `Worker` (a Ray actor inside a `RayWorkerGroup`) that holds
  - the HF policy, used both to sample rollouts (HFGenerator) and to train (same weights, no sync),
  - the frozen reference model (for the KL term),
  - AdamW + a linear-warmup LR schedule.
The driver calls its methods with `DataProto` batches; `@register(dispatch_mode=...)` makes verl split
the batch across ranks (DP_COMPUTE_PROTO) and concatenate the results, or send the same arguments to
every rank (ONE_TO_ALL).

Data parallelism (n_workers > 1): every rank holds a full replica; torch.distributed (gloo) is set up
from the env verl gives each actor (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Per mini-batch each
rank backpropagates its share of the loss normalised by the *global* token count, the gradients are
summed with one all-reduce, so every rank applies the same update and the weights stay identical
(`weights_digest` lets tests check it). The driver orders the batch (`arrange_for_dp`) so that the
k-th local mini-batch of every rank together is exactly the k-th global mini-batch: DP=2 computes the
same update as DP=1 on the same global batch.

On-policy: sampling and training read the same distribution. Every log-prob pass (old, ref, policy)
divides the logits by the rollout temperature, as the sampler does, and the sampler reports its
log-probs at that temperature (`logprobs_mode="processed"`; top-p < 1 is rejected by the config),
so `rollout_log_probs` and the old log-probs differ only by numerics: by the bf16 rounding of the
rollout copy (`model.rollout_dtype=bfloat16`), by KV-cache vs full-sequence kernels. `update_actor`
reports that difference every step (`training/rollout_*`, `rollout_corr/*`) and, when
`rollout_is` is set, multiplies the policy-gradient term by truncated importance weights
pi_old / pi_rollout (verl's rollout correction).

`WorkerGroupGenerator` adapts the worker group to the rollout's `Generator` protocol, so
`LLMGenerationManager.run_llm_loop` on the driver drives generation on the workers.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from search_r1.algos import (LIKELIHOOD_SUMS, agg_loss, entropy_from_logits, get_kl_estimator, likelihood_metrics,
                             likelihood_sums, llds_loss, ppo_clip_loss, rollout_mismatch_sums, token_log_probs,
                             truncated_is_weights)
from search_r1.models import release_memory, reuse_freed_memory
from search_r1.rollout.backends import GenOutput, SamplingParams
from search_r1.rollout.tensor_helper import shared_prompt_rows

# Seed offset between ranks so that data-parallel shards do not share sampling noise.
RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class WorkerSpec:
    """Flat settings a worker needs (built from TrainConfig by the trainer)."""

    model_name: str
    compute_dtype: str = "float32"
    rollout_dtype: str = "float32"
    threads: int = 1
    seed: int = 0
    # optimizer
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    warmup_steps: int = 0
    grad_clip: float = 1.0
    # loss
    clip_ratio: float = 0.2
    kl_coef: float = 0.001
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.001
    loss_agg: str = "token-mean"
    # sampling temperature: every log-prob pass scores logits / temperature, as the sampler draws
    temperature: float = 1.0
    # truncated importance sampling of the rollout: none | token | sequence, weights capped at threshold
    rollout_is: str = "none"
    rollout_is_threshold: float = 2.0
    # batching
    ppo_epochs: int = 1
    micro_batch_size: int = 4
    gen_batch_size: int = 64
    use_ref: bool = True
    # no optimizer step for a mini-batch whose advantages are all 0 (algorithm.skip_zero_advantage)
    skip_zero_advantage: bool = False
    # weight of the supervised anchor's NLL in every update (algorithm.anchor_coef; `set_anchor`)
    anchor_coef: float = 0.0
    # weight of the anchor demonstrations' first round in its token mean (algorithm.anchor_plan_weight)
    anchor_plan_weight: float = 1.0
    # LLDS likelihood-preserving term (algorithm.llds_coef, algorithm.llds_gate; algos.llds_loss)
    llds_coef: float = 0.0
    llds_gate: str = "action"
    # glibc keeps freed memory in this worker's process for the next micro-batch of a rollout or update
    # (`models.reuse_freed_memory`; trainer.reuse_freed_memory). Process-wide: for a worker that has
    # its process to itself (a Ray actor), never one built in a caller's process
    reuse_freed_memory: bool = False
    # N > 0: this worker's idle OpenMP threads spin N times before they sleep (GOMP_SPINCOUNT);
    # 0: they sleep as soon as a parallel region ends (OMP_WAIT_POLICY=PASSIVE). trainer.omp_spincount;
    # see `worker_env`.
    omp_spincount: int = 10000


def in_process_worker(spec: WorkerSpec) -> "PolicyWorker":
    """A `PolicyWorker(spec)` built in the calling process, as rank 0 of 1, with its model loaded (for
    benchmarks and tests; the trainer makes its workers Ray actors). verl's `Worker` reads its rank and
    rendezvous from the environment, so this sets WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT (a free
    port) and WG_BACKEND in `os.environ`; a caller that must restore them saves them first."""
    from search_r1.net import free_port

    os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      WG_BACKEND="ray")
    worker = PolicyWorker(spec)
    worker.init_model()
    return worker


def arrange_for_dp(batch: DataProto, n_mini_batches: int, world_size: int) -> DataProto:
    """Reorder rows so that rank r's k-th local mini-batch is the r-th slice of global mini-batch k.

    verl's DP_COMPUTE_PROTO gives rank r the r-th contiguous chunk; a rank then splits its chunk into
    `n_mini_batches` contiguous mini-batches. With rows reordered by this permutation the union over
    ranks of local mini-batch k equals rows [k*M, (k+1)*M) of the original batch (M = N / n_mini).
    Shapes: batch of N rows, N divisible by n_mini_batches * world_size.
    """
    n = len(batch)
    if world_size == 1 or n_mini_batches == 1:
        return batch
    if n % (n_mini_batches * world_size):
        raise ValueError(f"batch of {n} rows cannot be split into {n_mini_batches} mini-batches x "
                         f"{world_size} workers; make trainer.mini_batch_size * rollout.n divisible by n_workers")
    m = n // n_mini_batches  # rows per global mini-batch
    s = m // world_size  # rows per rank per mini-batch
    order = [k * m + r * s + i for r in range(world_size) for k in range(n_mini_batches) for i in range(s)]
    return batch.select_idxs(torch.tensor(order, dtype=torch.long))


@dataclass
class UpdateStats:
    """Sums over one mini-batch's micro-batches (all ranks after `reduce`); maxima where named so.

    pg_loss, kl_loss, entropy are already divided by the global normaliser (they sum to the
    mini-batch's loss terms); the other sums are over generated tokens / sequences.
    """

    pg_loss: float = 0.0
    kl_loss: float = 0.0
    entropy: float = 0.0
    clipfrac_tokens: float = 0.0  # sum over tokens of 1[clipped]
    ppo_kl_tokens: float = 0.0  # sum over tokens of old - logp
    tokens: float = 0.0
    # sampler vs trainer (algos.rollout_mismatch_sums)
    logp_diff_sum: float = 0.0
    prob_diff_sum: float = 0.0
    seq_ratio_sum: float = 0.0
    sequences: float = 0.0
    logp_diff_max: float = 0.0
    prob_diff_max: float = 0.0
    seq_ratio_max: float = 0.0
    # LLDS (algos.llds_loss): the term (already / global normaliser), gated tokens, responses with a
    # gated token, responses with a generated token
    llds_loss: float = 0.0
    llds_gated_tokens: float = 0.0
    llds_gated_responses: float = 0.0
    responses: float = 0.0
    # likelihood diagnostics (algos.likelihood_sums), filled only when the batch has `correct`
    correct_new: float = 0.0
    correct_old: float = 0.0
    correct_tokens: float = 0.0
    incorrect_new: float = 0.0
    incorrect_old: float = 0.0
    incorrect_tokens: float = 0.0
    preserved: float = 0.0
    preserved_fell: float = 0.0

    def add(self, **values: float) -> None:
        for k, v in values.items():
            setattr(self, k, max(getattr(self, k), v) if k.endswith("_max") else getattr(self, k) + v)

    def reduce(self, all_reduce) -> "UpdateStats":
        """Combine over ranks: `all_reduce(tensor, op)` sums the sums and takes the max of the maxima."""
        names = [f.name for f in fields(self)]
        sums = [n for n in names if not n.endswith("_max")]
        maxes = [n for n in names if n.endswith("_max")]
        s = all_reduce(torch.tensor([getattr(self, n) for n in sums], dtype=torch.float64), "sum")
        m = all_reduce(torch.tensor([getattr(self, n) for n in maxes], dtype=torch.float64), "max")
        return UpdateStats(**dict(zip(sums, s.tolist())), **dict(zip(maxes, m.tolist())))

    def mismatch_metrics(self) -> dict[str, float]:
        """Sampler vs trainer, verl's names (`training/rollout_probs_diff_*` on probabilities, as
        verl; `training/rollout_log_probs_diff_*` on log-probs; `rollout_corr/rollout_is_seq_*` the
        sequence-level ratio pi_old / pi_rollout)."""
        tokens, seqs = max(self.tokens, 1.0), max(self.sequences, 1.0)
        return {"training/rollout_log_probs_diff_mean": self.logp_diff_sum / tokens,
                "training/rollout_log_probs_diff_max": self.logp_diff_max,
                "training/rollout_probs_diff_mean": self.prob_diff_sum / tokens,
                "training/rollout_probs_diff_max": self.prob_diff_max,
                "rollout_corr/rollout_is_seq_mean": self.seq_ratio_sum / seqs,
                "rollout_corr/rollout_is_seq_max": self.seq_ratio_max}


def rollout_copy(model, dtype: torch.dtype):
    """A frozen copy of `model` for sampling, with its parameters in `dtype` and its buffers as they are.

    `model.to(bfloat16)` would cast floating buffers too, among them the rotary `inv_freq`: the
    angles position * inv_freq then drift (up to ~1.3 rad for SmolLM2 within 1,024 positions), and
    the sampler is no longer the policy being trained. Tied parameters stay tied (cast once).
    """
    out = copy.deepcopy(model)
    for p in out.parameters():
        p.data = p.data.to(dtype)
    return out.requires_grad_(False)


def _split_rows(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _forward_shared_prompt(model, ids, attn, pos, p: int, first, inverse) -> torch.Tensor:
    """Response logits of rows that share prompts, each distinct prompt run once.

    ids/attn/pos (m, p + r): prompt columns [0, p), response columns [p, p + r). The distinct
    prompts go through the model once, with a KV cache whose rows are then repeated to every row
    that shares them; the responses run on top of it. Same function as one forward over the full
    rows (only float rounding differs, measured in tests), with the prompt's share of the compute
    paid once per group instead of once per sample (a demo prompt is ~145 tokens of a ~380-token
    row). Gradients flow through the repeated cache into the prompt's forward, summed over the
    group's rows.
    Returns logits (m, r, V) at positions p-1 .. p+r-2 (each scores the next response token).
    """
    pre = model(input_ids=ids[first, :p], attention_mask=attn[first, :p], position_ids=pos[first, :p],
                use_cache=True, logits_to_keep=1)
    last = pre.logits[inverse]  # (m, 1, V): position p-1 scores response token 0
    if ids.shape[1] - p == 1:
        return last
    cache = pre.past_key_values
    cache.batch_select_indices(inverse)
    out = model(input_ids=ids[:, p:-1], attention_mask=attn[:, :-1], position_ids=pos[:, p:-1],
                past_key_values=cache, use_cache=True)
    return torch.cat([last, out.logits], dim=1)


class PolicyWorker(Worker):
    """Policy (also the rollout engine) + reference model + optimizer on one Ray actor."""

    def __init__(self, spec: WorkerSpec):
        super().__init__()
        self.spec = spec
        self.model = None

    # -- setup --------------------------------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Load policy + reference, build optimizer/scheduler, join the gloo group (world > 1)."""
        from search_r1.models import load_model_and_tokenizer

        spec = self.spec
        torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed)
        if spec.reuse_freed_memory:
            # Micro-batches take the last one's freed logits and gradient buffers instead of faulting
            # fresh pages in (bench/studies/heap_reuse.py); release_memory still returns them to the OS after
            # each rollout and update: kept across phases, the worker's RSS grew ~0.13 GiB a step.
            reuse_freed_memory()
        if spec.rollout_is not in ("none", "token", "sequence"):
            raise ValueError(f"WorkerSpec.rollout_is={spec.rollout_is!r}; valid: none, token, sequence")
        if not spec.temperature > 0:
            raise ValueError(f"WorkerSpec.temperature must be > 0 (log-probs divide by it), got {spec.temperature}")
        if self.world_size > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                "gloo", rank=self.rank, world_size=self.world_size,
                init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        self.model, self.tokenizer = load_model_and_tokenizer(spec.model_name, dtype=torch.float32)
        self.model.eval()  # no dropout: log-probs of training and of old/ref passes must agree
        self.ref_model = None
        self.ref_identity = None
        if spec.use_ref:
            self.ref_model, _ = load_model_and_tokenizer(spec.model_name, dtype=torch.float32)
            self.ref_model.eval().requires_grad_(False)
        self._broadcast_weights()
        if self.ref_model is not None:  # after the broadcast: the reference every rank really uses
            from search_r1.models import resolve_model_path, state_dict_sha256

            self.ref_identity = {"path": str(resolve_model_path(spec.model_name)),
                                 "sha256": state_dict_sha256(self.ref_model)}
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=spec.lr, betas=spec.betas,
                                           weight_decay=spec.weight_decay)
        warmup = spec.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0)
        # Rollout weights: the policy itself, or a bf16 copy re-synced after every update (decoding
        # is memory-bound on CPU, so bf16 weights sample about twice as fast).
        self.rollout_model = self.model
        if spec.rollout_dtype == "bfloat16":
            self.rollout_model = rollout_copy(self.model, torch.bfloat16)
        self.generator = None  # built on first use
        self.anchor = []  # supervised anchor demonstrations (set_anchor)
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                "threads": torch.get_num_threads(), "n_params": sum(p.numel() for p in self.params)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rescale(self, lr_factor: float, kl_coef: float) -> float:
        """Multiply the learning rate (the scheduler's base and the optimizer's current one) by
        `lr_factor` and set the KL coefficient to `kl_coef` (a rollback, trainer.on_alarm=rollback).
        Both persist in later checkpoints through the optimizer and scheduler state. Returns the lr."""
        self.scheduler.base_lrs = [lr * lr_factor for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= lr_factor
            if "initial_lr" in group:
                group["initial_lr"] *= lr_factor
        self.spec = dataclasses.replace(self.spec, kl_coef=kl_coef)
        return self.optimizer.param_groups[0]["lr"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_anchor(self, demos: list) -> int:
        """Keep the supervised anchor's demonstrations (warmstart.Demo; every rank the whole pool, so
        each can compute the global token count of the rows an update names). Returns the pool size."""
        self.anchor = list(demos)
        return len(self.anchor)

    def _broadcast_weights(self) -> None:
        if self.world_size > 1:  # loading is deterministic, but a broadcast makes equality a fact
            for p in self.model.state_dict().values():
                torch.distributed.broadcast(p, src=0)

    def _autocast(self):
        if self.spec.compute_dtype == "bfloat16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    @contextlib.contextmanager
    def _weights_cast_once(self, model):
        """Hold one autocast context open over a pass so that each weight is cast to bf16 once.

        Autocast keeps a weight's bf16 copy only while the outermost autocast context is open, and
        only for leaf tensors that require grad. `_forward_logprobs` opens a context per forward, so
        without this the policy's weights are cast once per micro-batch and the reference's (frozen:
        never cached) once per forward call, twice per micro-batch on the shared-prompt path. In a
        no-grad pass the frozen weights are marked as requiring grad for its duration (no graph is
        built under no_grad), which puts them in the cache too; with grad enabled frozen weights stay
        frozen (and are cast per call, as before). A cast rounds the same whenever it
        runs, so log-probs and gradients are unchanged. The weights must not change inside: the
        optimizer steps after the context has closed (closing it drops the cached copies).
        """
        if self.spec.compute_dtype != "bfloat16":
            yield
            return
        # with grad enabled a frozen weight marked trainable would get a gradient
        frozen = [] if torch.is_grad_enabled() else [p for p in model.parameters() if not p.requires_grad]
        try:
            for p in frozen:
                p.requires_grad_(True)
            with self._autocast():
                yield
        finally:
            for p in frozen:
                p.requires_grad_(False)

    # -- rollout ------------------------------------------------------------------------------------
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """Sample continuations of `prompt_ids` (object array of id lists) with the policy.

        meta_info["sampling"]: SamplingParams fields. Returns object arrays token_ids, logprobs,
        finish_reason (one entry per input row).
        """
        if self.generator is None:
            from search_r1.rollout.backends import HFGenerator

            # "processed": log-probs of the distribution sampled from (logits / T), the same
            # quantity the old/ref/policy passes compute, so rollout and old log-probs compare
            self.generator = HFGenerator(self.rollout_model, self.tokenizer, batch_size=self.spec.gen_batch_size,
                                         logprobs_mode="processed")
        params = SamplingParams(**data.meta_info["sampling"])
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + self.rank * RANK_SEED_STRIDE)
        prompts = [list(map(int, p)) for p in data.non_tensor_batch["prompt_ids"]]
        t0 = time.perf_counter()
        with torch.no_grad(), self._autocast():
            outs = self.generator.generate(prompts, params)
        release_memory()
        return DataProto.from_dict(non_tensors={
            "token_ids": _objects([list(o.token_ids) for o in outs]),
            "logprobs": _objects([list(o.logprobs) for o in outs]),
            "finish_reason": _objects([o.finish_reason for o in outs]),
        }, meta_info={"metrics": {"worker_s": time.perf_counter() - t0}})

    # -- log-probs ----------------------------------------------------------------------------------
    def _forward_logprobs(self, model, data: DataProto, rows: slice, with_entropy: bool,
                          entropy_grad: bool = True):
        """log p(response token) (and entropy) for rows of the batch, padding trimmed.

        input_ids = [left-padded prompt (P) | right-padded response (R)], T = P + R. The logits at
        position t predict token t+1, so the response tokens [P, T) are scored by positions [P-1, T-1).
        Columns that are padding in every row of the micro-batch are cut off on both sides, and only
        the response logits are materialised (`logits_to_keep`). Logits are divided by the sampling
        temperature (verl's `logits.div_(temperature)`): the distribution scored is the one sampled.
        Returns logp (m, R) and entropy (m, R) or None; zero past the trimmed end.
        """
        ids = data.batch["input_ids"][rows]  # (m, T)
        attn = data.batch["attention_mask"][rows]  # (m, T)
        pos = data.batch["position_ids"][rows]  # (m, T)
        R = data.batch["responses"].shape[1]
        T = ids.shape[1]
        P = T - R
        live = attn.any(dim=0).nonzero().flatten()
        a = int(live[0]) if len(live) else P - 1
        a = min(a, P - 1)  # keep at least the last prompt column (it scores response token 0)
        e = max(int(live[-1]) + 1 if len(live) else P + 1, P + 1)  # at least one response column
        r_eff = e - P
        first, inverse = shared_prompt_rows(ids[:, a:P], attn[:, a:P], pos[:, a:P])
        with self._autocast():
            if len(first) < len(inverse):  # a GRPO group in this micro-batch: its prompt once
                logits = _forward_shared_prompt(model, ids[:, a:e], attn[:, a:e], pos[:, a:e], P - a,
                                                first, inverse)
            else:
                logits = model(input_ids=ids[:, a:e], attention_mask=attn[:, a:e], position_ids=pos[:, a:e],
                               use_cache=False, logits_to_keep=r_eff + 1).logits[:, :-1]
        logits = logits.float()  # (m, r_eff, V): positions P-1 .. e-2
        if self.spec.temperature != 1.0:  # x / 1.0 is x: skip a (m, r_eff, V) copy
            logits = logits / self.spec.temperature
        targets = ids[:, P:e]  # (m, r_eff)
        logp, lse = token_log_probs(logits, targets)  # (m, r_eff) each
        ent = None
        if with_entropy:
            if entropy_grad and torch.is_grad_enabled():
                ent = entropy_from_logits(logits)  # (m, r_eff)
            else:  # a report only: row by row, so its temporary is (r_eff, V), not (m, r_eff, V)
                with torch.no_grad():
                    ent = torch.stack([entropy_from_logits(row, row_lse) for row, row_lse in zip(logits, lse)])
        pad = R - r_eff
        if pad:
            logp = torch.nn.functional.pad(logp, (0, pad))
            ent = torch.nn.functional.pad(ent, (0, pad)) if ent is not None else None
        live_resp = attn[:, P:].to(logp.dtype)  # (m, R) 0 on response padding: no made-up numbers there
        return logp * live_resp, (ent * live_resp if ent is not None else None)

    def _batched_logprobs(self, model, data: DataProto) -> torch.Tensor:
        with torch.no_grad(), self._weights_cast_once(model):
            parts = [self._forward_logprobs(model, data, rows, with_entropy=False)[0]
                     for rows in _split_rows(len(data), self.spec.micro_batch_size)]
        return torch.cat(parts, dim=0)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs (N, R): the current policy's log-probs of the sampled response tokens."""
        t0 = time.perf_counter()
        logp = self._batched_logprobs(self.model, data)
        return DataProto.from_dict(tensors={"old_log_probs": logp},
                                   meta_info={"metrics": {"worker_s": time.perf_counter() - t0}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (N, R) under the frozen reference model."""
        if self.ref_model is None:
            raise ValueError("this worker was built without a reference model (kl_coef=0)")
        t0 = time.perf_counter()
        logp = self._batched_logprobs(self.ref_model, data)
        return DataProto.from_dict(tensors={"ref_log_prob": logp},
                                   meta_info={"metrics": {"worker_s": time.perf_counter() - t0}})

    # -- update -------------------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX if op == "max"
                                         else torch.distributed.ReduceOp.SUM)
        return t

    def _normalizer(self, mask: torch.Tensor) -> float:
        """Global (all ranks) denominator of the loss aggregation for this mini-batch."""
        if self.spec.loss_agg == "token-mean":
            local = mask.sum()
        else:  # seq-mean-*: number of sequences with at least one generated token
            local = (mask.sum(dim=-1) > 0).sum()
        return float(self._all_reduce(local.to(torch.float64).clone()).clamp_min(1.0))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, data: DataProto) -> dict:
        """PPO-clip + K3 KL - entropy bonus over mini-batches; one scheduler step per call.

        data (local shard, arranged with `arrange_for_dp`): input_ids, attention_mask, position_ids,
        responses, response_mask (N, R), old_log_probs, ref_log_prob, rollout_log_probs, advantages (N, R).
        meta_info["n_mini_batches"]: mini-batches per epoch (same on every rank).
        meta_info["anchor_rows"] (with spec.anchor_coef > 0): indices into the `set_anchor` pool.
        Optional `correct` (N,): 1 = a correct response, for the likelihood diagnostics.

            loss = PPO-clip(logp, old, A) + kl_coef * KL_k3(logp, ref) - entropy_coef * H(pi)
                   + anchor_coef * NLL(anchor demonstrations) + llds_coef * LLDS(logp, old, A)

        (with a `kl_weights` (N, R) key, per-token coefficients replace kl_coef: agg(w * KL_k3)),
        each term aggregated over response_mask across the global mini-batch (the PPO-clip term
        weighted by truncated pi_old / pi_rollout when spec.rollout_is is set). Returns metrics
        averaged over mini-batches, the sampler/trainer mismatch of the first epoch, and (with
        `correct`) the likelihood diagnostics `likelihood/*` of the last epoch: log pi_theta at each
        mini-batch's update (before its optimizer step) against log pi_old (identical on every rank
        after the all-reduces). With one update per batch pi_theta is pi_old there: the `_new` and
        `_old` values agree and `likelihood/preserved_fell_frac` is 0; across steps `_old` is the
        curve of the paper (the likelihood of correct responses under the policy that sampled them).
        """
        spec = self.spec
        t0 = time.perf_counter()
        n_mini = int(data.meta_info["n_mini_batches"])
        # The model stays in eval mode: dropout is 0 in these models, and eval keeps the first
        # mini-batch's log-probs bit-identical to compute_log_prob's (ratio exactly 1 on-policy).
        sums: dict[str, float] = {}
        n_updates = n_skipped = 0
        mismatch = UpdateStats()
        likelihood = UpdateStats()
        diagnose = "correct" in data.batch.keys()
        for epoch in range(spec.ppo_epochs):
            for mb in _chunk(data, n_mini):
                if spec.skip_zero_advantage and not self._has_signal(mb):
                    n_skipped += 1  # every rank agrees (all-reduced), so the collectives stay in step
                    continue
                norm = self._normalizer(mb.batch["response_mask"].float())
                self.optimizer.zero_grad(set_to_none=False)
                with self._weights_cast_once(self.model):  # closed before the optimizer moves the weights
                    stats = self.accumulate_grads(mb, norm, likelihood=diagnose and epoch == spec.ppo_epochs - 1)
                    anchor_rows = data.meta_info.get("anchor_rows")
                    if spec.anchor_coef > 0 and anchor_rows:
                        sums["actor/anchor_loss"] = (sums.get("actor/anchor_loss", 0.0)
                                                     + self.accumulate_anchor_grads(anchor_rows))
                self._all_reduce_grads()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, spec.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # a non-finite gradient would poison AdamW's moments on every rank
                    self.optimizer.zero_grad(set_to_none=False)
                stats = stats.reduce(self._all_reduce)
                if diagnose and epoch == spec.ppo_epochs - 1:
                    likelihood.add(**{k: getattr(stats, k) for k in LIKELIHOOD_SUMS})
                if epoch == 0:  # pi_old and pi_rollout do not change between epochs
                    mismatch.add(**{f.name: getattr(stats, f.name) for f in fields(stats)
                                    if f.name in ("tokens", "sequences") or f.name.startswith(
                                        ("logp_diff", "prob_diff", "seq_ratio"))})
                tokens = max(stats.tokens, 1.0)
                for k, v in {"actor/pg_loss": stats.pg_loss, "actor/kl_loss": stats.kl_loss,
                             "actor/entropy": stats.entropy, "actor/pg_clipfrac": stats.clipfrac_tokens / tokens,
                             "actor/ppo_kl": stats.ppo_kl_tokens / tokens, "actor/grad_norm": grad_norm,
                             "actor/update_tokens": stats.tokens}.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                if spec.llds_coef > 0:
                    responses = max(stats.responses, 1.0)
                    for k, v in {"actor/llds_loss": stats.llds_loss,
                                 "actor/llds_gated_token_frac": stats.llds_gated_tokens / tokens,
                                 "actor/llds_gated_response_frac": stats.llds_gated_responses / responses}.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                n_updates += 1
        lr = self.scheduler.get_last_lr()[0]
        if n_updates:  # the warmup counts optimizer steps taken; an all-skipped call leaves weights as they are
            self.scheduler.step()
            self._sync_rollout_weights()
        self.optimizer.zero_grad(set_to_none=True)  # gradients are not needed until the next update
        release_memory()
        metrics = {k: v / n_updates for k, v in sums.items()}
        if n_updates:
            metrics.update(mismatch.mismatch_metrics())
            metrics["actor/grad_nonfinite"] = float(not math.isfinite(metrics["actor/grad_norm"]))
            if diagnose:
                metrics.update(likelihood_metrics({k: getattr(likelihood, k) for k in LIKELIHOOD_SUMS}))
        metrics["actor/lr"] = lr
        metrics["actor/skipped_updates"] = n_skipped / (n_skipped + n_updates)
        metrics["perf/update_worker_s"] = time.perf_counter() - t0
        return metrics

    def _has_signal(self, mb: DataProto) -> bool:
        """Whether any generated token of the global mini-batch has a non-zero advantage."""
        local = (mb.batch["advantages"].float() * mb.batch["response_mask"].float()).abs().max()
        return float(self._all_reduce(local.reshape(1).clone(), op="max")) > 0.0

    def accumulate_grads(self, mb: DataProto, norm: float, likelihood: bool = False) -> UpdateStats:
        """Backpropagate the loss of one (local) mini-batch in micro-batches; grads accumulate.

        `norm` is the global aggregation denominator, so the summed micro-batch losses of all ranks
        equal the loss of the global mini-batch. `likelihood`: also sum the likelihood diagnostics
        (needs the batch's `correct`). Returns this rank's `UpdateStats`.
        """
        spec = self.spec
        kl_fn = get_kl_estimator(spec.kl_type)
        mask = mb.batch["response_mask"].float()  # (n, R) 1 = generated token, 0 = observation/padding
        # On-policy single update: pi_old is the current policy, so its log-probs are this very
        # forward pass, detached (the same numbers a separate compute_log_prob pass would give).
        old_is_current = bool(mb.meta_info.get("old_is_current", False))
        stats = UpdateStats()
        for rows in _split_rows(len(mb), spec.micro_batch_size):
            m = mask[rows]
            # entropy is always reported; it joins the graph only when it is part of the loss
            logp, ent = self._forward_logprobs(self.model, mb, rows, with_entropy=True,
                                               entropy_grad=spec.entropy_coef > 0)
            old = logp.detach() if old_is_current else mb.batch["old_log_probs"][rows]
            rollout = mb.batch["rollout_log_probs"][rows]
            is_w = (truncated_is_weights(old, rollout, m, spec.rollout_is, spec.rollout_is_threshold)
                    if spec.rollout_is != "none" else None)
            pg, st = ppo_clip_loss(logp, old, mb.batch["advantages"][rows], m, clip=spec.clip_ratio,
                                   agg=spec.loss_agg, normalizer=norm, rollout_is_weights=is_w)
            loss = pg
            kl = torch.zeros(())
            weights = mb.batch["kl_weights"][rows] if "kl_weights" in mb.batch.keys() else None
            if weights is not None or spec.kl_coef > 0:
                kl_tok = kl_fn(logp, mb.batch["ref_log_prob"][rows])
                kl = agg_loss(kl_tok, m, spec.loss_agg, norm)  # reported unweighted
                # per-token coefficients (algorithm.plan_kl_coef) replace the single kl_coef
                loss = loss + (spec.kl_coef * kl if weights is None
                               else agg_loss(kl_tok * weights, m, spec.loss_agg, norm))
            adv = mb.batch["advantages"][rows]
            if spec.llds_coef > 0:
                llds, lst = llds_loss(logp, old, adv, m, gate=spec.llds_gate, agg=spec.loss_agg, normalizer=norm)
                loss = loss + spec.llds_coef * llds
                responses = float((m.sum(-1) > 0).sum())
                stats.add(llds_loss=llds.item(), responses=responses,
                          llds_gated_tokens=lst["actor/llds_gated_token_frac"] * float(m.sum()),
                          llds_gated_responses=lst["actor/llds_gated_response_frac"] * responses)
            if likelihood:
                stats.add(**likelihood_sums(logp, old, m, mb.batch["correct"][rows] > 0, adv))
            ent_term = agg_loss(ent, m, spec.loss_agg, norm)
            if spec.entropy_coef > 0:
                loss = loss - spec.entropy_coef * ent_term
            loss.backward()
            t = float(m.sum())
            mm = rollout_mismatch_sums(old, rollout, m)
            mm.pop("tokens")
            stats.add(pg_loss=pg.item(), kl_loss=kl.item(), entropy=ent_term.item(), tokens=t,
                      clipfrac_tokens=st["actor/pg_clipfrac"] * t, ppo_kl_tokens=st["actor/ppo_kl"] * t, **mm)
        return stats

    def accumulate_anchor_grads(self, rows: list[int]) -> float:
        """Backpropagate anchor_coef * the token-mean NLL of the anchor demonstrations `rows` (their
        policy tokens only, the first round's weighted by anchor_plan_weight, at temperature 1: the
        warm-start's loss); grads accumulate.

        Each rank takes rows rank::world_size, weighted by its share of the global supervised tokens,
        so the all-reduced gradient is the whole batch's. Returns the (global) NLL, unweighted.
        """
        from search_r1.trainer.warmstart import supervised_tokens, token_mean_sft_backward

        if not self.anchor:
            raise ValueError("anchor rows were sent to a worker without anchor demonstrations (set_anchor)")
        demos = [self.anchor[i] for i in rows]
        mine = demos[self.rank::self.world_size]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        w = self.spec.anchor_plan_weight
        nll = token_mean_sft_backward(self.model, [mine[s] for s in _split_rows(len(mine), self.spec.micro_batch_size)],
                                      pad, supervised_tokens(demos, w), scale=self.spec.anchor_coef,
                                      autocast=self._autocast, plan_weight=w)
        return float(self._all_reduce(torch.tensor(nll, dtype=torch.float64)))

    def _sync_rollout_weights(self) -> None:
        if self.rollout_model is not self.model:
            with torch.no_grad():
                for dst, src in zip(self.rollout_model.parameters(), self.model.parameters()):
                    dst.copy_(src)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_rollout_weights(self, path: str) -> None:
        """Rank 0 writes the policy's parameters to `path` (safetensors) for a vLLM rollout server to
        load (rollout.backend=vllm; every rank holds the same weights)."""
        if self.rank == 0:
            from search_r1.trainer.vllm_rollout import save_rollout_weights

            save_rollout_weights(self.model, path)

    def _all_reduce_grads(self) -> None:
        """Sum gradients over ranks in one flat buffer (each rank's loss is already / global count)."""
        if self.world_size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n

    # -- checkpoints and inspection -----------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, keep_last: int, extra_state: dict,
                        dataloader_state: dict, rng_state: dict) -> str | None:
        """Rank 0 writes an atomic checkpoint via CheckpointManager; returns its path (None elsewhere)."""
        from search_r1.trainer.checkpoint import CheckpointManager

        path = None
        if self.rank == 0:
            path = str(CheckpointManager(root, keep_last=keep_last).save(
                step, self.model, self.tokenizer, optimizer_state=self.optimizer.state_dict(),
                scheduler_state=self.scheduler.state_dict(), extra_state=extra_state,
                dataloader_state=dataloader_state, rng_state=rng_state))
        if self.world_size > 1:
            torch.distributed.barrier()  # nobody runs ahead of a checkpoint that may be resumed
        return path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        """Load weights, optimizer and scheduler state from a checkpoint directory (every rank)."""
        from search_r1.trainer.checkpoint import load_checkpoint

        state = load_checkpoint(path, model=self.model)
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._sync_rollout_weights()
        return {"step": state["step"], "extra_state": state["extra_state"],
                "dataloader": state["dataloader"], "rng": state["rng"]}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reference_identity(self) -> dict | None:
        """{"path", "sha256"} of the KL reference's weights (None without a reference)."""
        return self.ref_identity

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_digest(self) -> list[float]:
        """Per-parameter sums of the policy weights (float64), to compare replicas and runs."""
        return [float(p.detach().double().sum()) for p in self.model.parameters()]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_dict_copy(self) -> dict:
        """The policy weights (for tests comparing two worker groups)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def worker_seconds(out: DataProto) -> float:
    """Compute time inside the workers of a DP call (the slowest rank), from meta_info metrics."""
    value = out.meta_info.get("metrics", {}).get("worker_s", 0.0)
    return float(max(value)) if isinstance(value, list) else float(value)


def _chunk(data: DataProto, n: int) -> list[DataProto]:
    return data.chunk(n) if n > 1 else [data]


def _objects(values: list) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


class WorkerGroupGenerator:
    """`Generator` over a worker group: prompts split evenly across ranks, results in input order.

    The list is padded with copies of its last prompt up to a multiple of the world size (verl's
    DP split wants equal shards); the extra outputs are dropped.
    """

    def __init__(self, worker_group):
        self.worker_group = worker_group
        self.seconds = 0.0  # wall time of generate calls, dispatch included
        self.worker_seconds = 0.0  # time the slowest rank spent sampling

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        if not prompts:
            return []
        t0 = time.perf_counter()
        world = self.worker_group.world_size
        padded = list(prompts) + [prompts[-1]] * (-len(prompts) % world)
        batch = DataProto.from_dict(non_tensors={"prompt_ids": _objects([list(p) for p in padded])},
                                    meta_info={"sampling": dataclasses.asdict(params)})
        out = self.worker_group.generate_sequences(batch)
        nt = out.non_tensor_batch
        self.worker_seconds += worker_seconds(out)
        results = [GenOutput(token_ids=list(nt["token_ids"][i]), logprobs=list(nt["logprobs"][i]),
                             finish_reason=str(nt["finish_reason"][i])) for i in range(len(prompts))]
        self.seconds += time.perf_counter() - t0
        return results


def worker_env(spec: WorkerSpec) -> dict[str, str]:
    """Environment variables of a worker actor: its thread counts and how its idle OpenMP threads wait.

    Between two parallel regions (thousands per forward pass) torch's OpenMP threads (GNU libgomp)
    either spin or sleep. Sleeping at once (OMP_WAIT_POLICY=PASSIVE, spec.omp_spincount 0; the
    default until 2026-12-04) costs a wake-up per region: on an idle 2-core Xeon a demo-shaped bf16
    worker sampled 1.6x, scored 1.5x and updated 1.3x slower than with libgomp's default spinning.
    Unbounded spinning wastes time slices when another process holds a core: with one busy process
    beside it libgomp's default ran those phases 12-21x slower than idle, PASSIVE 1.0-1.2x. The
    default, a bounded spin (GOMP_SPINCOUNT=10000, OMP_WAIT_POLICY unset), was within 1.0-1.1x of
    spinning idle and 1.55-1.8x of PASSIVE under load (bench/studies/omp_wait.py; docs/benchmarks.md, "How a
    worker's OpenMP threads wait"). Set 0 on a machine other work keeps busy.

    These variables overlay the environment the actor inherits. libgomp takes GOMP_SPINCOUNT, when
    set, over OMP_WAIT_POLICY, so both settings name it: an inherited OMP_WAIT_POLICY or
    GOMP_SPINCOUNT (a cluster's shell profile) cannot override the knob.
    """
    env = {"OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads),
           "TOKENIZERS_PARALLELISM": "false", "GOMP_SPINCOUNT": str(spec.omp_spincount)}
    if spec.omp_spincount == 0:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def create_worker_group(spec: WorkerSpec, n_workers: int):
    """Start `n_workers` PolicyWorker actors on CPU (Ray must be initialised); returns (group, pool).

    Each actor gets a placement-group bundle of one logical CPU (max_colocate_count=1: verl's default
    of 10 CPUs per bundle would never fit a small machine); torch threads are set by `spec.threads`.
    """
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.device import get_device_name

    pool = RayResourcePool(process_on_nodes=[n_workers], use_gpu=False, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(PolicyWorker), spec=spec)
    # The platform verl resolved here (verl_ext/cpu's "cpu" on a CPU-only torch): the group's default
    # "cuda" would log a device mismatch when placing the workers.
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, worker_env=worker_env(spec),
                           device_name=get_device_name())
    group.init_model()
    return group, pool


def shutdown_worker_group(group, pool) -> None:
    """Kill the actors and release their placement groups (the Ray session stays up)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for w in group.workers:
        ray.kill(w)
    for pg in pool.pgs or []:
        remove_placement_group(pg)
