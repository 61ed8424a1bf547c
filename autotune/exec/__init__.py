"""Executors: where the trials of a study run.

Inline (``--no-ray``) or on Ray (each trial on its server's GPUs of one node), and the
placement rules that ask for a trial only when its GPUs are free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.exec._parallel import (
        Executor,
        InlineExecutor,
        RayExecutor,
    )
    from autotune.exec._placement import (
        never_fits,
        with_parallel_rules,
    )

__all__ = [
    "Executor",
    "InlineExecutor",
    "RayExecutor",
    "never_fits",
    "with_parallel_rules",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.exec._parallel": ("Executor", "InlineExecutor", "RayExecutor"),
    "autotune.exec._placement": ("never_fits", "with_parallel_rules"),
})
