"""PPO with a critic on the verl path (configs/ppo_verl.yaml): observation tokens (response_mask 0 inside
a response, as the agent loop writes them) count neither in verl's value loss nor in its GAE, shown with
verl 0.9.1's own functions on hand-made batches; and the config builds the critic worker verl's v1
trainer would build, with the micro-batches the recipe card checks."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import compute_gae_advantage_return
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPCriticConfig
from verl.workers.utils.losses import value_loss

from verl_ext.main import check_config
from verl_ext.recipe import typed_critic

from tests.verl_ext.helpers import ppo_config

# B = 2 trajectories, P = 2 prompt tokens, R = 4 response tokens.
# row 0: generated, observation, observation, generated; row 1: generated, observation, generated, padding
RESPONSE_MASK = torch.tensor([[1, 0, 0, 1], [1, 0, 1, 0]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])  # (B, P + R)
OBS_FLAT = (2, 3, 8)  # observation tokens' positions in the critic's flat output (see _critic_batch)


def _critic_batch():
    """The batch verl's critic loss gets (padded tensors) and the value model's flat output: one value per
    token of each sequence back to back (row 0: 2 + 4 = 6, row 1: 2 + 3 = 5; 11 in all). verl reads the
    value of response token t at the position before it (no_padding_2_padding): row 0 flat[1:5], row 1
    flat[7:10]. Old values 0, returns 1 everywhere; predictions 0.5, 0.0 (row 0) and 1.0, 0.0 (row 1) on
    generated tokens, 100 on observation tokens."""
    data = TensorDict({"prompts": torch.ones(2, 2, dtype=torch.long), "responses": torch.ones(2, 4, dtype=torch.long),
                       "attention_mask": ATTENTION, "response_mask": RESPONSE_MASK,
                       "values": torch.zeros(2, 4), "returns": torch.ones(2, 4)}, batch_size=[2])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    flat = torch.zeros(11)
    flat[[1, 4, 7, 9]] = torch.tensor([0.5, 0.0, 1.0, 0.0])  # generated tokens
    flat[list(OBS_FLAT)] = 100.0  # observation tokens: far off their return
    return data, flat.requires_grad_(True)


def test_observation_tokens_do_not_contribute_to_the_value_loss():
    """verl's `value_loss` (what its v1 trainer binds to the critic worker: trainer_base
    `partial(value_loss, config=critic_cfg)`) on a hand-made batch."""
    config = FSDPCriticConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, cliprange_value=100.0,
                              loss_agg_mode="token-mean")  # a wide clip: the plain squared error
    data, flat = _critic_batch()
    loss, metrics = value_loss(config, {"values": flat}, data)
    # 0.5 x mean over the 4 generated tokens of (v - 1)^2 = 0.5 x (0.25 + 1 + 0 + 1) / 4 = 0.28125;
    # an observation token (100 - 1)^2 = 9801 would dominate it
    assert abs(float(loss) - 0.28125) < 1e-6
    loss.backward()
    # d/dv of 0.5 (v - 1)^2 / 4 = (v - 1) / 4 on generated tokens, exactly 0 on observation tokens
    assert flat.grad[list(OBS_FLAT)].tolist() == [0.0, 0.0, 0.0]
    assert flat.grad[[1, 4, 7, 9]].tolist() == [-0.125, -0.25, 0.0, -0.25]
    assert metrics["critic/vpred_mean"] == 0.375  # (0.5 + 0 + 1 + 0) / 4: observations not in the metric either


def test_gae_skips_observation_tokens():
    """verl's GAE (gamma = lambda = 1, as ppo_verl): an observation token's value changes nothing at the
    generated tokens, and its advantage carries the next generated token's."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])  # the score on the last generated token

    def gae(obs_value):
        values = torch.tensor([[0.2, obs_value, obs_value, 0.4], [0.1, obs_value, 0.3, 0.0]])
        return compute_gae_advantage_return(rewards, values, RESPONSE_MASK, gamma=1.0, lam=1.0)

    (adv, ret), (adv2, ret2) = gae(5.0), gae(-5.0)
    generated = RESPONSE_MASK.bool()
    assert torch.equal(adv[generated], adv2[generated]) and torch.equal(ret[generated], ret2[generated])
    # gamma = lambda = 1: each generated token's return is the trajectory's score, 1
    assert ret[generated].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_ppo_verl_builds_the_critic_verl_would_run():
    """The critic worker's engine config (verl's typed config, what the v1 trainer hands the worker):
    fixed micro-batches from ppo_verl's keys, the actor's model, upstream's lr and warmup; verl's
    own critic validation passes without loading the model."""
    cfg = ppo_config()
    critic = typed_critic(cfg)
    engine = critic.engine
    assert (engine.use_dynamic_bsz, engine.micro_batch_size_per_gpu, engine.infer_micro_batch_size_per_gpu) == \
        (False, 4, 8)
    assert (critic.optim.lr, critic.optim.lr_warmup_steps_ratio, critic.cliprange_value) == (1e-5, 0.05, 0.5)
    assert OmegaConf.select(cfg, "critic.model.path") == cfg.actor_rollout_ref.model.path
    a, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    assert (algo.adv_estimator, algo.gamma, algo.lam, algo.use_kl_in_reward, algo.kl_ctrl.kl_coef, a.use_kl_loss) == \
        ("gae", 1.0, 1.0, True, 0.001, False)
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, a.ppo_mini_batch_size, a.optim.lr,
            a.optim.lr_warmup_steps_ratio, cfg.trainer.total_training_steps) == (512, 1, 256, 1e-6, 0.95, 305)
    assert all("does not exist" in w for w in check_config(cfg, dry_run=True))


