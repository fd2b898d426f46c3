"""The rehearsal's plan (verl_ext/rehearsal.py), without running it: the GPU config's geometry is kept
exactly, everything it changes is listed with both values, and a failed run's log is read back into
the config key to change."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_ext.rehearsal import apply_changes, diagnose, plan_changes, stand_in_model

from tests.verl_ext.helpers import ppo_config, verl_config

GEOMETRY = ("data.train_batch_size", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.ppo_mini_batch_size",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_epochs",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "trainer.resume_mode",
            "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.kl_loss_coef", "algorithm.adv_estimator",
            "trainer.v1.trainer_mode", "actor_rollout_ref.rollout.agent.default_agent_loop")


def plan(cfg, **kw):
    changes = plan_changes(cfg, Path("/tmp/rehearsal"), "http://127.0.0.1:1/retrieve", "/w/train.parquet",
                           "/w/test.parquet", **kw)
    return {c.key: c for c in changes}, apply_changes(cfg, changes)


def test_the_geometry_is_kept_and_every_change_is_listed():
    gpu = verl_config(trainer__nnodes=2, trainer__logger=["console", "wandb"])  # the 2 x 8 example of multinode.md
    gpu.actor_rollout_ref.model.path = "Qwen/Qwen2.5-3B-Instruct"
    changes, cpu = plan(gpu)
    for key in GEOMETRY:
        assert OmegaConf.select(cpu, key) == OmegaConf.select(gpu, key), key
        assert key not in changes, key
    # 2 nodes x 8 GPUs -> one machine with 16 training workers: the same data-parallel world size
    assert (cpu.trainer.nnodes, cpu.trainer.n_gpus_per_node, cpu.ray_kwargs.ray_init.num_gpus) == (1, 16, 16)
    assert changes["trainer.nnodes"].gpu == 2 and changes["trainer.n_gpus_per_node"].cpu == 16
    # the model: a tiny random model of the same family, warm-started
    assert changes["actor_rollout_ref.model.path"].cpu == "${search_r1_warmstart:tiny-random-qwen2}"
    # CPU platform settings from verl_cpu/base.yaml, each listed with both values
    assert (changes["actor_rollout_ref.actor.strategy"].gpu, changes["actor_rollout_ref.actor.strategy"].cpu) == \
        ("fsdp", "fsdp2")
    assert changes["actor_rollout_ref.rollout.name"].cpu == "hf" and cpu.trainer.device == "cpu"
    # the rollout engine is replaced: one HF server for all 16 workers (its TP spans them); the sampling
    # cost of a nucleus sort over the vocabulary is dropped
    assert (cpu.actor_rollout_ref.rollout.tensor_model_parallel_size, cpu.actor_rollout_ref.rollout.top_p) == (16, 1.0)
    assert OmegaConf.to_container(cpu.actor_rollout_ref.ref.optim) == OmegaConf.to_container(gpu.actor_rollout_ref.actor.optim)
    # lengths shrunk consistently: 3 turns x 32 + 2 observations x 64, prompt + response as the context
    assert (cpu.data.max_prompt_length, cpu.data.max_response_length, cpu.search_r1.max_tokens_per_turn,
            cpu.search_r1.max_obs_length, cpu.search_r1.max_context_length) == (192, 224, 32, 64, None)
    assert (cpu.trainer.total_training_steps, cpu.trainer.save_freq) == (1, 1)
    assert list(cpu.trainer.logger) == ["console"] and cpu.search_r1.retriever.urls == ["http://127.0.0.1:1/retrieve"]
    # 16 workers' old-log-prob logits at once (16 x 10 x 416 tokens x 49k x 4 B x ~4 copies, ~49 GB) cannot
    # fit this machine: verl's chunked torch kernel computes the same log-probs; one worker's can
    assert changes["actor_rollout_ref.model.use_fused_kernels"].cpu is True
    assert cpu.actor_rollout_ref.model.fused_kernel_options.impl_backend == "torch"
    single, _ = plan(verl_config(trainer__n_gpus_per_node=1))
    assert "actor_rollout_ref.model.use_fused_kernels" not in single
    # every change prints as `key: GPU value -> CPU value  (why)`
    line = changes["actor_rollout_ref.actor.strategy"].line()
    assert line.startswith("  actor_rollout_ref.actor.strategy: fsdp -> fsdp2  (")
    # FlashAttention on the GPU config: sdpa here, and it shows
    flash = verl_config(actor_rollout_ref__model__override_config__attn_implementation="flash_attention_2",
                        actor_rollout_ref__model__use_remove_padding=True)
    changes, _ = plan(flash, warm_start=False)
    assert changes["actor_rollout_ref.model.override_config.attn_implementation"].cpu == "sdpa"
    assert changes["actor_rollout_ref.model.use_remove_padding"].cpu is False
    assert changes["actor_rollout_ref.model.path"].cpu == "${search_r1_model:tiny-random-qwen3}"


def test_stand_in_by_architecture_family(tmp_path):
    assert stand_in_model("Qwen/Qwen2.5-3B-Instruct") == ("tiny-random-qwen2", "qwen2")
    assert stand_in_model("Qwen/Qwen3-4B") == ("tiny-random-qwen3", "qwen3")
    assert stand_in_model("meta-llama/Llama-3.2-3B-Instruct") == ("tiny-random-llama", "llama")
    local = tmp_path / "m"
    local.mkdir()
    (local / "config.json").write_text('{"model_type": "qwen2"}')
    assert stand_in_model(str(local)) == ("tiny-random-qwen2", "qwen2")  # read from config.json, not the name
    with pytest.raises(ValueError, match=r"no tiny stand-in for architecture 'mistral'.*Fix"):
        (local / "config.json").write_text('{"model_type": "mistral"}')
        stand_in_model(str(local))


def test_a_failed_log_names_the_key():
    cfg = verl_config(trainer__n_gpus_per_node=4, data__train_batch_size=4, actor_rollout_ref__rollout__n=3,
                      actor_rollout_ref__rollout__log_prob_micro_batch_size_per_gpu=2)
    log = ("(TaskRunnerV1) File \".../trainer_base.py\", line 1658, in _compute_old_log_prob\n"
           "    output: KVBatchMeta = self.actor_rollout_wg.compute_log_prob(batch)\n"
           "ray.exceptions.RayTaskError(AssertionError): ... File \".../utils.py\", line 125, in prepare_micro_batches\n"
           "AssertionError: data size must be divisible by force_group_size * micro_batch_size_per_gpu\n")
    text = diagnose(log, cfg)
    assert text.startswith("verl's engine stopped the old-log-prob pass: each of the 4 data-parallel workers got about 3")
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 does not divide" in text
    ref_log = log.replace("_compute_old_log_prob", "_compute_ref_log_prob").replace("compute_log_prob(", "compute_ref_log_prob(")
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu" in diagnose(ref_log, cfg)
    assert diagnose("boom\nValueError: something odd\n", cfg).startswith("ValueError: something odd")


CRITIC_GEOMETRY = ("critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu",
                   "critic.forward_micro_batch_size_per_gpu", "critic.fsdp.use_dynamic_bsz",
                   "critic.fsdp.micro_batch_size_per_gpu", "critic.fsdp.infer_micro_batch_size_per_gpu",
                   "critic.optim.lr", "critic.optim.lr_warmup_steps_ratio", "critic.cliprange_value",
                   "algorithm.gamma", "algorithm.lam", "algorithm.use_kl_in_reward", "trainer.critic_warmup")


def test_ppo_plan_keeps_the_critics_geometry_and_puts_it_on_the_stand_in():
    gpu = ppo_config()
    gpu.actor_rollout_ref.model.path = "Qwen/Qwen2.5-3B-Instruct"
    changes, cpu = plan(gpu)
    for key in GEOMETRY + CRITIC_GEOMETRY:
        assert OmegaConf.select(cpu, key) == OmegaConf.select(gpu, key), key
        assert key not in changes, key
    # the critic follows the actor's path by interpolation: the actor's stand-in, no change of its own
    assert "critic.model.path" not in changes
    assert OmegaConf.to_container(cpu.critic.model, resolve=False)["path"] == "${actor_rollout_ref.model.path}"
    assert changes["actor_rollout_ref.model.path"].cpu == "${search_r1_warmstart:tiny-random-qwen2}"
    # the critic's CPU platform keys, as the actor's: FSDP2, no compile, no offload (FSDP2's offload
    # policy pins memory), float32
    assert (changes["critic.strategy"].gpu, changes["critic.strategy"].cpu) == ("fsdp", "fsdp2")
    assert (cpu.critic.fsdp.param_offload, cpu.critic.fsdp.optimizer_offload, cpu.critic.fsdp.use_torch_compile) == \
        (False, False, False)
    assert OmegaConf.to_container(cpu.critic.fsdp.mixed_precision) == \
        {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    model = cpu.critic.model
    assert (model.use_remove_padding, model.override_config.attn_implementation) == (False, "sdpa")
    # a critic of another model: put on the actor's stand-in, and listed
    other, cpu = plan(ppo_config(critic__model__path="Qwen/Qwen2.5-7B-Instruct"))
    assert (other["critic.model.path"].gpu, other["critic.model.path"].cpu) == \
        ("Qwen/Qwen2.5-7B-Instruct", "${actor_rollout_ref.model.path}")
    # a config without a critic gets no critic changes
    assert not [k for k in plan(verl_config())[0] if k.startswith("critic.")]


def test_a_failed_critic_pass_names_the_critic_key():
    cfg = ppo_config(trainer__n_gpus_per_node=4, critic__ppo_micro_batch_size_per_gpu=3)
    log = ("(TaskRunnerV1) File \".../trainer_base.py\", line 1818, in _update_critic\n"
           "    output: DataProtoFuture = self.critic_wg.train_mini_batch(batch)\n"
           "AssertionError: data size must be divisible by force_group_size * micro_batch_size_per_gpu\n")
    text = diagnose(log, cfg)
    assert text.startswith("verl's engine stopped the critic update pass")
    assert "critic.ppo_micro_batch_size_per_gpu=3 does not divide" in text
    values = diagnose(log.replace("_update_critic", "_compute_values"), cfg)
    assert values.startswith("verl's engine stopped the critic values pass")
    assert "critic.forward_micro_batch_size_per_gpu=8 does not divide" in values
