"""Typed configuration of the embedded CPU GRPO trainer.

One frozen dataclass per section of `search_r1/trainer/configs/grpo_cpu.yaml` (CONFIG_DIR, shipped
with the package; `configs/grpo_cpu.yaml` at the repository root links to it) (model, data, retriever, rollout,
algorithm, optim, trainer). `TrainConfig.from_dict(d)` builds them from the plain dict Hydra composes
(`OmegaConf.to_container(cfg, resolve=True)`) through an OmegaConf structured config, which rejects
unknown keys (a typo must not silently fall back to a default) and converts types; every static
rule is checked in `__post_init__`; both fail with a ValueError that names the dotted key, the value,
the allowed values and the fix. The defaults here equal the shipped YAML
(tests/search_r1/trainer/test_config.py checks that).

Checks that need the filesystem or the machine (data files, index and checkpoint paths, cores,
retriever reachability) run at start-up, in `search_r1.trainer.main`.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from search_r1.algos import AGG_MODES as _ALGO_AGG_MODES
from search_r1.algos import KL_ESTIMATORS, LLDS_GATES, ROLLOUT_IS_LEVELS, STD_MODES
from search_r1.dtypes import DTYPE_CHOICES
from search_r1.rewards import REWARD_FNS
from search_r1.trainer.warmstart import BATCHINGS as WARMSTART_BATCHINGS
from search_r1.trainer.warmstart import FORMATS as WARMSTART_FORMATS
from search_r1.trainer.warmstart import LR_SCHEDULES as WARMSTART_LR_SCHEDULES

# The trainer's Hydra configs, inside the package so an installed (non-editable) copy has them.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
AUTO = "auto"
DTYPES = DTYPE_CHOICES  # auto | float32 | bfloat16 (auto: search_r1.dtypes measures this CPU)
# The workers normalise the loss by a global token or sequence count, so the *-sum modes are not offered.
AGG_MODES = tuple(m for m in _ALGO_AGG_MODES if not m.endswith("-sum"))
KL_TYPES = tuple(KL_ESTIMATORS)
PROTOCOLS = ("tags", "tool_call")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


ROLLOUT_BACKENDS = ("hf", "vllm")
ON_ALARM = ("warn", "stop", "rollback")
VAL_SAMPLERS = ("rollout", "hf")


def _fail(key: str, value: Any, allowed: str, fix: str) -> ValueError:
    return ValueError(f"config {key}={value!r} is invalid: allowed {allowed}. Fix: {fix}")


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise _fail(key, value, f"one of {list(choices)}", f"set {key} to one of them")


def _check_range(key: str, value: float, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    bad = (value is None or (isinstance(value, float) and not math.isfinite(value))
           or (lo is not None and (value <= lo if lo_open else value < lo))
           or (hi is not None and value > hi))
    if bad:
        lo_s = "-inf" if lo is None else f"{lo}"
        rng = f"{'(' if lo_open else '['}{lo_s}, {'inf' if hi is None else hi}]"
        raise _fail(key, value, f"a number in {rng}", f"set {key} inside that range")


@dataclass(frozen=True)
class ModelConfig:
    # Model alias (`smollm2-135m-instruct`, `tiny-random-qwen3`) or a local HF directory.
    name: str = "smollm2-135m-instruct"
    # Matmul precision of log-prob and update passes: float32, or bfloat16 autocast (fp32 master
    # weights and optimizer; about 2x faster forward on CPUs with AMX/AVX512-BF16, ~50x slower on
    # AVX2-only CPUs); auto = bfloat16 only where this CPU runs it clearly faster (search_r1.dtypes).
    compute_dtype: str = "auto"
    # Weights used for sampling: float32 (the policy itself) or bfloat16 (a copy of the policy,
    # re-synced after every update); auto as for compute_dtype, timed at a decoding shape. Old
    # log-probs are always recomputed with the training weights, so the PPO ratio is unaffected.
    rollout_dtype: str = "auto"

    def __post_init__(self):
        if not self.name:
            raise _fail("model.name", self.name, "a model alias or a directory", "set model.name")
        _check_choice("model.compute_dtype", self.compute_dtype, DTYPES)
        _check_choice("model.rollout_dtype", self.rollout_dtype, DTYPES)


@dataclass(frozen=True)
class DataConfig:
    # Synthetic world directory; `auto` = search_r1.paths.default_synth_dir(), generated if missing.
    dir: str = AUTO
    # Training parquet files; empty = <dir>/train.parquet.
    train_files: tuple[str, ...] = ()
    # Validation parquet files; empty = <dir>/test.parquet.
    test_files: tuple[str, ...] = ()
    # Prompt protocol the data was written for: tags | tool_call.
    protocol: str = "tags"
    # Longest prompt (chat template applied) in tokens.
    max_prompt_length: int = 256
    # Test prompts used per validation; 0 = the whole test split.
    val_size: int = 8
    # Seed of the synthetic world generated when dir is `auto` and missing.
    synth_seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "train_files", tuple(self.train_files))
        object.__setattr__(self, "test_files", tuple(self.test_files))
        _check_choice("data.protocol", self.protocol, PROTOCOLS)
        _check_range("data.max_prompt_length", self.max_prompt_length, 1)
        _check_range("data.val_size", self.val_size, 0)


@dataclass(frozen=True)
class RetrieverConfig:
    # Retriever URL (base or .../retrieve); `auto` = start `python -m retriever_server serve` on a
    # free 127.0.0.1 port for this run and stop it afterwards.
    url: str = AUTO
    # Index directory served when url is `auto`; empty = <data dir>/index_bm25 (built if missing).
    index: str = ""
    # Passages per search.
    topk: int = 3
    # Seconds per HTTP request before a retry.
    timeout: float = 10.0
    # Retries per request (with backoff) before the search counts as failed.
    retries: int = 3
    # Seconds to wait for an `auto` server to answer /health.
    startup_timeout: float = 120.0

    def __post_init__(self):
        if not self.url:
            raise _fail("retriever.url", self.url, "'auto' or an http(s) URL", "set retriever.url")
        if self.url != AUTO and not self.url.startswith(("http://", "https://")):
            raise _fail("retriever.url", self.url, "'auto' or an http(s) URL",
                        "write it as http://HOST:PORT (e.g. http://127.0.0.1:8000/retrieve)")
        _check_range("retriever.topk", self.topk, 1)
        _check_range("retriever.timeout", self.timeout, 0, lo_open=True)
        _check_range("retriever.retries", self.retries, 0)
        _check_range("retriever.startup_timeout", self.startup_timeout, 0, lo_open=True)


@dataclass(frozen=True)
class RolloutConfig:
    # Samples per prompt (the GRPO group size G).
    n: int = 4
    # Sampling temperature for training rollouts (validation is greedy); > 0. Every log-prob pass
    # (old, ref, policy) scores logits / temperature, the distribution sampled from.
    temperature: float = 1.0
    # Nucleus sampling for training rollouts: 1.0 only (the log-probs are of the untruncated
    # distribution; sampling from a truncated one would make the update off-policy).
    top_p: float = 1.0
    # Generation rounds in which a search is allowed (one last round without search follows).
    max_turns: int = 1
    # Longest prompt; a longer one keeps its last max_start_length tokens.
    max_start_length: int = 256
    # Longest rolling context (prompt + response so far) fed to the generator.
    max_prompt_length: int = 768
    # Longest whole response (generated + observation tokens over all turns).
    max_response_length: int = 256
    # Longest single observation (search results) in tokens.
    max_obs_length: int = 96
    # Generation cap per round in tokens (40: a warm-start demonstration turn, think + question as
    # the query, takes up to ~40 SmolLM2 tokens; at 32 half of them did not fit).
    max_tokens_per_turn: int = 40
    # Sampler: hf (the workers' HFGenerator on the policy itself) | vllm (`vllm serve` from the vLLM
    # environment, weights re-synced after every update; search_r1/trainer/vllm_rollout.py).
    backend: str = "hf"
    # Python that runs vLLM when backend=vllm; auto = this one if it has vLLM, else
    # $SEARCH_R1_VLLM_PYTHON, else .venv-vllm/bin/python (make install-vllm).
    vllm_python: str = "auto"

    def __post_init__(self):
        _check_range("rollout.n", self.n, 1)
        _check_choice("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        _check_range("rollout.temperature", self.temperature, 0, lo_open=True)
        if self.top_p != 1.0:
            raise _fail("rollout.top_p", self.top_p, "1.0",
                        "set rollout.top_p=1.0: the training log-probs (old, ref, policy) are of the full "
                        "softmax at rollout.temperature and do not account for nucleus truncation")
        _check_range("rollout.max_turns", self.max_turns, 0)
        for key in ("max_start_length", "max_prompt_length", "max_response_length", "max_obs_length",
                    "max_tokens_per_turn"):
            _check_range(f"rollout.{key}", getattr(self, key), 1)
        if self.max_start_length >= self.max_prompt_length:
            raise _fail("rollout.max_start_length", self.max_start_length,
                        f"< rollout.max_prompt_length ({self.max_prompt_length}), so a prompt leaves room to generate",
                        "lower max_start_length or raise max_prompt_length")


@dataclass(frozen=True)
class AlgorithmConfig:
    # Training reward: seed (format + answer, range [-1, 2.5]) | em | f1 | subem.
    reward: str = "seed"
    # GRPO group std: population (the seed specification's, our default) | unbiased (verl's and
    # upstream Search-R1's, with eps 1e-6) | none (Dr. GRPO: no std division).
    grpo_std: str = "population"
    # Added to the group std before dividing (verl and upstream: 1e-6).
    eps: float = 1.0e-8
    # PPO clip range epsilon: ratio clipped to [1 - clip_ratio, 1 + clip_ratio].
    clip_ratio: float = 0.2
    # Coefficient of the KL(pi || ref) loss term.
    kl_coef: float = 0.001
    # KL estimator: low_var_kl (= K3) | k3 | k1 | k2.
    kl_type: str = "low_var_kl"
    # Entropy bonus coefficient (subtracted from the loss); see configs/grpo_cpu.yaml for why 0.
    entropy_coef: float = 0.0
    # Loss aggregation over the mini-batch: token-mean | seq-mean-token-mean | seq-mean.
    loss_agg: str = "token-mean"
    # pi_old log-probs: recompute (a separate forward pass) | auto (when each batch gets exactly one
    # update - ppo_epochs 1, one mini-batch - take them from the update's own forward, detached:
    # the same numbers, one forward pass fewer).
    old_log_prob: str = "auto"
    # Truncated importance sampling of the rollout (verl's rollout correction): none | token |
    # sequence. The PPO-clip term is weighted by min(pi_old / pi_rollout, rollout_is_threshold),
    # per token or per sequence. Off by default: with the same weights sampling and training the
    # mismatch (training/rollout_log_probs_diff_*) is numerics only; turn it on for a bf16 or vLLM
    # sampler whose mismatch is not.
    rollout_is: str = "none"
    # Upper cap of the importance weights (verl's rollout_is_threshold).
    rollout_is_threshold: float = 2.0
    # Skip the optimizer step of a mini-batch in which every advantage is 0 (every group scored
    # alike): its only gradient is the KL term's, at numerical-noise size, and AdamW normalises any
    # gradient to a step of about lr per weight (and replays its momentum), so such steps move the
    # policy at full speed in a direction no reward chose. false = verl's behaviour (always step).
    skip_zero_advantage: bool = True
    # Update only on the groups whose samples did not all score alike (DAPO's group filter, without
    # its refill): flat groups carry no policy-gradient signal, only KL, yet cost a reference
    # forward and a forward+backward each; dropping them lets a step sample more prompts for the
    # same update cost. Reward and rollout metrics still cover every sample
    # (`train/trajectories_updated` counts the kept ones). false = verl's behaviour.
    drop_flat_groups: bool = False
    # Whether the first generation round (the opening thought, which states the plan - one search
    # or two - and the first query) gets a policy gradient. false keeps those tokens' advantages at
    # 0, so RL trains the later rounds (the follow-up query, reading, the answer) and the plan stays
    # the warm-start's, held by the KL term. Why: the plan hangs on one token shared by every
    # question, and the few groups that disagree on it walk its bias (docs/results/).
    # true = verl's behaviour (every generated token is trained).
    pg_first_turn: bool = True
    # KL coefficient on the first generation round's tokens (the plan and the first query); null =
    # kl_coef, as every other token (verl's behaviour). A large value pulls the plan toward the
    # reference's while GRPO trains the later rounds: with pg_first_turn=false alone the plan still
    # drifts through the weights it shares with them. At 1.0 it held in 2 of 3 seeds (docs/results/).
    plan_kl_coef: Optional[float] = None
    # Supervised anchor (InstructGPT's PPO-ptx term, on demonstrations instead of pretraining text):
    # every policy update adds anchor_coef * the token-mean NLL of anchor_batch_size demonstrations
    # in the warm-start's search format, drawn from a pool of anchor_examples built from the
    # warm-start's training questions. Why: GRPO on two-hop prompts moves the plan threshold that
    # single-hop questions share, and their prompts, absent from the batch, hold nothing; the anchor
    # keeps the model's likelihood of one-search demonstrations on those questions.
    # 0 = off (verl's behaviour).
    anchor_coef: float = 0.0
    anchor_examples: int = 256
    anchor_batch_size: int = 8
    # Share of two-hop demonstrations in the anchor pool: 0 = single-hop only.
    anchor_two_hop_share: float = 0.0
    # Weight of each demonstration's first round (the plan and the first query) in the anchor's token
    # mean, relative to its other policy tokens (warmstart.token_weights). 1 = a plain token mean; more
    # leans the anchor on whether a demonstration searches once or twice, which a token or two decide.
    anchor_plan_weight: float = 1.0
    # LLDS (Lazy Likelihood-Displacement regularisation, arXiv 2512.04220): adds llds_coef * the
    # token-mean of relu(log pi_old - log pi_theta) over the tokens whose log-ratio is negative, in
    # units (llds_gate) whose likelihood fell, of responses with non-negative advantage
    # (search_r1.algos.llds_penalty). It pushes back a fall of likelihood of good responses, which
    # the paper finds precedes GRPO collapse on Search-R1. It compares pi_theta with pi_old, equal on
    # a batch's first update, so it needs several updates per batch (trainer.mini_batch_size <
    # trainer.batch_size or trainer.ppo_epochs > 1). 0 = off (verl's behaviour).
    llds_coef: float = 0.0
    # LLDS gate: response (a response's summed log-ratio fell) | action (each generation turn,
    # the run of generated tokens between two observations, on its own; the paper's best).
    llds_gate: str = "action"

    def __post_init__(self):
        _check_choice("algorithm.reward", self.reward, tuple(sorted(REWARD_FNS)))
        _check_choice("algorithm.grpo_std", self.grpo_std, STD_MODES)
        _check_choice("algorithm.kl_type", self.kl_type, KL_TYPES)
        _check_choice("algorithm.loss_agg", self.loss_agg, AGG_MODES)
        _check_choice("algorithm.old_log_prob", self.old_log_prob, ("auto", "recompute"))
        _check_choice("algorithm.rollout_is", self.rollout_is, ROLLOUT_IS_LEVELS)
        _check_range("algorithm.rollout_is_threshold", self.rollout_is_threshold, 1.0)
        _check_range("algorithm.eps", self.eps, 0)
        _check_range("algorithm.clip_ratio", self.clip_ratio, 0, 1, lo_open=True)
        _check_range("algorithm.kl_coef", self.kl_coef, 0)
        _check_range("algorithm.entropy_coef", self.entropy_coef, 0)
        if self.plan_kl_coef is not None:
            _check_range("algorithm.plan_kl_coef", self.plan_kl_coef, 0)
        _check_range("algorithm.anchor_coef", self.anchor_coef, 0)
        _check_range("algorithm.anchor_examples", self.anchor_examples, 1)
        _check_range("algorithm.anchor_batch_size", self.anchor_batch_size, 1)
        _check_range("algorithm.anchor_two_hop_share", self.anchor_two_hop_share, 0.0, 1.0)
        _check_range("algorithm.anchor_plan_weight", self.anchor_plan_weight, 0, lo_open=True)
        _check_range("algorithm.llds_coef", self.llds_coef, 0)
        _check_choice("algorithm.llds_gate", self.llds_gate, LLDS_GATES)
        if self.anchor_coef > 0 and self.anchor_batch_size > self.anchor_examples:
            raise _fail("algorithm.anchor_batch_size", self.anchor_batch_size,
                        f"<= algorithm.anchor_examples ({self.anchor_examples})",
                        "lower anchor_batch_size or raise anchor_examples")

    @property
    def plan_kl(self) -> float:
        """The KL coefficient of the first round's tokens (plan_kl_coef, or kl_coef when unset)."""
        return self.kl_coef if self.plan_kl_coef is None else self.plan_kl_coef

    @property
    def uses_ref(self) -> bool:
        """Whether any token carries a KL term, so the reference model is needed."""
        return self.kl_coef > 0 or self.plan_kl > 0


