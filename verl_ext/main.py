"""Hydra entry of the verl path: verl's `main_ppo` with Search-R1's checks in front.

    python -m verl_ext.main [--config-name grpo_verl] [key=value ...] [-m ...]
    python -m verl_ext.main --dry-run [key=value ...]     # check, print the resolved config and the
                                                          # recipe card, exit
    python -m verl_ext.main --rehearse [key=value ...]    # run this config on CPU at its geometry
                                                          # (verl_ext/rehearsal.py)

(`bash scripts/train_grpo.sh --config-name grpo_verl ...` calls this with trainer.n_gpus_per_node set.)

Before Ray starts, the composed config is checked: the `search_r1:` group and the rollout lengths,
the names verl looks up in registries (agent loop, advantage estimator, trainer mode, reward),
verl's own `validate_config`, the attention kernel (flash_attention_2 needs flash-attn importable),
the data files, and that a retriever answers. A failed check prints one line naming the key and the
fix and exits with status 2; no process is started. Then the recipe card (verl_ext/recipe.py: the
schedule through verl's own normalisation, beside upstream Search-R1's, every micro-batch
divisibility verl asserts at run time) is printed, and for a real run written to
trainer.default_local_dir/recipe_card.txt. A real run then fixes its directory (absolute; in a `-m`
sweep one `job<N>` directory per job) and refuses to auto-resume a checkpoint whose recorded recipe
(run_recipe.json) differs in a setting the checkpoint would override; then the run is verl's own,
`run_ppo(config, TaskRunnerV1)`, with the driver's RETRIEVER_API_KEY forwarded to every Ray worker
(workers on other nodes do not inherit the driver's environment; the key is never printed).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from search_r1.logs import quiet_library_loggers
from search_r1.trainer.main import StartupError, check_retriever
from verl_ext.recipe import SKIP_SCHEDULE_CHECK_ENV, ScheduleError, recipe_card, write_card

log = logging.getLogger("verl_ext.main")

DRY_RUN_FLAG = "--dry-run"
REHEARSE_FLAG = "--rehearse"
# Secrets of the driver's environment that the Ray workers need (the agent loops' retriever client);
# forwarded through Ray's runtime_env, never through the config (verl prints the config).
FORWARDED_SECRETS = ("RETRIEVER_API_KEY",)
RECIPE_RECORD = "run_recipe.json"

# Settings a resumed verl run cannot change: the checkpoint restores the optimizer (lr, betas, weight
# decay live in its param groups, the scheduler its base lr and warmup), the data loader's position
# (batch, files, shuffle, seed), the sharded weights (model, world size, strategy) and the batch shape.
RESUME_BOUND = (
    "actor_rollout_ref.model.path", "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.optim",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n", "critic.optim",
    "critic.model.path", "data.train_files", "data.train_batch_size", "data.shuffle", "data.seed",
    "trainer.nnodes", "trainer.n_gpus_per_node",
)
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


def check_attention(config: DictConfig) -> str | None:
    """The attention kernels verl will build the actor and reference (and a critic) with; an error message
    naming the keys and the fix when it is a FlashAttention one and its package cannot be imported here (verl's
    workers would raise ImportError in init_model, after Ray and the rollout servers started)."""
    import importlib.util

    from verl_ext.recipe import attention, uses_critic

    models = [("actor_rollout_ref.model", attention(config))]
    if uses_critic(config):  # the critic builds its own model from critic.model
        critic = config.critic.model
        models.append(("critic.model", (str((critic.get("override_config") or {}).get("attn_implementation",
                                                                                       "flash_attention_2")),
                                        bool(critic.get("use_remove_padding", False)))))
    modules = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
    for key, (impl, packed) in models:
        module = modules.get(impl)
        if module is None or importlib.util.find_spec(module) is not None:
            continue
        return (f"{key}.override_config.attn_implementation={impl} (verl's default when unset) "
                f"needs the `{module}` package, which this python cannot import; verl's workers would fail in "
                f"init_model. Fix: pip install flash-attn --no-build-isolation (a build for the installed torch), "
                f"or {key}.override_config.attn_implementation=sdpa"
                + (f" {key}.use_remove_padding=false" if packed else ""))
    return None


def check_config(config: DictConfig, dry_run: bool = False) -> list[str]:
    """Every check that needs no GPU and no Ray; returns warnings, raises ConfigError on errors."""
    from hydra.errors import InstantiationException
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_ext.agent_loop import SearchR1Settings
    from verl_ext.recipe import typed_critic

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
    problem = check_attention(config)
    if problem and not dry_run:
        raise ConfigError(problem)
    if problem:
        warnings.append(problem)
    try:
        # verl's validate_config builds the typed critic config with its model, and HFModelConfig loads
        # the model's config and tokenizer (a download for a hub id, an error offline); the critic's
        # part of validate_config runs here on the typed config without the model (typed_critic).
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=False)
        if need_critic(config):
            n_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
            typed_critic(config).validate(n_gpus, config.data.train_batch_size)
    except (AssertionError, ValueError, InstantiationException) as err:  # the last: a typed config's __post_init__
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


def job_local_dir(config: DictConfig) -> str:
    """The run's checkpoint directory, absolute (Ray workers resolve a relative one against their own
    working directory, on another node another disk); in a `-m` sweep, `<dir>/job<N>`: the jobs of a
    sweep share the composed default_local_dir, and with resume_mode=auto job 2 would load job 1's
    checkpoint (and train 0 steps, or continue it at another setting)."""
    from hydra.types import RunMode

    path = os.path.abspath(os.path.expanduser(str(config.trainer.default_local_dir)))
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not under @hydra.main (tests, notebooks)
        return path
    if hydra_cfg.mode == RunMode.MULTIRUN:
        path = os.path.join(path, f"job{hydra_cfg.job.num}")
    return path


def recipe_record(config: DictConfig) -> dict:
    """The RESUME_BOUND settings of a config, resolved (what run_recipe.json records)."""
    out = {}
    for key in RESUME_BOUND:
        value = OmegaConf.select(config, key, default=None)
        out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def _flatten(prefix: str, value) -> dict:
    if isinstance(value, dict):
        return {k: v for name, sub in value.items() for k, v in _flatten(f"{prefix}.{name}", sub).items()}
    return {prefix: value}


def check_resume_record(config: DictConfig, run_dir: str) -> None:
    """With resume_mode=auto and a checkpoint in run_dir, refuse when the recorded recipe differs in a
    RESUME_BOUND setting (ConfigError naming each key, both values and the fix); else (re)write the
    record. A checkpoint without a record (an older run) is resumed as before, with a warning."""
    record = recipe_record(config)
    path = os.path.join(run_dir, RECIPE_RECORD)
    has_ckpt = os.path.exists(os.path.join(run_dir, "latest_checkpointed_iteration.txt"))
    if config.trainer.resume_mode == "auto" and has_ckpt:
        if not os.path.exists(path):
            print(f"[verl_ext] warning: {run_dir} holds a checkpoint but no {RECIPE_RECORD}; resuming it without "
                  f"checking that its settings match this run's", file=sys.stderr, flush=True)
        else:
            with open(path) as f:
                saved = json.load(f)
            old = {k: v for key, value in saved.items() for k, v in _flatten(key, value).items()}
            new = {k: v for key, value in record.items() for k, v in _flatten(key, value).items()}
            diff = [f"{k}: saved {old.get(k)!r}, now {new.get(k)!r}" for k in sorted(set(old) | set(new))
                    if old.get(k) != new.get(k)]
            if diff:
                raise ConfigError(
                    f"trainer.resume_mode=auto would resume the checkpoint in {run_dir}, whose run had other "
                    f"settings that the checkpoint would override or that change the batch shape:\n  - "
                    + "\n  - ".join(diff) + "\nFix: a new directory for this run (trainer.experiment_name=NEW "
                    "or trainer.default_local_dir=DIR), or trainer.resume_mode=disable to start over there, "
                    "or set these back to continue that run")
            return
    os.makedirs(run_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextmanager
def forwarded_secrets(names=FORWARDED_SECRETS):
    """While active, every `ray.init` gets the driver's values of `names` in runtime_env.env_vars (a
    value the config sets explicitly wins). verl's run_ppo prints its ray.init arguments before the
    call, so the secrets reach the workers without appearing in the log."""
    import ray

    secrets = {name: os.environ[name] for name in names if os.environ.get(name)}
    real_init = ray.init

    def init(*args, runtime_env=None, **kwargs):
        env = dict(runtime_env or {})
        env["env_vars"] = {**secrets, **(env.get("env_vars") or {})}
        return real_init(*args, runtime_env=env, **kwargs)

    ray.init = init if secrets else real_init
    try:
        yield sorted(secrets)
    finally:
        ray.init = real_init


@hydra.main(config_path="configs", config_name="grpo_verl", version_base=None)
def main(config: DictConfig) -> None:
    quiet_library_loggers()  # after Hydra's logging setup, which resets them
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    try:
        # the rehearsal replaces data, model, retriever and attention with CPU ones: checked as a dry run
        warnings = check_config(config, dry_run=DRY_RUN or REHEARSE)
        try:
            card = recipe_card(config, source=HydraConfig.get().job.config_name)
        except ScheduleError as err:
            if os.environ.get(SKIP_SCHEDULE_CHECK_ENV) != "1":
                raise
            card = f"(recipe card skipped, {SKIP_SCHEDULE_CHECK_ENV}=1: {err})"
    except (ConfigError, ScheduleError) as err:
        print(f"\n[verl_ext] config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    for w in warnings:
        print(f"[verl_ext] warning: {w}", file=sys.stderr, flush=True)
    if DRY_RUN:
        print(OmegaConf.to_yaml(config, resolve=True), flush=True)
        print(f"{CARD_RULE}\n{card}", flush=True)
        return
    if REHEARSE:
        from verl_ext.rehearsal import rehearse

        print(f"{CARD_RULE}\n{card}", flush=True)
        sys.exit(rehearse(config, source=HydraConfig.get().job.config_name))
    if not config.trainer.use_v1:
        print("[verl_ext] config error: trainer.use_v1=false selects verl's deprecated v0 trainer, which the "
              "search_r1 trainer mode does not extend. Fix: trainer.use_v1=true", file=sys.stderr)
        sys.exit(2)
    config.trainer.default_local_dir = job_local_dir(config)
    try:
        check_resume_record(config, config.trainer.default_local_dir)
    except ConfigError as err:
        print(f"\n[verl_ext] config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    path = write_card(card, config.trainer.default_local_dir)
    print(f"{CARD_RULE}\n{card}\n[verl_ext] recipe card written to {path}", flush=True)

    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

    with forwarded_secrets() as names:
        if names:
            print(f"[verl_ext] forwarding {', '.join(names)} from this shell to every Ray worker", flush=True)
        run_ppo(config, task_runner_class=TaskRunnerV1)


DRY_RUN = False
REHEARSE = False

if __name__ == "__main__":
    # ours, not Hydra's: take them out before Hydra parses the overrides
    if DRY_RUN_FLAG in sys.argv:
        sys.argv.remove(DRY_RUN_FLAG)
        DRY_RUN = True
    if REHEARSE_FLAG in sys.argv:
        sys.argv.remove(REHEARSE_FLAG)
        REHEARSE = True
    main()
