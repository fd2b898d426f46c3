"""verl's own trainer on a CPU: the platform, the `hf` rollout and the worker, registered with verl.

Imported by `verl_ext` (the `verl.plugins` entry point), so it runs in every process that imports
verl, GPU nodes included. It only adds names to verl's registries; nothing is selected unless the
run asks for it with `VERL_PLATFORM=cpu` and `actor_rollout_ref.rollout.name=hf`
(configs/grpo_verl_cpu.yaml does both):

    platform "cpu"          verl_ext.cpu.platform  -> verl.plugin.platform.PlatformRegistry (at once:
                            verl modules resolve the platform at import time, e.g. transformer_impl)
    rollout replica "hf"    verl_ext.cpu.replica   -> verl.workers.rollout.replica.RolloutReplicaRegistry
    rollout adapter "hf"    verl_ext.cpu.replica   -> verl.workers.rollout.base._ROLLOUT_REGISTRY
                            (both when the `verl.workers.rollout` package is imported)
    rollout replica "vllm"  verl_ext.cpu.vllm_replica -> RolloutReplicaRegistry, wrapping verl's own:
                            on the CPU platform verl's vLLM replica with a CPU weight-sync fix
                            (verl_ext.cpu.vllm_server / vllm_worker; needs the vLLM-on-CPU env,
                            docs/vllm_cpu.md), verl's unchanged elsewhere
    CPU hybrid worker       verl_ext.cpu.worker    (picked by the trainer: cpu_role_worker_mapping)
    config resolvers        ${search_r1_model:NAME} -> local HF dir of a search_r1.models alias/path
                            ${search_r1_synth:SPLIT} -> parquet of the default synthetic world
                            ${search_r1_warmstart:NAME} -> NAME after the format warm-start
                                (search_r1.trainer.warmstart) with the config's `warmstart:` group,
                                data.train_files and search_r1 retriever/limits; cached

It imports no vllm and no model code (the vLLM replica imports vllm only when a run builds it).

    bash scripts/train_grpo.sh --config-name grpo_verl_cpu
"""
from __future__ import annotations


def register() -> None:
    """Register the CPU platform now and the `hf` rollout once verl's rollout package loads (idempotent)."""
    from verl.plugin.platform import PlatformRegistry

    from verl_ext.after_import import register_after_import
    from verl_ext.cpu.platform import PLATFORM_NAME, PlatformCPU

    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    register_after_import("verl.workers.rollout", "verl_ext.cpu.replica")
    register_after_import("verl.workers.rollout", "verl_ext.cpu.vllm_replica")
    _register_resolvers()


def model_dir(name: str) -> str:
    """`${search_r1_model:NAME}`: the local HF directory of a search_r1.models alias or path (built once)."""
    from search_r1.models import resolve_model_path

    return resolve_model_path(name)


def synth_split(split: str) -> str:
    """`${search_r1_synth:SPLIT}`: <default synthetic world>/<split>.parquet, generating the world if missing."""
    from search_r1.data.synth import ensure_world
    from search_r1.paths import default_synth_dir

    path = ensure_world(default_synth_dir(), progress=False) / f"{split}.parquet"
    if not path.is_file():
        raise ValueError(f"${{search_r1_synth:{split}}}: {path} does not exist; the world has train and test splits")
    return str(path)


def warmstart_dir(name: str, *, _root_) -> str:
    """`${search_r1_warmstart:NAME}`: the HF directory of NAME after the format warm-start (built once).

    Why: a model that never writes `<search>`/`<answer>` (tiny-random-qwen3) gets a constant reward
    and issues no searches, so a run shows neither GRPO advantages nor the retriever in use. The
    project's warm-start (masked SFT on demonstrations built from warmstart.train_files, else
    data.train_files, with passages from the run's retriever, cut to search_r1.max_obs_length) fixes
    that; its settings come from the config's `warmstart:` group (search_r1.trainer.config.WarmstartConfig:
    steps, batch_size, lr, lr_schedule, batching, n_examples, seed, format, two_hop_share, train_files;
    enabled=false returns NAME's own directory). The result is cached under
    $SEARCH_R1_HOME/warmstart by settings and demonstrations, so only the first run trains; verl
    resolves the config in the driver and in its task runner, and a file lock keeps that to one build.
    The retriever in search_r1.retriever.urls must be up (it is queried for the demonstrations).
    """
    from omegaconf import OmegaConf

    from search_r1.models import file_lock
    from search_r1.paths import home
    from search_r1.search import RetrieverClient
    from search_r1.trainer.config import WarmstartConfig
    from search_r1.trainer.warmstart import ensure_warmstart
    from verl_ext.agent_loop import SearchR1Settings
    from verl_ext.cpu.platform import compute_threads

    node = _root_.get("warmstart")
    group = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    unknown = sorted(set(group) - set(WarmstartConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"${{search_r1_warmstart:{name}}}: unknown key(s) warmstart.{unknown}; allowed: "
                         f"{sorted(WarmstartConfig.__dataclass_fields__)}")
    w = WarmstartConfig(**group)
    if not w.enabled:
        return model_dir(name)
    settings = SearchR1Settings.from_config(_root_)
    files = w.train_files or _root_.data.train_files  # warmstart.train_files, as in the embedded trainer
    files = [str(files)] if isinstance(files, str) else [str(f) for f in files]
    r = settings.retriever
    client = RetrieverClient(list(r.urls), topk=r.topk, timeout=r.timeout, retries=r.retries)
    # A turn is capped by max_tokens_per_turn, or else by the whole response budget.
    turn = settings.max_tokens_per_turn or int(_root_.actor_rollout_ref.rollout.response_length)
    # verl reads the model path several times per process before resolving the whole config; the
    # cache check itself rebuilds the demonstrations (tokenizer + retriever queries), so remember it.
    key = repr((name, w, files, r.urls, r.topk, settings.max_obs_length, turn, settings.protocol))
    if key not in _WARMSTART_DIRS:
        root = home() / "warmstart"
        with file_lock(root / ".verl_ext.lock"):
            path, _ = ensure_warmstart(name, client, files, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                                       n_examples=w.n_examples, seed=w.seed, max_obs_length=settings.max_obs_length,
                                       max_tokens_per_turn=turn, protocol=settings.protocol, fmt=w.format,
                                       two_hop_share=w.two_hop_share, lr_schedule=w.lr_schedule,
                                       batching=w.batching,
                                       # nothing else computes while the config resolves
                                       compute_dtype="float32", threads=compute_threads(1), cache_root=root,
                                       progress=False)
        _WARMSTART_DIRS[key] = str(path)
    return _WARMSTART_DIRS[key]


_WARMSTART_DIRS: dict[str, str] = {}


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in (("search_r1_model", model_dir), ("search_r1_synth", synth_split),
                     ("search_r1_warmstart", warmstart_dir)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register()