@dataclass(frozen=True)
class OptimConfig:
    # AdamW peak learning rate.
    lr: float = 3.0e-6
    # Linear warmup from 0 to lr over this many optimizer steps, then constant.
    warmup_steps: int = 2
    # AdamW betas.
    betas: tuple[float, float] = (0.9, 0.999)
    # AdamW decoupled weight decay.
    weight_decay: float = 0.01
    # Max global gradient L2 norm (clip_grad_norm_).
    grad_clip: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check_range("optim.lr", self.lr, 0, lo_open=True)
        _check_range("optim.warmup_steps", self.warmup_steps, 0)
        _check_range("optim.weight_decay", self.weight_decay, 0)
        _check_range("optim.grad_clip", self.grad_clip, 0, lo_open=True)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise _fail("optim.betas", list(self.betas), "two numbers in [0, 1)", "e.g. optim.betas=[0.9,0.999]")


@dataclass(frozen=True)
class TrainerConfig:
    # GRPO steps (one rollout batch + one policy update each).
    total_steps: int = 20
    # Prompts per step (each sampled rollout.n times).
    batch_size: int = 2
    # Prompts per optimizer update; batch_size / mini_batch_size updates per PPO epoch.
    mini_batch_size: int = 2
    # Passes over each rollout batch.
    ppo_epochs: int = 1
    # Trajectories per forward/backward on a worker (gradient accumulation; memory knob).
    micro_batch_size: int = 2
    # Prompts per validation rollout batch.
    val_batch_size: int = 8
    # Validate every this many steps (0 = only before and after training).
    test_freq: int = 10
    # Validate once before the first step.
    val_before_train: bool = True
    # Wall-time budget of the run in minutes, counted from the trainer's start (warm-start included);
    # 0 = none. No GRPO step starts that, with the final validation after it, would end past the
    # budget (each estimated from this run: its slowest step so far, its first validation); the run
    # then validates and saves at the step reached, says so, and resumes from there like any run.
    # For a fixed-time demo (scripts/demo.sh) or a scheduler's time limit.
    time_budget_minutes: float = 0.0
    # Who samples the greedy validation: rollout (the training sampler, rollout.backend) | hf (the
    # workers' HFGenerator on the policy). With rollout.backend=vllm, greedy dev EM moved by 2 of 32
    # questions between two runs of the same model (the server's batching); hf repeats exactly on one
    # machine, slower. Judge small differences with hf.
    val_sampler: str = "rollout"
    # Save a checkpoint every this many steps (0 = only at the end).
    save_freq: int = 10
    # Checkpoints kept on disk (oldest deleted first).
    keep_last: int = 2
    # auto = continue from the latest good checkpoint in output_dir | none | a checkpoint path.
    resume: str = AUTO
    # Data-parallel Ray workers (each holds policy + reference model).
    n_workers: int = 1
    # torch threads per worker; n_workers * threads_per_worker must not exceed the cores.
    threads_per_worker: int = 2
    # Workers keep freed memory for the next micro-batch of a rollout or update (glibc's mmap off)
    # instead of faulting its pages in again: bf16 update 1.17-1.83x on a Xeon with AMX, the same
    # numbers to the bit, peak RSS +0.25 GiB (bench/studies/heap_reuse.py). Off by default: over a 20-step demo
    # the worker's peak inside updates rose 5.95 -> 7.05 GiB with it (5.56 -> 6.27 GiB without), and
    # how far it grows over a long run is not measured.
    reuse_freed_memory: bool = False
    # How the workers' idle OpenMP threads wait between parallel regions: N > 0 = spin N times, then
    # sleep (GOMP_SPINCOUNT); 0 = sleep at once (OMP_WAIT_POLICY=PASSIVE). 10000 against 0: sampling
    # and passes 1.3-1.5x faster on an otherwise idle machine, 1.55-1.8x slower beside another busy
    # process; set 0 where other work keeps the cores busy (workers.worker_env; docs/benchmarks.md).
    omp_spincount: int = 10000
    # Seed of data order, sampling and model init.
    seed: int = 0
    # Run directory: metrics.jsonl, TensorBoard events, plot, checkpoints.
    output_dir: str = "outputs/grpo_cpu"
    # Metric sinks: console | jsonl | tensorboard | wandb.
    loggers: tuple[str, ...] = ("console", "jsonl", "tensorboard")
    # wandb project / run name (used when "wandb" is in loggers).
    project: str = "search-r1-cpu"
    experiment_name: str = "grpo_cpu"
    # Warn (ALARM line, alarm/* metrics) when K3 KL averaged over alarm_window steps exceeds this
    # (0 = off); the sampled EM falling below half its start and a validation EM significantly below
    # the first one are reported too (search_r1/trainer/alarms.py).
    kl_alarm: float = 0.1
    # Steps averaged by the alarms.
    alarm_window: int = 5
    # A run's metrics.jsonl (or its output_dir) whose first validation the validation alarms compare
    # with; empty = this run's own first validation. For runs that share one "before" validation
    # (scripts/experiment_cpu.sh's later seeds, which skip val_before_train).
    val_baseline: str = ""
    # What an alarm does: warn (print and log it, the run goes on) | stop (save a checkpoint and exit
    # non-zero, naming the alarm and the step) | rollback (restore the last checkpoint saved before
    # the alarm's window began and go on with the changes below; stop once max_rollbacks are spent).
    on_alarm: str = "warn"
    # rollback: multiply the learning rate (optim.lr) by this at each rollback (1 = unchanged).
    rollback_lr_scale: float = 0.5
    # rollback: multiply the KL coefficient (algorithm.kl_coef and plan_kl_coef) by this at each
    # rollback (1 = unchanged).
    rollback_kl_coef_scale: float = 2.0
    # rollback: rollbacks allowed in a run; the next alarm after them stops the run as on_alarm=stop.
    max_rollbacks: int = 2

    def __post_init__(self):
        object.__setattr__(self, "loggers", tuple(self.loggers))
        _check_range("trainer.time_budget_minutes", self.time_budget_minutes, 0)
        for key in ("total_steps", "batch_size", "mini_batch_size", "ppo_epochs", "micro_batch_size",
                    "val_batch_size", "keep_last", "n_workers", "threads_per_worker", "alarm_window"):
            _check_range(f"trainer.{key}", getattr(self, key), 1)
        _check_range("trainer.kl_alarm", self.kl_alarm, 0.0)
        for key in ("test_freq", "save_freq", "omp_spincount"):
            _check_range(f"trainer.{key}", getattr(self, key), 0)
        if self.batch_size % self.mini_batch_size:
            raise _fail("trainer.batch_size", self.batch_size,
                        f"a multiple of trainer.mini_batch_size ({self.mini_batch_size})",
                        "make batch_size divisible by mini_batch_size (e.g. equal)")
        for log in self.loggers:
            _check_choice("trainer.loggers[]", log, LOGGERS)
        _check_choice("trainer.val_sampler", self.val_sampler, VAL_SAMPLERS)
        _check_choice("trainer.on_alarm", self.on_alarm, ON_ALARM)
        _check_range("trainer.rollback_lr_scale", self.rollback_lr_scale, 0, lo_open=True)
        _check_range("trainer.rollback_kl_coef_scale", self.rollback_kl_coef_scale, 0)
        _check_range("trainer.max_rollbacks", self.max_rollbacks, 0)
        if not self.output_dir:
            raise _fail("trainer.output_dir", self.output_dir, "a directory path", "set trainer.output_dir")


