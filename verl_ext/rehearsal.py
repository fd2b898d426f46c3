"""The GPU run rehearsed on this CPU, at its own geometry, before a GPU hour is spent.

    bash scripts/train_grpo.sh --rehearse --config-name grpo_verl [key=value ...]
    (python -m verl_ext.main --rehearse ...)

A GPU config can pass --dry-run and every CPU test and still crash in its first GPU hour: the tests
run verl's trainer with other batch sizes, micro-batches and one or two workers. The rehearsal runs
the composed config through verl's own trainer (verl_ext.main -> run_ppo, in a fresh process) with
what a GPU run would have:

    kept       one training worker per GPU of trainer.nnodes x n_gpus_per_node (the data-parallel
               world verl balances the batch over), train batch, rollout.n, mini-batch, every
               micro-batch (the critic's too, for a config with one: verl's critic worker on the same
               workers), epochs, the checkpoint, resume and console/TensorBoard logging settings,
               the agent loop, reward, estimator and trainer mode (verl's plugins in fresh workers)
    shrunk     (each printed, GPU value -> CPU value) the model (a tiny random model of the same
               architecture family, after the project's format warm-start so it searches), prompt /
               response / turn / observation lengths (consistent with every length check), the
               rollout engine (verl_ext.cpu's HF replica), validation samples, steps (1, saved), and
               the CPU settings of configs/verl_cpu/base.yaml (FSDP2, sdpa, float32, no offload)
    added      a real retriever (the synthetic world's BM25 index on a loopback port) and the
               synthetic world's parquet files in place of the configured ones

Phase 1 trains one full step (rollout, old-log-prob and reference passes, every optimizer update)
and saves a checkpoint; phase 2 starts again with resume_mode=auto and loads it on every rank. The
end is one line, `rehearsal passed: ...`, or `rehearsal failed: ...` with the first failure in
plain words and the config key to change.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from verl_ext.recipe import uses_critic

REPO = Path(__file__).resolve().parents[1]
BASE_CPU = Path(__file__).parent / "configs" / "verl_cpu" / "base.yaml"
CONFIG_NAME = "rehearsal"
# Settings of verl_cpu/base.yaml a CPU-only host needs (that file's header says why each): they change
# the platform, not the geometry.
PLATFORM_KEYS = (
    "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.model.override_config.attn_implementation",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile",
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision",
    "actor_rollout_ref.ref.fsdp_config.forward_only",
    "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.agent.num_workers",
    "reward.num_workers",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units",
    "trainer.device",
    "data.dataloader_num_workers",
)
# The same for a config with a critic (verl's critic worker builds its own model and FSDP engine from
# critic.model and critic.fsdp): the platform keys of base.yaml's `critic:` block.
CRITIC_PLATFORM_KEYS = (
    "critic.strategy",
    "critic.model.use_remove_padding",
    "critic.model.override_config.attn_implementation",
    "critic.fsdp.use_torch_compile",
    "critic.fsdp.param_offload",
    "critic.fsdp.optimizer_offload",
    "critic.fsdp.mixed_precision",
)
ACTOR_PATH = "${actor_rollout_ref.model.path}"
# Rehearsal lengths: synthetic-world prompts are ~150 tokens; short turns and observations, the response
# budget as the turns need them. The padded length sets the log-prob passes' memory: a micro-batch of
# 10 x 704 tokens x the stand-in's 49k vocabulary is 1.4 GB of float32 logits per training worker, and
# 8 workers at once ran a 24 GB machine out of memory; 192 + 224 tokens is 0.8 GB.
PROMPT_TOKENS, TURN_TOKENS, OBS_TOKENS = 192, 32, 64
VAL_SAMPLES = 8
# Tokens of the stand-in's own tokenizer (small_vocab_stand_in).
STAND_IN_VOCAB = 2048
# Share of this machine's memory the log-prob passes' logits may take before the chunked kernel is used.
LOG_PROB_MEMORY_SHARE = 0.4
KEEP_LOGGERS = ("console", "tensorboard", "file")
PHASE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Change:
    """One setting the rehearsal changes: key, the GPU config's value, the rehearsal's, why."""

    key: str
    gpu: object
    cpu: object
    why: str

    def line(self) -> str:
        return f"  {self.key}: {_short(self.gpu)} -> {_short(self.cpu)}  ({self.why})"


def _short(value) -> str:
    text = str(OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)
    # the middle goes: a path's end (the stand-in's name) says more than its start
    return text if len(text) <= 60 else text[:26] + "..." + text[-31:]


def world_size(config: DictConfig) -> int:
    return int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)


def stand_in_model(model_path: str) -> tuple[str, str]:
    """(tiny random alias, model_type) of the architecture family of `model_path`: read from its
    config.json when it is a local directory or in the Hugging Face cache, else from the hub id's name."""
    import json

    from search_r1.models import TINY_BY_MODEL_TYPE

    model_type = None
    candidates = [Path(model_path).expanduser() / "config.json"]
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json")
        if isinstance(cached, str):
            candidates.append(Path(cached))
    except Exception:  # not a hub id (a path, an alias): nothing cached under that name
        pass
    for path in candidates:
        if path.is_file():
            model_type = json.loads(path.read_text()).get("model_type")
            break
    if model_type is None:
        name = model_path.lower()
        model_type = next((t for t in ("qwen3", "qwen2", "llama") if t in name), None)
        if "smollm" in name:
            model_type = "llama"
    if model_type not in TINY_BY_MODEL_TYPE:
        raise ValueError(f"actor_rollout_ref.model.path={model_path}: the rehearsal has no tiny stand-in for "
                         f"architecture {model_type or 'unknown'!r} (it has {sorted(TINY_BY_MODEL_TYPE)}). Fix: "
                         f"rehearse with actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct (or another model of "
                         f"a supported family); the geometry checks do not depend on the model")
    return TINY_BY_MODEL_TYPE[model_type], model_type


