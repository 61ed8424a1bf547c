"""Search space: YAML -> Optuna distributions, conditions, rules and engine argv.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.space._facts import (
        ModelFacts,
    )
    from autotune.space._space import (
        ROUTING_SIMULATION_ENV,
        Knob,
        LaunchSpec,
        SearchSpace,
        dummy_routing_warning,
        load_space,
    )

__all__ = [
    "ROUTING_SIMULATION_ENV",
    "Knob",
    "LaunchSpec",
    "ModelFacts",
    "SearchSpace",
    "dummy_routing_warning",
    "load_space",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.space._facts": ("ModelFacts",),
    "autotune.space._space": (
        "Knob",
        "LaunchSpec",
        "ROUTING_SIMULATION_ENV",
        "SearchSpace",
        "dummy_routing_warning",
        "load_space",
    ),
})
