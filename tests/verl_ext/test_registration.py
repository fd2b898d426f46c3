"""Registrations reach every Ray process: a fresh actor that only does `import verl` (verl loads the
`verl.plugins` entry point, setup.py) sees the agent loop, the estimator and the trainer mode; with
entry points disabled, `actor_rollout_ref.model.external_lib=verl_ext` (verl's import_external_libs)
does the same. The plugin import itself stays cheap: `import verl` does not pull the agent-loop or
trainer stacks into processes that never use them."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import ray

from tests.verl_ext.helpers import REPO


def _registered() -> dict:
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    return {"agent_loop": _agent_loop_registry.get("search_r1"),
            "estimator": getattr(ADV_ESTIMATOR_REGISTRY.get("search_r1_grpo"), "__name__", None),
            "mode": getattr(TRAINER_REGISTRY.get("search_r1"), "__name__", None)}


def _lookups(external_lib: str | None = None) -> dict:
    """Run inside a fresh process: what verl's registries resolve after `import verl` (and after
    verl's import of `external_lib`, when given)."""
    import sys as _sys

    import verl  # noqa: F401  (loads verl.plugins entry points unless disabled)
    from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: F401  (imports verl's trainer modes)

    out = {"plugin_loaded": "verl_ext" in _sys.modules, **_registered()}
    if external_lib:
        from verl.utils.import_utils import import_external_libs

        import_external_libs(external_lib)  # what HFModelConfig.__post_init__ does with model.external_lib
        out["after_external_lib"] = _registered()
    return out


def test_fresh_ray_actors_see_the_registrations(ray_session):
    # A runtime_env of its own: Ray starts a new worker process for it (no earlier import of verl_ext).
    fresh = {"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SEARCH_R1_PROBE": uuid.uuid4().hex}}
    probe = ray.remote(num_cpus=0)(lambda lib=None: _lookups(lib))
    got = ray.get(probe.options(runtime_env=fresh).remote())
    assert got == {"plugin_loaded": True, "agent_loop": {"_target_": "verl_ext.agent_loop.SearchR1AgentLoop"},
                   "estimator": "compute_search_r1_grpo_advantage", "mode": "SearchR1Trainer"}
    # entry points off: nothing registered, until verl imports model.external_lib=verl_ext
    off = {"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "none", "PYTHONPATH": str(REPO)}}
    bare = ray.get(probe.options(runtime_env=off).remote("verl_ext"))
    assert {k: bare[k] for k in got} == {"plugin_loaded": False, "agent_loop": None, "estimator": None, "mode": None}
    assert bare["after_external_lib"] == {k: got[k] for k in ("agent_loop", "estimator", "mode")}


def test_import_verl_alone_stays_cheap():
    code = ("import sys, verl; heavy = [m for m in ('verl_ext.agent_loop', 'verl_ext.trainer', "
            "'verl.experimental.agent_loop.agent_loop', 'verl.trainer.ppo.v1.trainer_base') if m in sys.modules]; "
            "print('verl_ext' in sys.modules, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert out.stdout.split("\n")[-2] == "True []", out.stderr[-2000:]