def small_vocab_stand_in(model_type: str, world_dir: Path, vocab: int = STAND_IN_VOCAB) -> str:
    """A tiny random `model_type` model with its own byte-level BPE tokenizer of `vocab` tokens, trained
    on the synthetic world's passages and questions, with SmolLM2's ChatML template and special tokens
    (built once under $SEARCH_R1_HOME/models). Why: every log-prob pass and update computes logits
    over the vocabulary for each of the step's tokens; with SmolLM2's 49k tokens that was most of an
    8-worker rehearsal's hours on 2 cores, with 1k it is a small part."""
    import json

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from search_r1.models import TINY_QWEN3_SEED, TINY_QWEN3_SHAPE, load_tokenizer
    from search_r1.paths import model_cache_dir

    out = Path(model_cache_dir()) / f"tiny-random-{model_type}-vocab{vocab}"
    if (out / "config.json").is_file():
        return str(out)
    smol = load_tokenizer("smollm2-135m-instruct")
    specials = [smol.pad_token, smol.bos_token, smol.eos_token]  # ids 0, 1, 2 as in SmolLM2

    def texts():  # the passages, and the prompts as the agent loop renders them (instructions included)
        import pandas as pd

        with open(world_dir / "corpus.jsonl") as f:
            for line in f:
                yield json.loads(line)["contents"]
        for name in ("train.parquet", "test.parquet"):
            for messages in pd.read_parquet(world_dir / name, columns=["prompt"])["prompt"]:
                yield smol.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[0], bos_token=specials[1],
                                        eos_token=specials[2], unk_token=specials[0])
    tokenizer.chat_template = smol.chat_template
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), tie_word_embeddings=True, **TINY_QWEN3_SHAPE,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_QWEN3_SEED)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    tmp = out.with_name(out.name + f".{os.getpid()}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)  # a reader never sees half a model directory
    return str(out)


def plan_changes(config: DictConfig, run_dir: Path, retriever_url: str, train_file: str, val_file: str,
                 warm_start: bool = True, stand_in: str | None = None) -> list[Change]:
    """Every change from the GPU config to its CPU rehearsal (pure: reads config, returns the list)."""
    base = OmegaConf.load(BASE_CPU)
    world = world_size(config)
    sel = lambda key: OmegaConf.select(config, key, default=None)  # noqa: E731
    changes: list[Change] = []

    def change(key, value, why):
        if sel(key) != value:
            changes.append(Change(key, sel(key), value, why))

    alias, model_type = stand_in_model(str(config.actor_rollout_ref.model.path))
    model = stand_in or alias
    vocab = f", a {STAND_IN_VOCAB}-token vocabulary" if stand_in else ""
    if warm_start:
        change("actor_rollout_ref.model.path", f"${{search_r1_warmstart:{model}}}",
               f"a tiny random {model_type} (same model code{vocab}), format warm-started so it searches")
    else:
        change("actor_rollout_ref.model.path", f"${{search_r1_model:{model}}}",
               f"a tiny random {model_type} (same model code{vocab}; it writes no tags, so it never searches)")
    for key in PLATFORM_KEYS:
        change(key, OmegaConf.select(base, key), "CPU platform, as configs/verl_cpu/base.yaml")
    if uses_critic(config):
        # the critic runs on the actor's stand-in (same model code, a value head on top), as a critic of
        # the same model does on the GPU; an interpolation of the actor's path already follows it
        raw = OmegaConf.to_container(config.critic.model, resolve=False).get("path")
        if raw != ACTOR_PATH:
            changes.append(Change("critic.model.path", raw, ACTOR_PATH,
                                  "the critic on the actor's stand-in (a value head on the tiny model)"))
        for key in CRITIC_PLATFORM_KEYS:
            change(key, OmegaConf.select(base, key), "CPU platform for the critic, as configs/verl_cpu/base.yaml")
    # the reference is built with an optimizer on CPU (base.yaml header): the actor's, never stepped
    change("actor_rollout_ref.ref.optim", sel("actor_rollout_ref.actor.optim"),
           "CPU platform: the reference is not forward-only (pin_memory needs an accelerator)")
    if world != int(config.trainer.n_gpus_per_node):
        change("trainer.nnodes", 1, f"one machine: the same {world} training workers")
    change("trainer.n_gpus_per_node", world, f"{world} training workers = the data-parallel world size")
    turns = int(config.search_r1.max_turns)
    response = (turns + 1) * TURN_TOKENS + turns * OBS_TOKENS
    change("data.max_prompt_length", PROMPT_TOKENS, "lengths shrunk (synthetic prompts are ~150 tokens)")
    change("data.max_response_length", response, f"{turns + 1} turns x {TURN_TOKENS} + {turns} observations x {OBS_TOKENS}")
    change("search_r1.max_tokens_per_turn", TURN_TOKENS, "lengths shrunk")
    change("search_r1.max_obs_length", OBS_TOKENS, "lengths shrunk")
    change("search_r1.max_context_length", None, "lengths shrunk: prompt + response")
    change("data.train_files", train_file, "the synthetic world (its retriever is started for the rehearsal)")
    change("data.val_files", val_file, "the synthetic world")
    change("data.val_max_samples", VAL_SAMPLES, "validation shrunk")
    change("search_r1.retriever.urls", [retriever_url], "the rehearsal's own retriever")
    # one HF server for all workers: the rollout engine is replaced anyway, and 8 servers on 2 cores
    # ran out of memory (8 x ~1 GB) and batched a few requests each
    change("actor_rollout_ref.rollout.tensor_model_parallel_size", world,
           "rollout engine: one HF server process for all training workers (HF does not shard)")
    # The log-prob passes of all workers run at once in one machine's memory: each materialises a
    # micro-batch of float32 logits over the stand-in's 49k vocabulary, several times over (log-softmax,
    # entropy). When that cannot fit, verl's own chunked torch kernel computes the same log-probs and
    # entropy 512 tokens at a time (model.use_fused_kernels, impl_backend torch); the micro-batches,
    # the thing rehearsed, are unchanged.
    need = _log_prob_memory_gb(config, world, stand_in)
    if need > LOG_PROB_MEMORY_SHARE * _total_memory_gb():
        change("actor_rollout_ref.model.use_fused_kernels", True,
               f"memory: {world} workers' logits at once would need ~{need:.0f} GB; verl's chunked torch log-prob kernel")
        change("actor_rollout_ref.model.fused_kernel_options.impl_backend", "torch", "verl's chunked torch kernel")
    # nucleus sampling sorts the whole vocabulary (49k for the stand-in's tokenizer) at every sampled
    # token: on 2 CPU cores most of a 2,400-trajectory rollout. No batch or micro-batch depends on it.
    change("actor_rollout_ref.rollout.top_p", 1.0, "sampling cost: no per-token vocabulary sort on CPU")
    change("trainer.total_training_steps", 1, "one full step")
    change("trainer.save_freq", 1, "the step saves a checkpoint")
    change("trainer.default_local_dir", str(run_dir / "checkpoints"), "the rehearsal's own directory")
    loggers = [x for x in (sel("trainer.logger") or []) if x in KEEP_LOGGERS] or ["console"]
    change("trainer.logger", loggers, "no remote trackers from a rehearsal")
    change("+warmstart", OmegaConf.to_container(base.warmstart), "the stand-in model's format warm-start")
    env = sel("ray_kwargs.ray_init.runtime_env.env_vars")
    env = {**(OmegaConf.to_container(env) if OmegaConf.is_config(env) else {}),
           **OmegaConf.to_container(base.ray_kwargs.ray_init.runtime_env.env_vars)}
    change("ray_kwargs.ray_init.runtime_env.env_vars", env, "CPU platform in every Ray process, one thread each")
    # logical resources only: each resource-pool bundle reserves CPUs; GPUs are the CPU platform's
    change("ray_kwargs.ray_init.num_cpus", 16 + 4 * world, "logical CPUs for Ray's scheduler")
    change("ray_kwargs.ray_init.num_gpus", world, "the CPU platform's logical GPUs, one per training worker")
    return changes


def _log_prob_memory_gb(config: DictConfig, world: int, stand_in: str | None = None) -> float:
    """Peak float32 logits of the old-log-prob pass on all workers at once, at the rehearsal's lengths:
    workers x micro-batch x tokens x vocabulary x 4 bytes x ~4 live copies (logits, softmax, their
    product for the entropy, log-softmax)."""
    from search_r1.models import load_tokenizer

    micro = int(OmegaConf.select(config, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu") or 1)
    turns = int(config.search_r1.max_turns)
    tokens = PROMPT_TOKENS + (turns + 1) * TURN_TOKENS + turns * OBS_TOKENS
    vocab = STAND_IN_VOCAB if stand_in else len(load_tokenizer("tiny-random-qwen3"))
    return world * micro * tokens * vocab * 4 * 4 / 2**30


def _total_memory_gb() -> float:
    import psutil

    return psutil.virtual_memory().total / 2**30


def apply_changes(config: DictConfig, changes: list[Change]) -> DictConfig:
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    for c in changes:
        value = OmegaConf.create(c.cpu) if isinstance(c.cpu, (dict, list)) else c.cpu
        OmegaConf.update(cfg, c.key.lstrip("+"), value, force_add=True, merge=False)
    return cfg


def write_config(cfg: DictConfig, run_dir: Path) -> Path:
    """The rehearsal's whole config as one primary Hydra config (verl_ext.main loads it)."""
    out = run_dir / "config"
    out.mkdir(parents=True, exist_ok=True)
    full = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    full.hydra = {"run": {"dir": str(run_dir / "hydra")}, "job": {"chdir": False}}
    (out / f"{CONFIG_NAME}.yaml").write_text(OmegaConf.to_yaml(full))
    return out


# -- failures in plain words -----------------------------------------------------------------------
_DIVISIBLE = "data size must be divisible by force_group_size * micro_batch_size_per_gpu"
# verl worker method in the traceback -> (pass, config key of its micro-batch)
_PASSES = (
    ("_update_critic", "critic update", "critic.ppo_micro_batch_size_per_gpu"),
    ("_compute_values", "critic values", "critic.forward_micro_batch_size_per_gpu"),
    ("compute_ref_log_prob", "reference log-prob", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    ("update_actor", "actor update", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("compute_log_prob", "old-log-prob", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
)


def diagnose(log: str, config: DictConfig) -> str:
    """The first failure of a rehearsal log in plain words, with the key to change when known."""
    if _DIVISIBLE in log:
        at = log.index(_DIVISIBLE)
        window = log[max(0, at - 20000):at]
        name, key = next(((n, k) for method, n, k in _PASSES if method in window),
                         ("a", "the micro-batch keys (actor.ppo_micro_batch_size_per_gpu, rollout./ref.log_prob_micro_batch_size_per_gpu,"
                          " critic.ppo_/forward_micro_batch_size_per_gpu)"))
        world = world_size(config)
        share = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
        per_rank = math.ceil(share / world)
        value = OmegaConf.select(config, key, default=None) if key.startswith(("actor_rollout_ref", "critic")) else None
        return (f"verl's engine stopped the {name} pass: each of the {world} data-parallel workers got about "
                f"{per_rank} trajectories ({share} / {world}), which {key}={value} does not divide "
                f"(AssertionError: {_DIVISIBLE}). Fix: {key}=D with D a divisor of the share, or the matching "
                f"*use_dynamic_bsz=true")
    for pattern, text in (
            (r"SearchOutage: (.*)", "every search failed: {0}"),
            (r"\[verl_ext\] config error: (.*)", "the config check failed: {0}"),
            (r"(ImportError: .*flash.*)", "{0} (attention kernel: actor_rollout_ref.model.override_config.attn_implementation)"),
            (r"(OutOfMemoryError.*|Killed.*|.*memory.*exceeded.*)", "out of memory: {0}")):
        m = re.search(pattern, log)
        if m:
            return text.format(m.group(1).strip()[:800])
    errors = [line.strip() for line in log.splitlines() if re.search(r"\b\w*(Error|Exception)\b:", line)]
    return (errors[-1][:800] if errors else "the trainer exited with an error") + " (the full log is named above)"


# -- running ----------------------------------------------------------------------------------------
def _run_phase(config_dir: Path, overrides: list[str], log_path: Path, env: dict) -> tuple[int, str, float, float]:
    from search_r1.procmem import PeakTreeMemory

    cmd = [sys.executable, "-m", "verl_ext.main", "--config-path", str(config_dir), "--config-name", CONFIG_NAME,
           *overrides]
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        mem = PeakTreeMemory(proc.pid, "pss", every=2.0)  # shared pages counted once
        try:
            rc = proc.wait(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        finally:
            peak = mem.stop()
    return rc, log_path.read_text(errors="replace"), time.monotonic() - start, peak


def _step_metrics(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = re.search(r"step:1 - (.*)$", line)
        if m:
            for item in m.group(1).split(" - "):
                key, _, value = item.partition(":")
                out[key.strip()] = value.strip()
    return out


def rehearse(config: DictConfig, source: str, warm_start: bool = True, check_schedule: bool = True) -> int:
    """Run the rehearsal of a composed verl config; print what changed and the verdict; exit code.

    warm_start=False uses the random stand-in as it is (faster; no searches). check_schedule=False lets
    the trainer start even when the recipe card refuses the schedule (the rehearsal's own test: it
    shows the run-time failure the card predicts, named the same way)."""
    from retriever_server.indexes import ensure_default_index
    from retriever_server.launcher import ServerProcess
    from search_r1.data.synth import ensure_world
    from search_r1.paths import default_synth_dir

    import verl_ext.cpu  # noqa: F401  (the config resolvers: the warm-start is built here, once)

    world = world_size(config)
    run_dir = (REPO / "outputs" / "rehearsal" / str(config.trainer.experiment_name)).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    say = lambda text: print(f"[rehearsal] {text}", flush=True)  # noqa: E731
    world_dir = ensure_world(default_synth_dir(), progress=False)
    server = ServerProcess([ensure_default_index()], run_dir / "retriever.log",
                           flags=["--torch-threads", "1", "--faiss-threads", "1"])
    server.start()
    try:
        stand_in = small_vocab_stand_in(stand_in_model(str(config.actor_rollout_ref.model.path))[1], world_dir)
        changes = plan_changes(config, run_dir, server.url, str(world_dir / "train.parquet"),
                               str(world_dir / "test.parquet"), warm_start=warm_start, stand_in=stand_in)
        cfg = apply_changes(config, changes)
        say(f"{source} on {world} training worker(s) (trainer.nnodes x n_gpus_per_node), batch "
            f"{cfg.data.train_batch_size} x rollout.n {cfg.actor_rollout_ref.rollout.n}; changed for this CPU:")
        print("\n".join(c.line() for c in changes), flush=True)
        start = time.monotonic()
        cfg.actor_rollout_ref.model.path = str(cfg.actor_rollout_ref.model.path)  # resolve: warm-start once
        say(f"model: {cfg.actor_rollout_ref.model.path} (built or reused in {time.monotonic() - start:.0f} s)")
        config_dir = write_config(cfg, run_dir)
        env = {**os.environ, "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "RAY_DEDUP_LOGS": "0", "TENSORBOARD_DIR": str(run_dir / "tensorboard"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if not check_schedule:
            from verl_ext.recipe import SKIP_SCHEDULE_CHECK_ENV

            env[SKIP_SCHEDULE_CHECK_ENV] = "1"
        phases = [("train", []), ("resume", ["trainer.val_before_train=false"])]
        total, peak_all, lines = 0.0, 0.0, []
        for name, overrides in phases:
            log_path = run_dir / f"{name}.log"
            say(f"phase {name}: verl's trainer in a fresh process, log {log_path}")
            rc, log, seconds, peak = _run_phase(config_dir, overrides, log_path, env)
            total, peak_all = total + seconds, max(peak_all, peak)
            say(f"phase {name}: exit {rc} after {seconds:.0f} s, peak memory {peak:.1f} GB (PSS)")
            if rc != 0:
                say(f"rehearsal failed in phase {name}: {diagnose(log, cfg)}")
                return 1
            if name == "train":
                m = _step_metrics(log)
                ckpt = Path(cfg.trainer.default_local_dir)
                saved = (ckpt / "latest_checkpointed_iteration.txt")
                if not m or not saved.is_file() or saved.read_text().strip() != "1":
                    say(f"rehearsal failed in phase train: no step-1 metrics or no checkpoint of step 1 in {ckpt}")
                    return 1
                shards = sorted((ckpt / "global_step_1" / "actor").glob("model_world_size_*_rank_*.pt"))
                searches = float(re.sub(r"^np\.\w+\((.*)\)$", r"\1", m.get("env/searches_mean", "nan")))
                lines.append(f"1 step ({searches:.2f} searches per trajectory, {len(shards)} actor shards saved)")
            else:
                if f"[search_r1] resumed from" not in log:
                    say("rehearsal failed in phase resume: the run did not resume the step-1 checkpoint")
                    return 1
                lines.append("auto-resume of it on every worker")
        say(f"rehearsal passed: {source} at its geometry ({world} training workers, "
            f"{cfg.data.train_batch_size} x {cfg.actor_rollout_ref.rollout.n} trajectories per step), "
            f"{', '.join(lines)}; {total / 60:.1f} min, peak {peak_all:.1f} GB")
        return 0
    finally:
        server.stop()
