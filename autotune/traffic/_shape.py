"""Fit a :class:`TrafficShape` from :class:`TraceRecords` (pure: no I/O)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Final

import numpy as np
from pydantic import BaseModel
from scipy import stats as sps

from autotune.errors import TrafficError
from autotune.traffic._dist import PROBS, length_dist, prefix_stats, rounded
from autotune.traffic._models import (
    ArrivalStats,
    ConcurrencyEstimate,
    Correlation,
    LoadSpec,
    PrefixStats,
    SourceInfo,
    TrafficShape,
    compute_fingerprint,
)
from autotune.traffic._records import TraceRecords
from autotune.traffic._sessions import session_stats

__all__ = [
    "ASSUMED_PREFILL_TPS",
    "ASSUMED_TPOT_S",
    "DEFAULT_REPLAY_REQUESTS",
    "arrival_stats",
    "constant_shape",
    "dispersion",
    "fit_shape",
    "full_window_counts",
    "length_dist",
    "stats_fingerprint",
]

logger = logging.getLogger(__name__)

#: Little's law without logged latencies assumes a reference server: 30 ms per output token
#: per stream and 10,000 prompt tokens/s of prefill (documented in docs/traffic.md).
ASSUMED_TPOT_S: Final = 0.030
ASSUMED_PREFILL_TPS: Final = 10_000.0
#: A fitted shape's default replay: open loop at the recorded rate, this many requests at most.
DEFAULT_REPLAY_REQUESTS: Final = 1000
DISPERSION_WINDOW_S: Final = 60.0
_MAX_PROFILE_WINDOWS: Final = 1440


_r = rounded
_PROBS = PROBS


def stats_fingerprint(stats: Mapping[str, object]) -> str:
    """:func:`compute_fingerprint` of a dict of statistics, models or plain values."""
    return compute_fingerprint(
        {k: (v.model_dump() if isinstance(v, BaseModel) else v) for k, v in stats.items()}
    )


def _correlation(inp: np.ndarray, out: np.ndarray) -> Correlation | None:
    if inp.shape[0] < 3 or np.all(inp == inp[0]) or np.all(out == out[0]):
        return None
    rho = float(sps.spearmanr(inp, out).statistic)
    plog = float(np.corrcoef(np.log(inp), np.log(out))[0, 1])
    return Correlation(
        spearman=_r(rho) if math.isfinite(rho) else None,
        pearson_log=_r(plog) if math.isfinite(plog) else None,
    )


def full_window_counts(ts: np.ndarray, window: float) -> np.ndarray:
    """Arrivals per consecutive ``window``-second window from ``ts[0]``, full windows only.

    A trailing partial window (the recording stopped inside it) is left out: counted as a
    full one it reads as a dip (or, with the last few requests in a few seconds, as noise),
    and where a recording stops must not move a statistic.
    """
    if ts.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    rel = ts - ts[0]
    full = math.floor(float(rel[-1]) / window)
    if full == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.floor(rel / window).astype(np.int64)
    return np.bincount(idx[idx < full], minlength=full)


def dispersion(counts: np.ndarray) -> float | None:
    """var/mean of window counts (population variance); None below 2 windows or 0 arrivals."""
    if counts.shape[0] < 2 or counts.sum() == 0:
        return None
    return float(counts.var() / counts.mean())


def arrival_stats(ts: np.ndarray) -> ArrivalStats | None:
    """Inter-arrival CV, dispersion per 60 s and rate profile of sorted arrival times."""
    span = float(ts[-1] - ts[0]) if ts.shape[0] else 0.0
    if ts.shape[0] < 2 or span <= 0:
        return None
    gaps = np.diff(ts)
    cv = float(gaps.std() / gaps.mean())
    disp = dispersion(full_window_counts(ts, DISPERSION_WINDOW_S))
    window = DISPERSION_WINDOW_S * max(
        1, math.ceil(span / DISPERSION_WINDOW_S / _MAX_PROFILE_WINDOWS)
    )
    counts = full_window_counts(ts, window)
    if counts.shape[0] == 0:  # shorter than one window: one value over the whole span
        window = span
        profile = np.array([ts.shape[0] / span])
    else:
        profile = counts / window
    return ArrivalStats(
        interarrival_cv=_r(cv),
        dispersion_60s=_r(disp) if disp is not None else None,
        zero_gap_fraction=_r(float(np.mean(gaps == 0))),
        peak_rate_rps=_r(float(profile.max())),
        window_s=_r(window),
        rate_profile=[_r(v) for v in profile],
    )


def _concurrency(
    rate: float, inp: np.ndarray, out: np.ndarray, lat: np.ndarray | None
) -> ConcurrencyEstimate | None:
    if rate <= 0:
        return None
    if lat is not None and np.mean(np.isfinite(lat)) >= 0.5:
        w = float(np.nanmean(lat))
        return ConcurrencyEstimate(mean=_r(rate * w), method="latency", mean_latency_s=_r(w))
    w = float(inp.mean() / ASSUMED_PREFILL_TPS + out.mean() * ASSUMED_TPOT_S)
    return ConcurrencyEstimate(
        mean=_r(rate * w),
        method="assumed_latency",
        mean_latency_s=_r(w),
        assumed_tpot_s=ASSUMED_TPOT_S,
        assumed_prefill_tps=ASSUMED_PREFILL_TPS,
    )


def _prefix(records: TraceRecords) -> PrefixStats | None:
    info = records.prefix
    return None if info is None else prefix_stats(info, records.input_tokens)


def _check(records: TraceRecords) -> None:
    n = len(records)
    if n == 0:
        raise TrafficError(f"traffic {records.path}: no requests to fit a shape from")
    arrays: list[np.ndarray] = [records.timestamps_s, records.input_tokens, records.output_tokens]
    if records.sessions is not None:
        arrays.append(records.sessions.parent)
    if any(a.shape != (n,) for a in arrays):
        raise TrafficError(f"traffic {records.path}: record arrays differ in length")
    if not np.all(np.isfinite(records.timestamps_s)) or np.any(np.diff(records.timestamps_s) < 0):
        raise TrafficError(
            f"traffic {records.path}: timestamps must be finite and sorted; read the file "
            "with read_trace()"
        )
    if np.any(records.input_tokens < 1) or np.any(records.output_tokens < 1):
        raise TrafficError(
            f"traffic {records.path}: token counts must be >= 1 (zero-token requests are "
            "failures; read_trace() leaves them out)"
        )


def fit_shape(
    records: TraceRecords, *, name: str | None = None, load: LoadSpec | None = None
) -> TrafficShape:
    """Fit the traffic shape of ``records``.

    ``load`` is the replay default stored in the shape; without it, open loop at the
    recorded rate, ``min(requests, 1000)`` requests. The fingerprint depends on the
    statistics only, not on ``name``, ``load`` or the order of the records.
    """
    _check(records)
    ts = records.timestamps_s
    inp = records.input_tokens
    out = records.output_tokens
    n = int(inp.shape[0])
    span = float(ts[-1] - ts[0])
    rate = n / span if span > 0 else 0.0
    if rate == 0:
        logger.warning("traffic %s: all requests share one arrival time; no rate", records.path)
    stats: dict[str, Any] = {
        "requests": n,
        "duration_s": _r(span),
        "rate_rps": _r(rate),
        "input_tokens": length_dist(inp),
        "output_tokens": length_dist(out),
        "correlation": _correlation(inp, out),
        "arrivals": arrival_stats(ts),
        "concurrency": _concurrency(rate, inp, out, records.latencies_s),
        "prefix": _prefix(records),
        "sessions": session_stats(records),
    }
    fingerprint = stats_fingerprint(stats)
    if load is None:
        load = LoadSpec(mode="open", requests=min(n, DEFAULT_REPLAY_REQUESTS))
    return TrafficShape(
        name=name or PurePath(records.path).stem or "traffic",
        fingerprint=fingerprint,
        source=SourceInfo(
            path=PurePath(records.path).name,
            format=records.format,
            skipped_lines=records.skipped,
            failed_requests=records.failed,
        ),
        load=load,
        **stats,
    )


def constant_shape(
    input_tokens: int,
    output_tokens: int,
    *,
    load: LoadSpec,
    name: str | None = None,
    requests: int | None = None,
) -> TrafficShape:
    """A synthetic shape with fixed lengths (e.g. the case study's 512 in / 512 out).

    It has no arrival statistics (``rate_rps`` = 0): replay it closed loop, or open loop
    with an explicit ``rate_rps``.
    """
    if input_tokens < 1 or output_tokens < 1:
        raise TrafficError(
            f"fixed lengths must be >= 1 token (got input {input_tokens}, output {output_tokens})"
        )
    n = requests if requests is not None else load.requests
    if n < 1:
        raise TrafficError(f"a shape needs at least 1 request (got {n})")
    stats: dict[str, Any] = {
        "requests": n,
        "duration_s": 0.0,
        "rate_rps": 0.0,
        "input_tokens": length_dist([input_tokens]),
        "output_tokens": length_dist([output_tokens]),
        "correlation": None,
        "arrivals": None,
        "concurrency": None,
        "prefix": None,
    }
    fingerprint = stats_fingerprint(stats)
    return TrafficShape(
        name=name or f"fixed-{input_tokens}x{output_tokens}",
        fingerprint=fingerprint,
        source=SourceInfo(note=f"synthetic: every request {input_tokens} in / {output_tokens} out"),
        load=load,
        **stats,
    )
