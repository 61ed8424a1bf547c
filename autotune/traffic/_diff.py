"""Compare two traffic shapes dimension by dimension (pure: no I/O).

Each dimension has a distance and a threshold (docs/traffic.md); the verdict is "same" when
every distance that both shapes can measure is within its threshold, else "drifted".
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from autotune.traffic._models import LengthDist, TrafficShape

__all__ = ["THRESHOLDS", "DimensionDiff", "ShapeDiff", "diff_shapes"]

#: dimension -> (metric, threshold). Distances above the threshold mean "drifted".
THRESHOLDS: Final[dict[str, tuple[str, float]]] = {
    "input_tokens": ("wasserstein_norm", 0.10),
    "output_tokens": ("wasserstein_norm", 0.10),
    "correlation": ("abs_diff_spearman", 0.20),
    "rate": ("abs_log2_ratio", math.log2(1.25)),
    "burstiness": ("abs_log2_ratio_dispersion", 1.0),
    "prefix_sharing": ("abs_diff_shared_token_fraction", 0.10),
    "session_turns": ("wasserstein_norm", 0.10),
    "think_time": ("wasserstein_norm", 0.25),
}


class DimensionDiff(BaseModel):
    """One dimension: ``distance`` (None = not measurable on both shapes) vs ``threshold``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    distance: float | None
    threshold: float
    drifted: bool
    a: float | None = None
    b: float | None = None
    detail: dict[str, float | None] = {}


class ShapeDiff(BaseModel):
    """The comparison of shapes ``a`` and ``b``.

    ``distance`` is one scalar for ranking shapes: the root mean square of
    distance/threshold over the measurable dimensions (<= 1 everywhere means "same").
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    a: str
    b: str
    fingerprint_a: str
    fingerprint_b: str
    same_fingerprint: bool
    verdict: Literal["same", "drifted"]
    distance: float
    drifted_dimensions: list[str]
    dimensions: dict[str, DimensionDiff]
    notes: list[str] = []

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``autotune shape diff --json`` prints)."""
        return self.model_dump(mode="json")


