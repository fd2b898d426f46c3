"""Hydra entry of the verl path: verl's `main_ppo` with Search-R1's checks in front.

    python -m verl_ext.main [--config-name grpo_verl] [key=value ...] [-m ...]
    python -m verl_ext.main --dry-run [key=value ...]     # check, print the resolved config and the
                                                          # recipe card, exit

(`bash scripts/train_grpo.sh --config-name grpo_verl ...` calls this with trainer.n_gpus_per_node set.)

Before Ray starts, the composed config is checked: the `search_r1:` group and the rollout lengths,
the names verl looks up in registries (agent loop, advantage estimator, trainer mode, reward),
verl's own `validate_config`, the data files, and that a retriever answers. A failed check prints
one line naming the key and the fix and exits with status 2; no process is started. Then the recipe
card (verl_ext/recipe.py: the schedule through verl's own normalisation, beside upstream
Search-R1's) is printed, and for a real run written to trainer.default_local_dir/recipe_card.txt;
then the run is verl's own: `run_ppo(config, TaskRunnerV1)`.
"""
from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from search_r1.logs import quiet_library_loggers
from search_r1.trainer.main import StartupError, check_retriever
from verl_ext.recipe import ScheduleError, recipe_card, write_card

log = logging.getLogger("verl_ext.main")

DRY_RUN_FLAG = "--dry-run"
# Printed between the resolved config and the recipe card (the config above it stays parseable YAML).
CARD_RULE = "# " + "-" * 98


class ConfigError(ValueError):
    """A config value that cannot work (the message names the key and the fix)."""


def check_registries(config: DictConfig) -> None:
    """Names verl resolves through registries must be registered (imports verl_ext's modules)."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.v1 import trainer_base  # noqa: F401  (registers verl's own modes)
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from search_r1.rewards import REWARD_FNS

    checks = [
        ("actor_rollout_ref.rollout.agent.default_agent_loop", config.actor_rollout_ref.rollout.agent.default_agent_loop,
         _agent_loop_registry),
        ("algorithm.adv_estimator", config.algorithm.adv_estimator, ADV_ESTIMATOR_REGISTRY),
        ("trainer.v1.trainer_mode", config.trainer.v1.trainer_mode, TRAINER_REGISTRY),
    ]
    reward_fn = config.reward.custom_reward_function
    if reward_fn.get("path") == "pkg://verl_ext.reward":
        checks.append(("reward.custom_reward_function.reward_kwargs.reward",
                       (reward_fn.get("reward_kwargs") or {}).get("reward", "seed"), REWARD_FNS))
    for key, value, registry in checks:
        if value not in registry:
            raise ConfigError(f"{key}={value!r} is not registered; choose one of {sorted(registry)}")


def check_ray_env_vars(config: DictConfig) -> None:
    """ray_kwargs.ray_init.runtime_env.env_vars: Ray takes only strings, but Hydra reads `KEY=2` as a
    number (Ray's TypeError then came from inside ray.init). Numbers become their text in place;
    anything else that is not a string is an error naming the key."""
    from verl_ext.cpu.platform import COMPUTE_THREADS_ENV, parse_compute_threads

    env = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars")
    for name in list(env or {}):
        key = f"ray_kwargs.ray_init.runtime_env.env_vars.{name}"
        value = env[name]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            env[name] = str(value)
        elif value is None:  # `KEY=null`: quoting "None" would set the text None, not unset the variable
            raise ConfigError(f"{key} is null: an environment variable's value is text. Fix: give it a "
                              f"value, e.g. {key}='1', or remove it with ~{key}")
        elif not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: an environment variable's value is text. Fix: quote it, "
                              f"e.g. {key}='{value}'")
        if name == COMPUTE_THREADS_ENV:
            try:
                parse_compute_threads(env[name])
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None


def check_config(config: DictConfig, dry_run: bool = False) -> list[str]:
    """Every check that needs no GPU and no Ray; returns warnings, raises ConfigError on errors."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_ext.agent_loop import SearchR1Settings

    warnings = []
    if config.trainer.device == "cuda" and not dry_run:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA GPU is visible. Fix: run on a GPU node, or run "
                              "verl's trainer on CPU with --config-name grpo_verl_cpu, or check the config "
                              "with --dry-run")
    try:
        settings = SearchR1Settings.from_config(config)
        settings.generation_config(config.actor_rollout_ref.rollout)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None
    check_registries(config)
    check_ray_env_vars(config)
    try:
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
    except (AssertionError, ValueError) as err:
        raise ConfigError(f"verl's validate_config rejected the config: {err}") from None
    for key in ("data.train_files", "data.val_files"):
        files = OmegaConf.select(config, key)
        for f in [files] if isinstance(files, str) else list(files or []):
            if "://" not in str(f) and not os.path.exists(os.path.expanduser(str(f))):
                msg = (f"{key}: {f} does not exist. Fix: prepare the parquet files (python -m "
                       f"search_r1.data.prepare ... --out DIR, or python -m search_r1.data.synth --out DIR) "
                       f"and set {key}=DIR/...")
                if not dry_run:
                    raise ConfigError(msg)
                warnings.append(msg)
    if not dry_run:
        down = []
        for url in settings.retriever.urls:
            try:
                check_retriever(url)
            except StartupError as err:
                down.append(str(err))
        if len(down) == len(settings.retriever.urls):
            raise ConfigError(f"no retriever in search_r1.retriever.urls answers: {down[0]}")
        warnings += down
    return warnings


@hydra.main(config_path="configs", config_name="grpo_verl", version_base=None)
def main(config: DictConfig) -> None:
    quiet_library_loggers()  # after Hydra's logging setup, which resets them
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    try:
        warnings = check_config(config, dry_run=DRY_RUN)
        card = recipe_card(config, source=HydraConfig.get().job.config_name)
    except (ConfigError, ScheduleError) as err:
        print(f"\n[verl_ext] config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    for w in warnings:
        print(f"[verl_ext] warning: {w}", file=sys.stderr, flush=True)
    if DRY_RUN:
        print(OmegaConf.to_yaml(config, resolve=True), flush=True)
        print(f"{CARD_RULE}\n{card}", flush=True)
        return
    if not config.trainer.use_v1:
        print("[verl_ext] config error: trainer.use_v1=false selects verl's deprecated v0 trainer, which the "
              "search_r1 trainer mode does not extend. Fix: trainer.use_v1=true", file=sys.stderr)
        sys.exit(2)
    path = write_card(card, config.trainer.default_local_dir)
    print(f"{CARD_RULE}\n{card}\n[verl_ext] recipe card written to {path}", flush=True)

    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

    run_ppo(config, task_runner_class=TaskRunnerV1)


DRY_RUN = False

if __name__ == "__main__":
    if DRY_RUN_FLAG in sys.argv:  # ours, not Hydra's: take it out before Hydra parses the overrides
        sys.argv.remove(DRY_RUN_FLAG)
        DRY_RUN = True
    main()
