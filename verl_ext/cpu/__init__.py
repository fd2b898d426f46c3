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
    CPU hybrid worker       verl_ext.cpu.worker    (picked by the trainer: cpu_role_worker_mapping)
    config resolvers        ${search_r1_model:NAME} -> local HF dir of a search_r1.models alias/path
                            ${search_r1_synth:SPLIT} -> parquet of the default synthetic world

It imports no vllm and no model code.

    bash scripts/train_grpo.sh --config-name grpo_verl_cpu
"""
from __future__ import annotations


def register() -> None:
    """Register the CPU platform now and the `hf` rollout once verl's rollout package loads (idempotent)."""
    from verl.plugin.platform import PlatformRegistry

    from verl_ext import register_after_import
    from verl_ext.cpu.platform import PLATFORM_NAME, PlatformCPU

    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    register_after_import("verl.workers.rollout", "verl_ext.cpu.replica")
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


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in (("search_r1_model", model_dir), ("search_r1_synth", synth_split)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register()
