"""Import one of our modules right after a verl module has been imported (at once if it already is).

verl_ext/__init__.py says why its registering modules wait for verl's registries; this is the hook it
and verl_ext.cpu use. A meta-path finder wraps the loader of each watched verl module, so the modules
waiting on it are imported as soon as it has executed.
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
