"""verl extensions of Search-R1, loaded by verl in every process through the `verl.plugins` entry
point (setup.py: `search_r1 = verl_ext`; fallback: `actor_rollout_ref.model.external_lib=verl_ext`).

What gets registered, and where verl looks it up:

    agent loop `search_r1`        verl_ext.agent_loop  -> verl.experimental.agent_loop.agent_loop
    advantage `search_r1_grpo`    verl_ext.algos       -> verl.trainer.ppo.core_algos
    policy loss `search_r1_llds`  verl_ext.algos       -> verl.trainer.ppo.core_algos
    trainer mode `search_r1`      verl_ext.trainer     -> verl.trainer.ppo.v1.trainer_base
    critic model loader           verl_ext.critic_model -> verl.utils.model (honours the configured
                                  attention kernel; verl 0.9.1 hard-codes flash_attention_2 there)
    reward function               verl_ext.reward      (by path: pkg://verl_ext.reward, not a registry)

verl imports its plugins at the end of `import verl`, in every process that imports it, including
the embedded CPU trainer's workers that never run an agent loop. Importing the registering modules
there would cost every such process about a second and 200 MB (verl's agent-loop and trainer stacks),
so each one is imported right after the verl module holding its registry has been imported (at once
if it already is). A process that looks a name up has imported the registry first, so the name is
always there in time (the hook: verl_ext/after_import.py). Nothing here imports vllm.
"""
from __future__ import annotations

from verl_ext.after_import import register_after_import

register_after_import("verl.experimental.agent_loop.agent_loop", "verl_ext.agent_loop")
register_after_import("verl.trainer.ppo.core_algos", "verl_ext.algos")
register_after_import("verl.trainer.ppo.v1.trainer_sync", "verl_ext.trainer")
register_after_import("verl.utils.model", "verl_ext.critic_model")
import verl_ext.cpu  # noqa: E402,F401  CPU platform (at once) + `hf` rollout (verl_ext/cpu; cheap, no vllm)
