"""Measure: request records and server snapshots -> a Measurement (pure).

Statistics (intervals, the segment rule, the ratio to the defaults), segments of a
closed-loop run (when a run is warm and precise), and the rate intervals of open loops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.load import (
        ServerSnapshot,
        parse_metrics,
        scrape_metrics,
        snapshot_metrics,
    )
    from autotune.measure._intervals import (
        arrivals_note,
        fmt_bracket,
        fmt_interval,
        fmt_value,
        rate_interval,
    )
    from autotune.measure._measure import (
        combine,
        measure,
        meets_slo,
        slo_excess,
        slo_misses,
    )
    from autotune.measure._model import (
        Measurement,
        MeasurementRecord,
        Percentiles,
        PercentilesRecord,
        Slo,
        goodput_slo,
    )
    from autotune.measure._screen import (
        ETA,
        CoarseRecord,
        Screen,
        bracket_closed,
        coarse_ready,
    )
    from autotune.measure._segments import (
        LogWatch,
        SegmentWatch,
        tell_phase,
    )
    from autotune.measure._server import (
        server_figures,
    )
    from autotune.measure._sessions import (
        session_figures,
    )
    from autotune.measure._stats import (
        CAPACITY_BRACKETS,
        MAX_STARTS_NEEDED,
        ONE_START_METHODS,
        WITHIN_RUN_ONLY,
        Interval,
        RatioBound,
        SegmentRule,
        allowed_misses,
        bracket_bound,
        decide_verdict,
        drift,
        fmt_ratio,
        mean_interval,
        ratio_to_defaults,
        relative_half_width,
        starts_needed,
    )

__all__ = [
    "CAPACITY_BRACKETS",
    "ETA",
    "MAX_STARTS_NEEDED",
    "ONE_START_METHODS",
    "WITHIN_RUN_ONLY",
    "CoarseRecord",
    "Interval",
    "LogWatch",
    "Measurement",
    "MeasurementRecord",
    "Percentiles",
    "PercentilesRecord",
    "RatioBound",
    "Screen",
    "SegmentRule",
    "SegmentWatch",
    "ServerSnapshot",
    "Slo",
    "allowed_misses",
    "arrivals_note",
    "bracket_bound",
    "bracket_closed",
    "coarse_ready",
    "combine",
    "decide_verdict",
    "drift",
    "fmt_bracket",
    "fmt_interval",
    "fmt_ratio",
    "fmt_value",
    "goodput_slo",
    "mean_interval",
    "measure",
    "meets_slo",
    "parse_metrics",
    "rate_interval",
    "ratio_to_defaults",
    "relative_half_width",
    "scrape_metrics",
    "server_figures",
    "session_figures",
    "slo_excess",
    "slo_misses",
    "snapshot_metrics",
    "starts_needed",
    "tell_phase",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.load": ("ServerSnapshot", "parse_metrics", "scrape_metrics", "snapshot_metrics"),
    "autotune.measure._intervals": ("arrivals_note", "fmt_bracket", "fmt_interval", "fmt_value",
                                    "rate_interval"),
    "autotune.measure._measure": ("combine", "measure", "meets_slo", "slo_excess",
                                   "slo_misses"),
    "autotune.measure._model": ("Measurement", "MeasurementRecord", "Percentiles",
                                  "PercentilesRecord", "Slo", "goodput_slo"),
    "autotune.measure._screen": ("ETA", "CoarseRecord", "Screen", "bracket_closed",
                                 "coarse_ready"),
    "autotune.measure._segments": ("LogWatch", "SegmentWatch", "tell_phase"),
    "autotune.measure._server": ("server_figures",),
    "autotune.measure._sessions": ("session_figures",),
    "autotune.measure._stats": (
        "CAPACITY_BRACKETS",
        "Interval",
        "MAX_STARTS_NEEDED",
        "ONE_START_METHODS",
        "RatioBound",
        "SegmentRule",
        "WITHIN_RUN_ONLY",
        "allowed_misses",
        "bracket_bound",
        "decide_verdict",
        "drift",
        "fmt_ratio",
        "mean_interval",
        "ratio_to_defaults",
        "relative_half_width",
        "starts_needed",
    ),
})