@dataclass(frozen=True)
class WarmstartConfig:
    # Supervised format warm-start before GRPO (search_r1/trainer/warmstart.py): a small model that
    # never writes the tags gets a constant reward and GRPO learns nothing. The policy and the KL
    # reference both start from the warm-started model.
    enabled: bool = True
    # SFT optimizer steps (6: the loss falls 2.0 -> ~0.1; 30 steps reach 0.002 and leave a policy so
    # sure (entropy 0.003) that every GRPO group samples one answer and all advantages are 0).
    steps: int = 6
    # Demonstrations per step.
    batch_size: int = 4
    # AdamW learning rate (no weight decay).
    lr: float = 1.0e-4
    # constant | linear (decays to lr / steps at the last step, so the last batches move the model less).
    lr_schedule: str = "constant"
    # shuffled (epochs in random order) | stratified (with two-hop demonstrations: every batch holds
    # both kinds in the demonstrations' proportion, so no run of one-kind batches sets the plan's bias).
    batching: str = "shuffled"
    # Demonstrations built from train questions (fewer if not enough qualify).
    n_examples: int = 96
    # Share of two-hop questions among them (search format: they search twice, so rollout.max_turns
    # must be >= 2); the rest are single-hop.
    two_hop_share: float = 0.0
    # Share answered from memory without a search, under the same search prompt (search format only):
    # the warm-started model then searches on some questions only, and GRPO can learn from the reward
    # that searching pays (scripts/demo.sh). 0 = every demonstration searches.
    no_search_share: float = 0.0
    # Response format taught: search (the protocol of data.protocol) | no_search | rag (the eval's
    # --no-search / --rag baselines, each warm-started in its own format).
    format: str = "search"
    # Seed of demonstration choice, batch order and torch.
    seed: int = 0
    # Parquet files the demonstrations are drawn from; empty = data.train_files. Lets GRPO train on
    # a subset (e.g. two-hop questions only) from a warm-start that saw every kind.
    train_files: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "train_files", tuple(self.train_files))
        for key in ("steps", "batch_size", "n_examples"):
            _check_range(f"warmstart.{key}", getattr(self, key), 1)
        _check_range("warmstart.lr", self.lr, 0, lo_open=True)
        _check_range("warmstart.two_hop_share", self.two_hop_share, 0.0, 1.0)
        _check_range("warmstart.no_search_share", self.no_search_share, 0.0, 1.0)
        if self.no_search_share and self.format != "search":
            raise _fail("warmstart.no_search_share", self.no_search_share,
                        f"0 with warmstart.format={self.format} (it only mixes into search demonstrations)",
                        "set warmstart.no_search_share=0 or warmstart.format=search")
        if self.two_hop_share + self.no_search_share > 1.0:
            raise _fail("warmstart.no_search_share", self.no_search_share,
                        f"at most 1 - warmstart.two_hop_share = {1 - self.two_hop_share}",
                        "lower warmstart.no_search_share or warmstart.two_hop_share")
        _check_choice("warmstart.format", self.format, WARMSTART_FORMATS)
        _check_choice("warmstart.lr_schedule", self.lr_schedule, WARMSTART_LR_SCHEDULES)
        _check_choice("warmstart.batching", self.batching, WARMSTART_BATCHINGS)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "retriever": RetrieverConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "warmstart": WarmstartConfig,
}


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)

    def __post_init__(self):
        # Cross-section rules: the data-parallel split must give every worker whole trajectories.
        t, n = self.trainer, self.rollout.n
        if (t.mini_batch_size * n) % t.n_workers:
            raise _fail("trainer.n_workers", t.n_workers,
                        f"a divisor of mini_batch_size * rollout.n = {t.mini_batch_size * n}",
                        "change trainer.n_workers, trainer.mini_batch_size or rollout.n")
        w = self.warmstart
        if w.enabled and w.format == "search" and w.two_hop_share > 0 and self.rollout.max_turns < 2:
            raise _fail("warmstart.two_hop_share", w.two_hop_share,
                        f"0 when rollout.max_turns < 2 (it is {self.rollout.max_turns}): two-hop demonstrations "
                        f"search twice", "set rollout.max_turns=2 or warmstart.two_hop_share=0")
        a = self.algorithm
        if a.anchor_coef > 0 and a.anchor_two_hop_share > 0 and self.rollout.max_turns < 2:
            raise _fail("algorithm.anchor_two_hop_share", a.anchor_two_hop_share,
                        f"0 when rollout.max_turns < 2 (it is {self.rollout.max_turns}): two-hop demonstrations "
                        f"search twice", "set rollout.max_turns=2 or algorithm.anchor_two_hop_share=0")
        if a.llds_coef > 0 and t.mini_batch_size == t.batch_size and t.ppo_epochs == 1:
            raise _fail("algorithm.llds_coef", a.llds_coef,
                        "0 when each rollout batch gets one update (trainer.mini_batch_size == trainer.batch_size "
                        "and trainer.ppo_epochs == 1): LLDS penalises log pi_theta below log pi_old, which are "
                        "equal in a batch's first update, so the term would be 0",
                        "set trainer.mini_batch_size to a divisor of trainer.batch_size below it, or "
                        "trainer.ppo_epochs >= 2, or algorithm.llds_coef=0")
        if self.rollout.max_start_length < self.data.max_prompt_length:
            raise _fail("rollout.max_start_length", self.rollout.max_start_length,
                        f">= data.max_prompt_length ({self.data.max_prompt_length})",
                        "raise rollout.max_start_length (longer prompts would lose their start)")

    @classmethod
    def from_dict(cls, raw: dict | None) -> "TrainConfig":
        """Build from a nested dict (Hydra's composed config): OmegaConf merges it into the structured
        schema (unknown sections or keys and unconvertible values raise, named), then instantiates
        the dataclasses (their `__post_init__` checks run). Errors are ValueErrors naming the fix."""
        from omegaconf import OmegaConf
        from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

        raw = dict(raw or {})
        raw.pop("hydra", None)
        schema = OmegaConf.structured(cls)
        for node in (schema, *(schema[name] for name in SECTIONS)):
            OmegaConf.set_readonly(node, False)  # frozen dataclasses give read-only nodes; merging writes
        try:
            return OmegaConf.to_object(OmegaConf.merge(schema, raw))
        except ConfigKeyError as exc:
            section, _, key = (exc.full_key or "").partition(".")
            if section not in SECTIONS:
                raise ValueError(f"unknown config section(s) [{section!r}]; valid sections: {list(SECTIONS)}. "
                                 f"Fix: remove or rename it") from None
            raise ValueError(f"unknown config key(s) ['{section}.{key}']; valid keys in {section}: "
                             f"{sorted(f.name for f in dataclasses.fields(SECTIONS[section]))}. Fix: check the "
                             f"spelling (Hydra: use +key=... only for new keys, which this trainer does not "
                             f"accept)") from None
        except OmegaConfBaseException as exc:
            raise _type_error(exc) from None

    def to_dict(self) -> dict:
        return {name: _plain(dataclasses.asdict(getattr(self, name))) for name in SECTIONS}