def _cdf_at(q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The CDF implied by 101 quantiles, evaluated at ``x`` (right-continuous, 1 % steps)."""
    return np.searchsorted(q, x, side="right") / q.shape[0]


def _lengths(a: LengthDist, b: LengthDist) -> tuple[float, dict[str, float | None]]:
    qa = np.asarray(a.quantiles)
    qb = np.asarray(b.quantiles)
    # W1 between the quantile functions (trapezoid over p), relative to the pooled mean
    w1 = float(np.trapezoid(np.abs(qa - qb), dx=1.0 / (qa.shape[0] - 1)))
    scale = max((a.mean + b.mean) / 2.0, 1.0)
    grid = np.union1d(qa, qb)
    ks = float(np.max(np.abs(_cdf_at(qa, grid) - _cdf_at(qb, grid))))
    detail: dict[str, float | None] = {
        "ks": round(ks, 4),
        "wasserstein_tokens": round(w1, 3),
        "mean_ratio": round(b.mean / a.mean, 4) if a.mean > 0 else None,
        "p99_ratio": round(b.p99 / a.p99, 4) if a.p99 > 0 else None,
    }
    return w1 / scale, detail


def _log2_ratio(x: float | None, y: float | None) -> float | None:
    if x is None or y is None or x <= 0 or y <= 0:
        return None
    return abs(math.log2(y / x))


def _widening(a: TrafficShape, b: TrafficShape, dim: str) -> float:
    """How much coarser statistics (a shape from /metrics histograms) widen a threshold:
    the sum of both shapes' precision bounds, so that "drifted" still means drifted."""
    return sum(getattr(s.precision, dim, 0.0) for s in (a, b) if s.precision is not None)


def _dim(
    name: str,
    distance: float | None,
    a: float | None = None,
    b: float | None = None,
    detail: dict[str, float | None] | None = None,
    widen: float = 0.0,
) -> DimensionDiff:
    metric, threshold = THRESHOLDS[name]
    threshold += widen
    if widen:
        detail = {**(detail or {}), "precision_widening": round(widen, 6)}
    d = None if distance is None else round(distance, 6)
    return DimensionDiff(
        metric=metric,
        distance=d,
        threshold=round(threshold, 6),
        drifted=d is not None and d > threshold,
        a=a,
        b=b,
        detail=detail or {},
    )


def diff_shapes(a: TrafficShape, b: TrafficShape) -> ShapeDiff:
    """Compare two shapes (see :data:`THRESHOLDS` and docs/traffic.md)."""
    dims: dict[str, DimensionDiff] = {}
    d_in, det_in = _lengths(a.input_tokens, b.input_tokens)
    dims["input_tokens"] = _dim(
        "input_tokens", d_in, a.input_tokens.mean, b.input_tokens.mean, det_in,
        _widening(a, b, "input_tokens"),
    )
    d_out, det_out = _lengths(a.output_tokens, b.output_tokens)
    dims["output_tokens"] = _dim(
        "output_tokens", d_out, a.output_tokens.mean, b.output_tokens.mean, det_out,
        _widening(a, b, "output_tokens"),
    )

    ca = a.correlation.spearman if a.correlation else None
    cb = b.correlation.spearman if b.correlation else None
    dims["correlation"] = _dim(
        "correlation", abs(ca - cb) if ca is not None and cb is not None else None, ca, cb
    )
    ra = a.rate_rps or None
    rb = b.rate_rps or None
    rate_widen = sum(math.log2(1.0 + s.precision.rate) for s in (a, b)
                     if s.precision is not None and s.precision.rate)
    dims["rate"] = _dim("rate", _log2_ratio(ra, rb), ra, rb, widen=rate_widen)
    da = a.arrivals.dispersion_60s if a.arrivals else None
    db = b.arrivals.dispersion_60s if b.arrivals else None
    cva = a.arrivals.interarrival_cv if a.arrivals else None
    cvb = b.arrivals.interarrival_cv if b.arrivals else None
    dims["burstiness"] = _dim(
        "burstiness",
        _log2_ratio(da, db),
        da,
        db,
        {"interarrival_cv_a": cva, "interarrival_cv_b": cvb},
    )
    # no prefix statistics on one side: "unknown", not "no sharing"
    pa = a.prefix.shared_token_fraction if a.prefix else None
    pb = b.prefix.shared_token_fraction if b.prefix else None
    dims["prefix_sharing"] = _dim(
        "prefix_sharing", abs(pa - pb) if pa is not None and pb is not None else None, pa, pb
    )

    dims |= _session_dims(a, b)

    scores = [d.distance / d.threshold for d in dims.values() if d.distance is not None]
    distance = math.sqrt(sum(s * s for s in scores) / len(scores)) if scores else 0.0
    drifted = [k for k, d in dims.items() if d.drifted]
    return ShapeDiff(
        a=a.name,
        b=b.name,
        fingerprint_a=a.fingerprint,
        fingerprint_b=b.fingerprint,
        same_fingerprint=a.fingerprint == b.fingerprint,
        verdict="drifted" if drifted else "same",
        distance=round(distance, 6),
        drifted_dimensions=drifted,
        dimensions=dims,
        notes=_source_notes(a, b) + _session_notes(a, b),
    )


def _dist_dim(name: str, a: LengthDist | None, b: LengthDist | None) -> DimensionDiff:
    if a is None or b is None:  # measured on one side only: unknown, not "no sessions"
        return _dim(name, None, a.mean if a else None, b.mean if b else None)
    d, detail = _lengths(a, b)
    return _dim(name, d, a.mean, b.mean, detail)


def _session_dims(a: TrafficShape, b: TrafficShape) -> dict[str, DimensionDiff]:
    """Turns per session and think time (``n/a`` unless both shapes have sessions)."""
    sa, sb = a.sessions, b.sessions
    return {
        "session_turns": _dist_dim(
            "session_turns", sa.turns if sa else None, sb.turns if sb else None
        ),
        "think_time": _dist_dim(
            "think_time", sa.think_time_s if sa else None, sb.think_time_s if sb else None
        ),
    }


def _session_notes(a: TrafficShape, b: TrafficShape) -> list[str]:
    sa, sb = a.sessions, b.sessions
    if (sa is None) != (sb is None):
        has = a.name if sa is not None else b.name
        return [f"only {has} has sessions (turns of conversations); the other's trace "
                "carried none"]
    if sa is not None and sb is not None and sa.think_time_basis != sb.think_time_basis:
        return [f"think times are measured differently: {a.name} from the parent's "
                f"{sa.think_time_basis}, {b.name} from the parent's {sb.think_time_basis} "
                "(see docs/traffic.md)"]
    return []


def _source_notes(a: TrafficShape, b: TrafficShape) -> list[str]:
    """Where the two shapes' traffic is not the same traffic (like with like)."""
    pa = a.source.prometheus if a.source is not None else None
    pb = b.source.prometheus if b.source is not None else None
    if pa is None or pb is None:
        return []
    notes = []
    if pa.selector != pb.selector:
        notes.append(f"different replicas: {a.name} is {pa.selector}, {b.name} is "
                     f"{pb.selector}")
    if pa.url != pb.url:
        notes.append(f"different Prometheus: {a.name} from {pa.url}, {b.name} from {pb.url}")
    if pa.window_s != pb.window_s:
        notes.append(f"arrival windows differ ({pa.window_s:g} s vs {pb.window_s:g} s)")
    return notes