def test_the_critics_attention_kernel_is_checked_too():
    """The critic builds its own model from critic.model: flash_attention_2 there needs flash_attn as the
    actor's does (verl's critic worker would fail in init_model), and the message names the critic's keys."""
    import importlib.util

    from verl_ext.main import check_attention

    assert check_attention(ppo_config()) is None  # sdpa on both
    cfg = ppo_config(critic__model__override_config__attn_implementation="flash_attention_2",
                     critic__model__use_remove_padding=True)
    problem = check_attention(cfg)
    if importlib.util.find_spec("flash_attn") is None:
        assert problem.startswith("critic.model.override_config.attn_implementation=flash_attention_2")
        assert problem.endswith("critic.model.override_config.attn_implementation=sdpa "
                                "critic.model.use_remove_padding=false")
    else:
        assert problem is None


def _critic_hf_config(path, attention):
    """The critic's HF config as verl's HFModelConfig and engine prepare it (config.model.py, then
    transformer_impl._build_module): the configured kernel, one label, no dropout."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, attn_implementation=attention)
    config.num_labels, config.classifier_dropout = 1, 0.0
    return config


def test_the_critic_loads_with_the_configured_attention_kernel():
    """verl 0.9.1's `load_valuehead_model` hard-codes flash_attention_2: without flash_attn (and trl) the
    critic worker died at start (the ppo_verl rehearsal's failure). verl_ext.critic_model replaces it in
    verl.utils.model, where verl's engine looks it up, with a loader that uses the configured kernel."""
    import importlib.util

    import verl.utils.model as verl_model

    import verl_ext.critic_model as ours
    from search_r1.models import resolve_model_path

    assert verl_model.load_valuehead_model is ours.load_valuehead_model  # installed by the verl plugin hook
    path = resolve_model_path("tiny-random-llama")
    model = verl_model.load_valuehead_model(path, torch.float32, _critic_hf_config(path, "sdpa"), False)
    assert type(model).__name__ == "LlamaForTokenClassification" and model.config._attn_implementation == "sdpa"
    values = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert values.shape == (1, 3, 1)  # one value per token: what verl's critic reads
    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("trl") is None:
        with pytest.raises(RuntimeError, match="please install trl"):  # verl's own loader, the bug
            ours.VERL_LOADER(path, torch.float32, _critic_hf_config(path, "sdpa"), False)
        # a kernel the machine lacks: the error names the key and the fix, not trl
        with pytest.raises(RuntimeError, match=r"attn_implementation=flash_attention_2 .*critic\.model\."
                                               r"override_config\.attn_implementation.*flash-attn"):
            ours.load_valuehead_model(path, torch.float32, _critic_hf_config(path, "flash_attention_2"), False)

