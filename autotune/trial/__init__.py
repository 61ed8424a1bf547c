"""Trial: one config measured on one server.

Engine up, warm-up, measured replays (closed loop or open loop), quality probe, engine
down; capacity levels and the bracketing search of ``--objective capacity``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.engine import (
        compile_seconds,
        start_phases,
    )
    from autotune.trial._capacity import (
        CapacityRecord,
        CapacityResult,
        CapacitySearch,
        Level,
        LevelRecord,
        flat_note,
        search_capacity,
    )
    from autotune.trial._levels import (
        LEVEL_SPAN,
        CapacityFields,
        LevelPlan,
        capacity_spec,
        find_capacity,
        fit_level,
        level_abort,
        prime_contexts,
        recorded_rate,
        request_seconds,
        start_after_warmup,
        warmup_bound,
    )
    from autotune.trial._modes import (
        MODES,
        TrialMode,
        mode_for,
    )
    from autotune.trial._open_segments import (
        STEADY_SPANS,
        OpenRun,
        backlog_grows,
        cut_bounds,
        idle_note,
    )
    from autotune.trial._open_trial import (
        _capacity_metrics as _capacity_metrics,
    )
    from autotune.trial._replay import (
        _plan as _plan,
    )
    from autotune.trial._replay import (
        model_vocab_size,
    )
    from autotune.trial._spec import (
        INTERRUPT,
        TrialOutcome,
        TrialSpec,
        WarmupRecord,
        interrupt,
        model_max_len,
    )
    from autotune.trial._trial import (
        _compile_in as _compile_in,
    )
    from autotune.trial._trial import (
        _phases_in as _phases_in,
    )
    from autotune.trial._trial import (
        run_trial,
        run_trials_on_one_server,
    )

__all__ = [
    "INTERRUPT",
    "LEVEL_SPAN",
    "MODES",
    "STEADY_SPANS",
    "CapacityFields",
    "CapacityRecord",
    "CapacityResult",
    "CapacitySearch",
    "Level",
    "LevelPlan",
    "LevelRecord",
    "OpenRun",
    "TrialMode",
    "TrialOutcome",
    "TrialSpec",
    "WarmupRecord",
    "backlog_grows",
    "capacity_spec",
    "compile_seconds",
    "cut_bounds",
    "find_capacity",
    "fit_level",
    "flat_note",
    "idle_note",
    "interrupt",
    "level_abort",
    "mode_for",
    "model_max_len",
    "model_vocab_size",
    "prime_contexts",
    "recorded_rate",
    "request_seconds",
    "run_trial",
    "run_trials_on_one_server",
    "search_capacity",
    "start_after_warmup",
    "start_phases",
    "warmup_bound",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.engine": ("compile_seconds", "start_phases"),
    "autotune.trial._capacity": (
        "CapacityRecord",
        "CapacityResult",
        "CapacitySearch",
        "Level",
        "LevelRecord",
        "flat_note",
        "search_capacity",
    ),
    "autotune.trial._levels": (
        "CapacityFields",
        "LEVEL_SPAN",
        "LevelPlan",
        "capacity_spec",
        "find_capacity",
        "fit_level",
        "level_abort",
        "prime_contexts",
        "recorded_rate",
        "request_seconds",
        "start_after_warmup",
        "warmup_bound",
    ),
    "autotune.trial._modes": ("MODES", "TrialMode", "mode_for"),
    "autotune.trial._open_segments": ("OpenRun", "STEADY_SPANS", "backlog_grows", "cut_bounds",
                                      "idle_note"),
    "autotune.trial._open_trial": ("_capacity_metrics",),
    "autotune.trial._replay": ("_plan", "model_vocab_size"),
    "autotune.trial._spec": (
        "INTERRUPT",
        "TrialOutcome",
        "TrialSpec",
        "WarmupRecord",
        "interrupt",
        "model_max_len",
    ),
    "autotune.trial._trial": ("_compile_in", "_phases_in", "run_trial", "run_trials_on_one_server"),
})
