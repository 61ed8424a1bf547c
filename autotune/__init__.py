"""autotune: a Bayesian traffic-shape auto-tuner for vLLM.

The pipeline, a package per step: recorded traffic (:mod:`autotune.traffic`) -> search
space (:mod:`autotune.space`) -> study (:mod:`autotune.study`) -> trial
(:mod:`autotune.trial`: engine up, replay, measure, engine down) -> what a study stores
(:mod:`autotune.store`) -> results (:mod:`autotune.results`: files, MLflow, the best config
per shape). docs/architecture.md draws the layers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "lazy_exports"]


def lazy_exports(package: str, modules: Mapping[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) for the names its modules define.

    ``modules`` maps a module to the names the package re-exports from it. A name is
    imported on first use and then kept in the package, so that importing a package, or one
    of its private modules, loads no other module of it (as a flat module would not)."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
