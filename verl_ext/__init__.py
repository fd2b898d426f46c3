"""verl extensions of Search-R1, loaded by verl in every process through the `verl.plugins` entry
point (setup.py: `search_r1 = verl_ext`; fallback: `actor_rollout_ref.model.external_lib=verl_ext`).

What gets registered, and where verl looks it up:

    agent loop `search_r1`        verl_ext.agent_loop  -> verl.experimental.agent_loop.agent_loop
    advantage `search_r1_grpo`    verl_ext.algos       -> verl.trainer.ppo.core_algos
    trainer mode `search_r1`      verl_ext.trainer     -> verl.trainer.ppo.v1.trainer_base
    reward function               verl_ext.reward      (by path: pkg://verl_ext.reward, not a registry)

verl imports its plugins at the end of `import verl`, in every process that imports it, including
the embedded CPU trainer's workers that never run an agent loop. Importing the registering modules
there would cost every such process about a second and 200 MB (verl's agent-loop and trainer stacks),
so each one is imported right after the verl module holding its registry has been imported (at once
if it already is). A process that looks a name up has imported the registry first, so the name is
always there in time. Nothing here imports vllm.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

# verl module holding a registry -> our module that registers into it.
_AFTER: dict[str, list[str]] = {}


def register_after_import(verl_module: str, our_module: str) -> None:
    """Import `our_module` as soon as `verl_module` has been imported (now, if it already has)."""
    if verl_module in sys.modules:
        importlib.import_module(our_module)
    else:
        _AFTER.setdefault(verl_module, []).append(our_module)


class _Then(importlib.abc.Loader):
    """Runs the real loader, then imports the modules waiting on this one."""

    def __init__(self, loader, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        for ours in _AFTER.pop(self.name, []):
            importlib.import_module(ours)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of a watched verl module (the other finders find it)."""

    def find_spec(self, name, path, target=None):
        if name not in _AFTER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Then(spec.loader, name)
                return spec
        return None


if not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImportFinder())

register_after_import("verl.experimental.agent_loop.agent_loop", "verl_ext.agent_loop")
register_after_import("verl.trainer.ppo.core_algos", "verl_ext.algos")
register_after_import("verl.trainer.ppo.v1.trainer_sync", "verl_ext.trainer")
import verl_ext.cpu  # noqa: E402,F401  CPU platform (at once) + `hf` rollout (verl_ext/cpu; cheap, no vllm)
