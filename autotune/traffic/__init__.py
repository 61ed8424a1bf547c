"""Recorded traffic -> traffic shape -> replay schedule.

Read a trace (:func:`read_trace`), fit its shape (:func:`fit_shape`), save/load it
(:func:`save_shape`, :func:`load_shape`), compare two shapes (:func:`diff_shapes`) and turn
one into the requests a load generator sends (:func:`build_schedule`). See docs/traffic.md.
"""

from autotune.traffic._clip import clip_shape
from autotune.traffic._diff import THRESHOLDS, DimensionDiff, ShapeDiff, diff_shapes
from autotune.traffic._io import load_shape, save_shape
from autotune.traffic._models import (
    SHAPE_VERSION,
    ArrivalStats,
    ConcurrencyEstimate,
    Correlation,
    LengthDist,
    LoadSpec,
    PrefixStats,
    SourceInfo,
    TrafficShape,
    compute_fingerprint,
)
from autotune.traffic._plots import write_plots
from autotune.traffic._readers import FORMATS, detect_format, read_trace
from autotune.traffic._records import PrefixInfo, SkippedLine, TraceRecords
from autotune.traffic._replay import (
    ARRIVALS,
    RequestSpec,
    Schedule,
    build_schedule,
    context_overflow,
    ideal_prefix_hit_fraction,
)
from autotune.traffic._shape import constant_shape, fit_shape, length_dist

__all__ = [
    "ARRIVALS",
    "FORMATS",
    "SHAPE_VERSION",
    "THRESHOLDS",
    "ArrivalStats",
    "ConcurrencyEstimate",
    "Correlation",
    "DimensionDiff",
    "LengthDist",
    "LoadSpec",
    "PrefixInfo",
    "PrefixStats",
    "RequestSpec",
    "Schedule",
    "ShapeDiff",
    "SkippedLine",
    "SourceInfo",
    "TraceRecords",
    "TrafficShape",
    "build_schedule",
    "clip_shape",
    "compute_fingerprint",
    "constant_shape",
    "context_overflow",
    "detect_format",
    "diff_shapes",
    "fit_shape",
    "ideal_prefix_hit_fraction",
    "length_dist",
    "load_shape",
    "read_trace",
    "save_shape",
    "write_plots",
]
