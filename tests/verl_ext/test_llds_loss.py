"""The registered policy loss `search_r1_llds` (verl_ext.algos): verl builds its settings from the
overrides a user gives, and on the same batch it equals verl's vanilla loss plus the embedded
trainer's LLDS term (search_r1.algos.llds_loss), value and gradient."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

from search_r1.algos import llds_loss
from verl_ext.algos import LLDS_LOSS_NAME, LLDSPolicyLossConfig

from tests.verl_ext.helpers import verl_config


def actor_config(**overrides):
    cfg = verl_config(**overrides)
    OmegaConf.resolve(cfg)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def llds_actor(coef=0.1, gate="action"):
    return actor_config(actor_rollout_ref__actor__policy_loss___target_="verl_ext.algos.LLDSPolicyLossConfig",
                        actor_rollout_ref__actor__policy_loss__loss_mode=LLDS_LOSS_NAME,
                        actor_rollout_ref__actor__policy_loss__llds_coef=coef,
                        actor_rollout_ref__actor__policy_loss__llds_gate=gate)


def multi_turn_batch(seed=0, n=6, length=12):
    """Two generation turns with an observation (mask 0) between them, right padding, advantages of
    both signs and zero, log pi_theta near log pi_old with both signs of log-ratio."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, length)
    for i in range(n):
        end = length - i % 3
        mask[i, :4] = 1
        mask[i, 7:end] = 1  # tokens 4-6: the observation
    old = -torch.rand(n, length, generator=g) * 3
    logp = old + 0.3 * torch.randn(n, length, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5, -0.5, 2.0])[:, None] * mask
    return logp, old, adv, mask


def test_the_overrides_reach_the_actor_config():
    actor = llds_actor(coef=0.25, gate="response")
    assert isinstance(actor.policy_loss, LLDSPolicyLossConfig)
    assert (actor.policy_loss.loss_mode, actor.policy_loss.llds_coef, actor.policy_loss.llds_gate) == \
        (LLDS_LOSS_NAME, 0.25, "response")


@pytest.mark.parametrize("gate", ["response", "action"])
def test_equals_vanilla_plus_the_embedded_llds_term(gate):
    coef = 0.3
    actor = llds_actor(coef=coef, gate=gate)
    logp, old, adv, mask = multi_turn_batch()
    ours_logp = logp.clone().requires_grad_(True)
    ours, metrics = get_policy_loss_fn(LLDS_LOSS_NAME)(
        old_log_prob=old, log_prob=ours_logp, advantages=adv, response_mask=mask.bool(),
        loss_agg_mode="token-mean", config=actor)
    ours.backward()
    ref_logp = logp.clone().requires_grad_(True)
    vanilla, _ = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=ref_logp, advantages=adv,
                                               response_mask=mask.bool(), loss_agg_mode="token-mean", config=actor)
    term, stats = llds_loss(ref_logp, old, adv, mask, gate=gate, agg="token-mean")  # the embedded trainer's
    assert term.item() > 0 and stats["actor/llds_gated_token_frac"] > 0  # the case exercises the gate
    (vanilla + coef * term).backward()
    torch.testing.assert_close(ours, vanilla + coef * term)
    torch.testing.assert_close(ours_logp.grad, ref_logp.grad)
    assert metrics["actor/llds_loss"] == pytest.approx(stats["actor/llds_loss"])
    assert 0.0 <= metrics["likelihood/preserved_fell_frac"] <= 1.0
    assert "actor/pg_clipfrac" in metrics  # vanilla's own metrics are kept


def test_coef_zero_is_vanilla_and_the_gates_differ_on_a_turn_that_fell():
    logp, old, adv, mask = multi_turn_batch(seed=1)
    vanilla, _ = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=logp, advantages=adv,
                                               response_mask=mask.bool(), config=llds_actor(coef=0.0))
    off, _ = get_policy_loss_fn(LLDS_LOSS_NAME)(old_log_prob=old, log_prob=logp, advantages=adv,
                                                response_mask=mask.bool(), config=llds_actor(coef=0.0))
    assert torch.equal(off, vanilla)
    # one response, turn 1 fell by 0.4, turn 2 rose by 0.6: only the action gate penalises
    mask1 = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.bool)
    o = torch.full((1, 5), -1.0)
    lp = torch.tensor([[-1.2, -1.2, -5.0, -0.7, -0.7]])
    a = torch.ones(1, 5)
    losses = {gate: get_policy_loss_fn(LLDS_LOSS_NAME)(old_log_prob=o, log_prob=lp, advantages=a, response_mask=mask1,
                                                       config=llds_actor(coef=1.0, gate=gate))[1]["actor/llds_loss"]
              for gate in ("response", "action")}
    assert losses["response"] == 0.0 and losses["action"] == pytest.approx(0.4 / 4)


def test_verls_own_policy_loss_config_is_refused_with_the_fix():
    actor = actor_config(actor_rollout_ref__actor__policy_loss__loss_mode=LLDS_LOSS_NAME)
    logp, old, adv, mask = multi_turn_batch()
    with pytest.raises(ValueError, match=r"_target_=verl_ext.algos.LLDSPolicyLossConfig"):
        get_policy_loss_fn(LLDS_LOSS_NAME)(old_log_prob=old, log_prob=logp, advantages=adv,
                                           response_mask=mask.bool(), config=actor)


def test_a_bad_gate_names_the_key_and_the_allowed_values():
    with pytest.raises(Exception, match=r"policy_loss.llds_gate='turn'.*\['response', 'action'\]"):
        llds_actor(gate="turn")
