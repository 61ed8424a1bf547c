"""Recorded traffic -> traffic shape -> replay schedule.

Read a trace (:func:`read_trace`), fit its shape (:func:`fit_shape`), save/load it
(:func:`save_shape`, :func:`load_shape`), compare two shapes (:func:`diff_shapes`) and turn
one into the requests a load generator sends (:func:`build_schedule`). A shape can also come
from a vLLM server's /metrics samples (:func:`shape_from_samples`), or from vLLM's series
in Prometheus (:func:`fit_prometheus`). See docs/traffic.md.
"""

from autotune.traffic._clip import clip_shape
from autotune.traffic._diff import THRESHOLDS, DimensionDiff, ShapeDiff, diff_shapes
from autotune.traffic._io import load_shape, save_shape
from autotune.traffic._metrics import (
    METRIC_NAMES,
    Histogram,
    MetricsSample,
    NoTrafficError,
    NotVllmError,
    histogram_length_dist,
    parse_vllm_metrics,
    shape_from_samples,
)
from autotune.traffic._models import (
    SHAPE_VERSION,
    ArrivalStats,
    ConcurrencyEstimate,
    Correlation,
    LengthDist,
    LoadSpec,
    Precision,
    PrefixStats,
    PrometheusRange,
    SessionStats,
    SourceInfo,
    TrafficShape,
    compute_fingerprint,
)
from autotune.traffic._plots import write_plots
from autotune.traffic._prometheus import (
    AUTH_ENV,
    PrometheusAuth,
    PrometheusClient,
    PrometheusError,
    PrometheusUnreachableError,
    auth_from_env,
)
from autotune.traffic._prometheus_shape import (
    NoSeriesError,
    PrometheusFit,
    fit_prometheus,
    normalize_selector,
)
from autotune.traffic._readers import FORMATS, detect_format, read_trace
from autotune.traffic._records import PrefixInfo, SessionLinks, SkippedLine, TraceRecords
from autotune.traffic._replay import (
    ARRIVALS,
    RequestSpec,
    Schedule,
    build_schedule,
    busiest_stretch,
    context_overflow,
    ideal_prefix_hit_fraction,
)
from autotune.traffic._shape import constant_shape, fit_shape, length_dist
from autotune.traffic._vllm_log import parse_vllm_request_log, read_vllm_request_log

__all__ = [
    "ARRIVALS",
    "AUTH_ENV",
    "FORMATS",
    "METRIC_NAMES",
    "SHAPE_VERSION",
    "THRESHOLDS",
    "ArrivalStats",
    "ConcurrencyEstimate",
    "Correlation",
    "DimensionDiff",
    "Histogram",
    "LengthDist",
    "LoadSpec",
    "MetricsSample",
    "NoSeriesError",
    "NoTrafficError",
    "NotVllmError",
    "Precision",
    "PrefixInfo",
    "PrefixStats",
    "PrometheusAuth",
    "PrometheusClient",
    "PrometheusError",
    "PrometheusFit",
    "PrometheusRange",
    "PrometheusUnreachableError",
    "RequestSpec",
    "Schedule",
    "SessionLinks",
    "SessionStats",
    "ShapeDiff",
    "SkippedLine",
    "SourceInfo",
    "TraceRecords",
    "TrafficShape",
    "auth_from_env",
    "build_schedule",
    "busiest_stretch",
    "clip_shape",
    "compute_fingerprint",
    "constant_shape",
    "context_overflow",
    "detect_format",
    "diff_shapes",
    "fit_prometheus",
    "fit_shape",
    "histogram_length_dist",
    "ideal_prefix_hit_fraction",
    "length_dist",
    "load_shape",
    "normalize_selector",
    "parse_vllm_metrics",
    "parse_vllm_request_log",
    "read_trace",
    "read_vllm_request_log",
    "save_shape",
    "shape_from_samples",
    "write_plots",
]
