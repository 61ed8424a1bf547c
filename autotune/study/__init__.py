"""Study: the ask/tell loop that tunes a config for a traffic shape.

Inputs (preflight, objective, settings), sampler, the loop (ask, suggest, submit,
judge, tell), the verdict against the defaults, the GPU-time account.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.events import (
        StudyEvent,
    )
    from autotune.store import (
        A,
    )
    from autotune.study._budget import (
        BudgetPlan,
        PhaseAccount,
        TrialCost,
        phases_line,
        plan_budget,
    )
    from autotune.study._gputime import (
        GpuTime,
    )
    from autotune.study._inputs import (
        _complete_params as _complete_params,
    )
    from autotune.study._inputs import (
        _retry_stopped as _retry_stopped,
    )
    from autotune.study._inputs import (
        _traffic_streams as _traffic_streams,
    )
    from autotune.study._inputs import (
        make_sampler,
        open_study,
        resolve_inputs,
    )
    from autotune.study._judge import (
        judge,
    )
    from autotune.study._loop import (
        StudyLoop,
        TrialTemplate,
        trial_spec,
    )
    from autotune.study._objective import (
        ResolvedStudy,
        is_open_loop,
        replayed_shape,
        resolve_objective,
        resolve_study,
    )
    from autotune.study._preflight import (
        BYTECODE_PROBES,
        check_bytecode,
        check_context,
        check_vocab_size,
    )
    from autotune.study._rungs import (
        promotion_bar,
        rung0_readings,
        rungs_line,
        screen_for,
    )
    from autotune.study._study import (
        _bind_kernels as _bind_kernels,
    )
    from autotune.study._study import (
        _quality_reference as _quality_reference,
    )
    from autotune.study._study import (
        tune,
    )

__all__ = [
    "BYTECODE_PROBES",
    "A",
    "BudgetPlan",
    "GpuTime",
    "PhaseAccount",
    "ResolvedStudy",
    "StudyEvent",
    "StudyLoop",
    "TrialCost",
    "TrialTemplate",
    "check_bytecode",
    "check_context",
    "check_vocab_size",
    "is_open_loop",
    "judge",
    "make_sampler",
    "open_study",
    "phases_line",
    "plan_budget",
    "promotion_bar",
    "replayed_shape",
    "resolve_inputs",
    "resolve_objective",
    "resolve_study",
    "rung0_readings",
    "rungs_line",
    "screen_for",
    "trial_spec",
    "tune",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.events": ("StudyEvent",),
    "autotune.store": ("A",),
    "autotune.study._budget": ("BudgetPlan", "PhaseAccount", "TrialCost", "phases_line",
                               "plan_budget"),
    "autotune.study._gputime": ("GpuTime",),
    "autotune.study._inputs": (
        "_complete_params",
        "_retry_stopped",
        "_traffic_streams",
        "make_sampler",
        "open_study",
        "resolve_inputs",
    ),
    "autotune.study._judge": ("judge",),
    "autotune.study._loop": ("StudyLoop", "TrialTemplate", "trial_spec"),
    "autotune.study._objective": (
        "ResolvedStudy",
        "is_open_loop",
        "replayed_shape",
        "resolve_objective",
        "resolve_study",
    ),
    "autotune.study._rungs": ("promotion_bar", "rung0_readings", "rungs_line", "screen_for"),
    "autotune.study._preflight": ("BYTECODE_PROBES", "check_bytecode", "check_context",
                                  "check_vocab_size"),
    "autotune.study._study": ("_bind_kernels", "_quality_reference", "tune"),
})
