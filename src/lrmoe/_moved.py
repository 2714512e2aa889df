"""Modules that moved into subpackages keep their old import paths.

``import lrmoe.balance`` or ``from lrmoe import comm`` (the flat layout of earlier releases)
resolve to the module's new home, with a :class:`DeprecationWarning` naming it. Only the
import path is kept: the module object is the new one, so its names are the new module's.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module (under lrmoe) -> its home now (a module, or a subpackage that re-exports what it held)
MOVED = {
    "sim.plan": "lrmoe.sim.layer_calls",
    "assignment": "lrmoe.planning.assignment",
    "balance": "lrmoe.planning.balance",
    "comm": "lrmoe.parallel.comm",
    "controller": "lrmoe.planning.controller",
    "dispatch": "lrmoe.parallel.dispatch",
    "fit": "lrmoe.planning.cap_fit",
    "holders": "lrmoe.planning.holders",
    "meter": "lrmoe.memory",
    "placement": "lrmoe.planning.placement",
    "plan": "lrmoe.planning.planner",
    "planners": "lrmoe.planning.strategies",
    "quota_ratio": "lrmoe.planning.quota_ratio",
    "quotas": "lrmoe.planning.quotas",
    "replica_search": "lrmoe.planning.replica_search",
    "replicas": "lrmoe.parallel.replicas",
    "routed": "lrmoe.passes",
    "sampling": "lrmoe.selection.sampling",
    "sharding": "lrmoe.parallel.sharding",
    "strata": "lrmoe.selection.strata",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.target}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:  # the target is already executed
        pass


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds ``lrmoe.<old path>`` and hands out the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):
        root, _, old = fullname.partition(".")
        if root != "lrmoe" or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(MOVED[old]))


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
