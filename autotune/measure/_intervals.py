"""Intervals of a rate that mean what they say (pure; numpy and scipy only).

A rate (output tokens/s, requests/s) is never below zero, so neither is its interval. The
Student-t interval over a run's segment rates is right when the segments scatter
symmetrically (a closed loop's waves). A bursty open loop's segments do not: a few
sub-windows catch a burst and the rest are quiet, and the normal approximation over five
of them has read [-7.0, 114.5] out tok/s. There the interval is taken on the log scale
(the t-interval of the log rates, a factor around the rate), or, where a segment served
nothing (no log), by a bootstrap of the segments' mean. :func:`arrivals_note` says when
the segments' spread comes from the arrivals rather than the server: the interval then
describes the traffic. ``docs/measurement.md`` (sections 4 and 12) says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as _st

__all__ = ["SKEW_LIMIT", "arrivals_note", "fmt_bracket", "fmt_interval", "fmt_value",
           "held_interval", "rate_interval"]

#: segments whose sample skewness is beyond this (either way) are skewed: their interval is
#: taken on the log scale (a bursty open loop's sub-windows; a closed loop's rarely are)
SKEW_LIMIT = 1.0
_BOOTSTRAP = 4000


def _skewed(arr: np.ndarray) -> bool:
    if arr.size < 3 or float(arr.std()) == 0.0:
        return False
    return bool(abs(float(_st.skew(arr, bias=False))) > SKEW_LIMIT)


def rate_interval(rate: float | None, segments: Sequence[float], *, confidence: float = 0.95
                  ) -> tuple[float | None, float | None, str | None]:
    """(low, high, method) of the 95 % interval of ``rate`` from its segments' rates.

    ``t``: the t-interval's half-width over the segments placed around ``rate`` (batch
    means); ``log-t``: skewed segments, or a t-interval that would reach below zero: the
    t-interval of the log segment rates as a factor around ``rate``; ``bootstrap``: the
    same but some segment served nothing: percentiles of resampled segment means, scaled
    to ``rate``. The low end is never below zero. (None, None, None) under two finite
    segments or without a rate."""
    arr = np.asarray([float(v) for v in segments], dtype=float)
    arr = arr[np.isfinite(arr)]
    if rate is None or not math.isfinite(rate) or arr.size < 2:
        return None, None, None
    q = float(_st.t.ppf(0.5 + confidence / 2, arr.size - 1))
    half = q * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    if not _skewed(arr) and rate - half >= 0:
        return rate - half, rate + half, "t"
    if bool(np.all(arr > 0)) and rate > 0:
        factor = math.exp(q * float(np.log(arr).std(ddof=1)) / math.sqrt(arr.size))
        return rate / factor, rate * factor, "log-t"
    mean = float(arr.mean())
    if not mean > 0 or not rate > 0:
        return 0.0, max(0.0, rate + half), "t"
    draws = np.random.default_rng(0).choice(arr, size=(_BOOTSTRAP, arr.size)).mean(axis=1)
    lo, hi = np.quantile(draws, [0.5 - confidence / 2, 0.5 + confidence / 2])
    return max(0.0, rate * float(lo) / mean), rate * float(hi) / mean, "bootstrap"


def held_interval(rate: float | None, low: float | None, high: float | None, method: str | None,
                  *, segments: Sequence[float] = (), repeats: Sequence[float] = (),
                  ) -> tuple[float | None, float | None, str | None]:
    """A rate's interval widened to hold the spread that was measured beside its segments:
    the repeats' own interval (``repeats``: each repeat's rate; two or more: the t-interval
    of the repeats around ``rate``, which segments of one server never see), and a drift
    the warm-up did not cover (``segments``' halves differ significantly: the steady rate
    lies anywhere from one half's mean to the other's, so the interval reaches both).
    Returns (low, high, method), the method saying what widened it."""
    from autotune.measure._stats import drift

    if rate is None or low is None or high is None:
        return low, high, method
    why = []
    reps = [float(r) for r in repeats if math.isfinite(float(r))]
    if len(reps) >= 2:
        r_lo, r_hi, _ = rate_interval(rate, reps)
        if r_lo is not None and r_hi is not None and (r_lo < low or r_hi > high):
            low, high = min(low, r_lo), max(high, r_hi)
            why.append(f"widened to the spread of {len(reps)} repeats")
    d = drift(segments)
    if d is not None and d.significant:
        arr = np.asarray([float(v) for v in segments if math.isfinite(float(v))])
        h = arr.size // 2
        halves = (float(arr[:h].mean()), float(arr[arr.size - h:].mean()))
        if min(halves) < low or max(halves) > high:
            low, high = min(low, *halves), max(high, *halves)
            why.append(f"widened over a drift of {d.relative:+.1%} between the halves that "
                       "the warm-up did not cover")
    return low, high, "; ".join([method or "t", *why]) if why else method


def arrivals_note(served: Sequence[float], offered: Sequence[float]) -> str:
    """A line when the spread of an open loop's segment rates (``served``, tokens/s per
    sub-window) comes from its arrivals (``offered``: the output tokens of the requests
    sent in each sub-window, per second), else "": the offered rate varies by at least
    half as much as the served one and the two move together (correlation >= 0.7). The
    interval then measures how bursty the traffic is, not how steady the server."""
    s = np.asarray(served, dtype=float)
    o = np.asarray(offered, dtype=float)
    if s.size < 3 or s.size != o.size or not (s.mean() > 0 and o.mean() > 0):
        return ""
    cv_s, cv_o = float(s.std(ddof=1) / s.mean()), float(o.std(ddof=1) / o.mean())
    if cv_s == 0 or cv_o == 0 or cv_o < 0.5 * cv_s:
        return ""
    corr = float(np.corrcoef(s, o)[0, 1])
    if not corr >= 0.7:
        return ""
    return (f"the segments' spread comes from the arrivals, not the server: the offered "
            f"tokens per segment varied by {cv_o:.0%} (CV), the served by {cv_s:.0%}, "
            f"together (correlation {corr:.2f}); the interval describes the bursty traffic")


def fmt_value(v: float) -> str:
    """A figure for people, the one rule for every rate, capacity and count of GPUs that
    autotune prints (the summary, ``autotune best``, the progress, the report): three
    significant digits, and every digit left of the point, with thousands separators
    (0.0864, 0.321, 2.57, 17.6, 176, 7,611 req/s or tok/s): a slow server's 0.0864 req/s
    never reads 0.1, and 7,611 tok/s never 7.61e+03."""
    if not math.isfinite(v) or v == 0:
        return format(v, ".0f") if v == 0 else str(v)
    r = float(format(v, ".3g"))  # 9.996 rounds up to 10.0: its decimals are those of 10
    if abs(r) >= 100:
        return format(round(v), ",d")
    return format(v, f".{2 - math.floor(math.log10(abs(r)))}f")


def fmt_interval(low: float | None, high: float | None, spec: str | None = None) -> str:
    """"[a, b]" (unambiguous with negative numbers, unlike "a-b"); "" when unknown.
    ``spec``: a format for both ends (default :func:`fmt_value`)."""
    if low is None or high is None:
        return ""
    f = fmt_value if spec is None else (lambda x: format(x, spec))
    return f"[{f(low)}, {f(high)}]"


def fmt_bracket(low: float | None, high: float | None, unit: str = "req/s") -> str:
    """A capacity bracket [highest passing rate, lowest failing rate], the same wherever
    it prints: "[0.321, 2.57] req/s" (:func:`fmt_value` at each end); an end no level gave
    reads "none passed" or "none failed" ("[14.3, none failed] req/s": a lower bound)."""
    lo = fmt_value(low) if low is not None else "none passed"
    hi = fmt_value(high) if high is not None and math.isfinite(high) else "none failed"
    return f"[{lo}, {hi}] {unit}"