# Settings a resumed run cannot change: the checkpoint's state would silently override them (AdamW's
# param groups carry lr/betas/weight_decay, the scheduler its base lr, the data loader its seed,
# position and batch boundaries) or they define the KL reference. section -> keys (None = all).
RESUME_BOUND: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "optim": (None, "the optimizer and scheduler state restore the saved value"),
    "model": (("name",), "the checkpoint holds weights of the saved model"),
    "warmstart": (None, "the KL reference is the warm-started model of the saved settings"),
    "trainer": (("batch_size", "mini_batch_size", "seed"),
                "the data loader restores the saved batch boundaries, seed and position"),
    "rollout": (("n",), "the group size is part of the saved batch shape"),
    "data": (("dir", "train_files", "synth_seed"), "the data-loader position indexes the saved training data"),
}


def resume_conflicts(saved: dict, new: dict) -> list[str]:
    """Settings of `new` (TrainConfig.to_dict) that differ from the checkpoint's `saved` config in a
    key listed in RESUME_BOUND; one line each: `key: saved X, new Y (why)`. Other keys (steps,
    logging, validation, retriever, algorithm) apply to the resumed run as set."""
    out = []
    for section, (keys, why) in RESUME_BOUND.items():
        old, cur = saved.get(section, {}), new.get(section, {})
        for key in (keys if keys is not None else sorted(set(old) | set(cur))):
            if key in old and old.get(key) != cur.get(key):
                out.append(f"{section}.{key}: saved {old.get(key)!r}, new {cur.get(key)!r} ({why})")
    return out


def _plain(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


_KINDS = {bool: ("true or false", "write {key}=true or {key}=false"),
          int: ("an integer", "write {key} as a whole number"),
          float: ("a number", "write {key} as a number (e.g. 1.0e-5)"),
          str: ("a string", "quote {key}")}


def _type_error(exc) -> ValueError:
    """A ValueError in `_fail`'s words for an OmegaConf merge/validation error (key, value, type)."""
    key = exc.full_key or "(root)"
    section, _, name = key.partition(".")
    hint = None
    if section in SECTIONS and name:
        hint = typing.get_type_hints(SECTIONS[section]).get(name.split("[")[0])
    if section in SECTIONS and not name:
        return _fail(section, exc.value, "a mapping of keys", f"write {section}: as a section with keys")
    allowed, fix = _KINDS.get(hint, ("a list" if typing.get_origin(hint) is tuple else "its documented type",
                                     "write {key}=[a,b]" if typing.get_origin(hint) is tuple
                                     else "see its comment in configs/grpo_cpu.yaml"))
    return _fail(key, exc.value, allowed, fix.format(key=key))
