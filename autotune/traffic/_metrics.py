"""A traffic shape from a vLLM server's ``/metrics`` samples (pure: no I/O).

A sample is one scrape, parsed with ``prometheus_client``'s text parser. A shape is built
from the *deltas* between the first and the last sample of a window, summed interval by
interval so that a counter reset (the server restarted) loses one interval, not the window:

- lengths from the bucket counts of ``vllm:request_prompt_tokens`` and
  ``vllm:request_generation_tokens`` (quantiles interpolated linearly within a bucket, the
  mean exact from ``_sum``/``_count``); how coarse that is goes into ``shape.precision``;
- arrivals from a counter that ticks once per request near its arrival (the count of
  ``vllm:time_to_first_token_seconds``, else of ``vllm:request_prompt_tokens``), per
  sampling interval;
- prefix sharing from the prefix-cache counters (hit tokens / queried tokens);
- concurrency from Little's law with the mean of ``vllm:e2e_request_latency_seconds``.

docs/traffic.md section 7 lists the metric names per vLLM version and the precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Final

import numpy as np

from autotune.errors import TrafficError
from autotune.traffic._dist import from_quantiles
from autotune.traffic._models import (
    N_QUANTILES,
    ArrivalStats,
    ConcurrencyEstimate,
    LengthDist,
    LoadSpec,
    Precision,
    PrefixStats,
    SourceInfo,
    TrafficShape,
)
from autotune.traffic._shape import (
    DEFAULT_REPLAY_REQUESTS,
    DISPERSION_WINDOW_S,
    _r,
    arrival_stats,
    dispersion,
    stats_fingerprint,
)

__all__ = [
    "METRIC_NAMES",
    "Histogram",
    "MetricsSample",
    "NoTrafficError",
    "NotVllmError",
    "counter_delta",
    "histogram_delta",
    "histogram_length_dist",
    "parse_vllm_metrics",
    "shape_from_samples",
]

#: what each statistic is read from, first name found wins (vLLM V1 0.8+ and 0.2x/0.3x use
#: the first; ``gpu_prefix_cache_*`` is vLLM 0.7-0.10's name of the prefix-cache counters).
METRIC_NAMES: Final[dict[str, tuple[str, ...]]] = {
    "prompt_tokens": ("vllm:request_prompt_tokens",),
    "generation_tokens": ("vllm:request_generation_tokens",),
    "arrivals": ("vllm:time_to_first_token_seconds", "vllm:request_prompt_tokens"),
    "e2e_latency": ("vllm:e2e_request_latency_seconds",),
    "prefix_queries": (
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries",
    ),
    "prefix_hits": (
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits",
    ),
}
_PROBS: Final = np.linspace(0.0, 1.0, N_QUANTILES)


class NotVllmError(TrafficError):
    """The endpoint answers /metrics but is not a vLLM server (no ``vllm:`` histograms)."""


class NoTrafficError(TrafficError):
    """No request finished during the sampling window: there is no shape to build."""


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: ``bounds`` (finite upper bounds, increasing), ``counts`` per
    bucket (not cumulative; one more than ``bounds``: the last is the +Inf bucket)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float


@dataclass(frozen=True)
class MetricsSample:
    """One scrape of /metrics: what a shape needs, summed over label sets (engines, models).

    ``taken_at``: a monotonic clock; ``wall_at``: unix time (to match a request log)."""

    taken_at: float
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    wall_at: float | None = None


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def parse_vllm_metrics(
    text: str, *, taken_at: float, wall_at: float | None = None,
    extra_histograms: Iterable[str] = (),
) -> MetricsSample:
    """Parse a /metrics page. Raises :class:`NotVllmError` if it has no vLLM histogram and
    :class:`TrafficError` if it is not Prometheus text. NaN/inf values are left out.

    ``extra_histograms``: more histogram names to keep beside the shape's (a rollout's
    latency histograms)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    counters: dict[str, float] = {}
    wanted_hist = {n for key in ("prompt_tokens", "generation_tokens", "arrivals", "e2e_latency")
                   for n in METRIC_NAMES[key]} | set(extra_histograms)
    wanted_counters = set(METRIC_NAMES["prefix_queries"]) | set(METRIC_NAMES["prefix_hits"])
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not _finite(s.value):
                    continue
                name = s.name
                if name.endswith("_bucket") and name[: -len("_bucket")] in wanted_hist:
                    le = float(s.labels.get("le", "nan"))
                    if math.isnan(le):
                        continue
                    b = buckets.setdefault(name[: -len("_bucket")], {})
                    b[le] = b.get(le, 0.0) + s.value
                elif name.endswith("_sum") and name[: -len("_sum")] in wanted_hist:
                    base = name[: -len("_sum")]
                    sums[base] = sums.get(base, 0.0) + s.value
                elif name.endswith("_count") and name[: -len("_count")] in wanted_hist:
                    base = name[: -len("_count")]
                    counts[base] = counts.get(base, 0.0) + s.value
                elif name in wanted_counters:
                    counters[name] = counters.get(name, 0.0) + s.value
    except ValueError as exc:
        raise TrafficError(f"/metrics is not Prometheus text: {exc}") from exc
    hists: dict[str, Histogram] = {}
    for base, cum in buckets.items():
        les = sorted(cum)
        if not les or not math.isinf(les[-1]):
            continue  # a histogram without its +Inf bucket is malformed: leave it out
        c = np.diff(np.concatenate(([0.0], [cum[le] for le in les])))
        total = cum[les[-1]]
        hists[base] = Histogram(
            bounds=tuple(les[:-1]),
            counts=tuple(float(v) for v in np.maximum(c, 0.0)),
            sum=sums.get(base, 0.0),
            count=counts.get(base, total),
        )
    if not any(n in hists for n in METRIC_NAMES["prompt_tokens"]):
        raise NotVllmError(
            "the endpoint's /metrics has no vllm:request_prompt_tokens histogram: it is not a "
            "vLLM server (or its metrics are off); point at the vLLM server itself"
        )
    return MetricsSample(taken_at=taken_at, histograms=hists, counters=counters,
                         wall_at=wall_at)


def counter_delta(prev: float | None, cur: float | None) -> float | None:
    """The increase of a counter between two samples; a decrease is a reset (the counter
    restarted from 0, so the increase is ``cur``). None where either side is missing/NaN."""
    if prev is None or cur is None or not (_finite(prev) and _finite(cur)):
        return None
    return cur - prev if cur >= prev else cur


def histogram_delta(prev: Histogram | None, cur: Histogram | None) -> Histogram | None:
    """``cur - prev`` bucket by bucket; a reset (count went down) gives ``cur``; None when a
    side is missing or the buckets changed (the server restarted with other bounds)."""
    if prev is None or cur is None:
        return None
    if cur.count < prev.count:
        return cur
    if prev.bounds != cur.bounds:
        return None
    counts = tuple(max(0.0, c - p) for c, p in zip(cur.counts, prev.counts, strict=True))
    return Histogram(cur.bounds, counts, max(0.0, cur.sum - prev.sum), cur.count - prev.count)


def _add(a: Histogram | None, b: Histogram | None) -> Histogram | None:
    if a is None:
        return b
    if b is None:
        return a
    if a.bounds != b.bounds:  # bounds changed after a restart: keep the later ones
        return b if b.count >= a.count else a
    counts = tuple(x + y for x, y in zip(a.counts, b.counts, strict=True))
    return Histogram(a.bounds, counts, a.sum + b.sum, a.count + b.count)


def _pick(sample: MetricsSample, key: str) -> str | None:
    names = METRIC_NAMES[key]
    pool: Iterable[str] = sample.counters if key.startswith("prefix") else sample.histograms
    found = set(pool)
    return next((n for n in names if n in found), None)


def _edges(h: Histogram) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper edge of every bucket; the +Inf bucket's upper edge is estimated from
    the sum (its mean value if it had all the mass the finite buckets leave over)."""
    bounds = np.asarray(h.bounds, dtype=np.float64)
    lo = np.concatenate(([0.0], bounds))
    last = float(bounds[-1]) if bounds.shape[0] else 1.0
    counts = np.asarray(h.counts)
    inf = float(counts[-1])
    top = 2.0 * last
    if inf > 0:
        mids = (lo[:-1] + bounds) / 2.0
        rest = (h.sum - float(np.dot(mids, counts[:-1]))) / inf
        top = max(last, 2.0 * rest - last) if math.isfinite(rest) else top
    hi = np.concatenate((bounds, [top]))
    return lo, hi


def histogram_length_dist(h: Histogram) -> tuple[LengthDist, float]:
    """The length distribution a histogram implies, and its precision.

    Quantiles: linear within a bucket (Prometheus' ``histogram_quantile``); the mean is
    exact (``sum/count``). The precision is a bound on the Wasserstein-1 distance between
    the true distribution and this one, relative to the mean: mass can sit anywhere in its
    bucket, at worst at one end, half a bucket from where the interpolation spreads it, so
    W1 <= sum(p_i * width_i) / 2.
    """
    counts = np.asarray(h.counts, dtype=np.float64)
    n = float(counts.sum())
    if n <= 0:
        raise NoTrafficError("the histogram is empty: no request finished in the window")
    lo, hi = _edges(h)
    # token counts are whole and >= 1: bucket (a, b] holds a+1..b (vLLM's bounds are whole)
    lo = np.where(lo == np.floor(lo), lo + 1.0, lo)
    lo = np.minimum(lo, hi)
    cum = np.concatenate(([0.0], np.cumsum(counts))) / n
    q = np.empty(N_QUANTILES)
    for i, p in enumerate(_PROBS):
        # the first bucket whose cumulative share reaches p (skipping empty buckets)
        k = int(np.searchsorted(cum[1:], p, side="left"))
        k = min(k, counts.shape[0] - 1)
        while counts[k] == 0 and k < counts.shape[0] - 1:
            k += 1
        frac = (p - cum[k]) / (counts[k] / n) if counts[k] > 0 else 0.0
        q[i] = lo[k] + min(max(frac, 0.0), 1.0) * (hi[k] - lo[k])
    q = np.maximum.accumulate(q)
    # interpolated moments (uniform within a bucket) for the std; the mean is exact
    p_i = counts / n
    m1 = float(np.dot(p_i, (lo + hi) / 2.0))
    m2 = float(np.dot(p_i, (lo * lo + lo * hi + hi * hi) / 3.0))
    mean = h.sum / h.count if h.count > 0 and h.sum > 0 else m1
    w1_bound = float(np.dot(p_i, hi - lo)) / 2.0
    dist = from_quantiles(q, mean=mean, std=math.sqrt(max(m2 - m1 * m1, 0.0)))
    return dist, _r(w1_bound / max(mean, 1.0))


def _interval_deltas(
    samples: Sequence[MetricsSample], name: str | None, *, counter: bool
) -> np.ndarray:
    """Per consecutive pair of samples, the increase of a counter or a histogram count."""
    out = np.zeros(max(len(samples) - 1, 0))
    if name is None:
        return out
    for i in range(1, len(samples)):
        a, b = samples[i - 1], samples[i]
        if counter:
            d = counter_delta(a.counters.get(name), b.counters.get(name))
        else:
            ha, hb = a.histograms.get(name), b.histograms.get(name)
            d = counter_delta(ha.count if ha else None, hb.count if hb else None)
        out[i - 1] = d or 0.0
    return out


def _window_counts(times: np.ndarray, per_interval: np.ndarray, window: float) -> np.ndarray:
    """Counts per full ``window`` from the first sample, from per-interval counts (the
    cumulative count interpolated linearly in time at the window edges)."""
    rel = times - times[0]
    full = math.floor(float(rel[-1]) / window + 1e-9)
    if full == 0:
        return np.zeros(0)
    cum = np.concatenate(([0.0], np.cumsum(per_interval)))
    at = np.interp(np.arange(full + 1) * window, rel, cum)
    return np.diff(at)


def _arrival_stats(
    times: np.ndarray, per_interval: np.ndarray, duration: float
) -> ArrivalStats | None:
    total = float(per_interval.sum())
    if duration <= 0 or total <= 0:
        return None
    counts60 = _window_counts(times, per_interval, DISPERSION_WINDOW_S)
    disp = dispersion(counts60) if counts60.shape[0] else None
    if counts60.shape[0]:
        window, profile = DISPERSION_WINDOW_S, counts60 / DISPERSION_WINDOW_S
    else:
        window, profile = duration, np.array([total / duration])
    return ArrivalStats(
        interarrival_cv=None,  # gaps between arrivals are not visible in counters
        dispersion_60s=_r(disp) if disp is not None else None,
        zero_gap_fraction=0.0,
        peak_rate_rps=_r(float(profile.max())),
        window_s=_r(window),
        rate_profile=[_r(v) for v in profile],
    )


def shape_from_samples(
    samples: Sequence[MetricsSample],
    *,
    url: str,
    name: str | None = None,
    load: LoadSpec | None = None,
    request_log: np.ndarray | None = None,
) -> TrafficShape:
    """The shape of the traffic between the first and the last sample (at least two).

    ``request_log``: arrival times (unix s) from the server's request log
    (:func:`read_vllm_request_log`); those inside the window (by the samples' ``wall_at``)
    give the arrival statistics instead of the per-interval counts: inter-arrival CV, exact
    60 s window counts (1 s resolution). Raises :class:`NoTrafficError` when no request
    finished in between.
    """
    if len(samples) < 2:
        raise TrafficError(f"need at least 2 /metrics samples of {url} to build a shape "
                           f"(got {len(samples)}); sample for longer")
    first, last = samples[0], samples[-1]
    duration = float(last.taken_at - first.taken_at)
    if not duration > 0:
        raise TrafficError(f"/metrics samples of {url} do not span any time ({duration} s)")
    hists: dict[str, Histogram | None] = {}
    for key in ("prompt_tokens", "generation_tokens", "e2e_latency"):
        hname = _pick(last, key)
        total: Histogram | None = None
        for a, b in pairwise(samples):
            if hname is not None:
                total = _add(total, histogram_delta(a.histograms.get(hname),
                                                    b.histograms.get(hname)))
        hists[key] = total
    prompt, gen = hists["prompt_tokens"], hists["generation_tokens"]
    if prompt is None or gen is None or prompt.count < 1 or gen.count < 1:
        raise NoTrafficError(
            f"no request finished at {url} during the {duration:.0f} s window: no traffic to "
            "build a shape from (send traffic, or sample for longer)"
        )
    inp, prec_in = histogram_length_dist(prompt)
    out, prec_out = histogram_length_dist(gen)
    n = round(prompt.count)
    times = np.asarray([s.taken_at for s in samples], dtype=np.float64)
    arrivals_name = _pick(last, "arrivals")
    per_interval = _interval_deltas(samples, arrivals_name, counter=False)
    n_arrived = float(per_interval.sum())
    rate = n_arrived / duration
    e2e = hists["e2e_latency"]
    concurrency = None
    if e2e is not None and e2e.count > 0 and rate > 0:
        w = e2e.sum / e2e.count
        concurrency = ConcurrencyEstimate(mean=_r(rate * w), method="latency",
                                          mean_latency_s=_r(w))
    prefix = None
    qn, hn = _pick(last, "prefix_queries"), _pick(last, "prefix_hits")
    if qn is not None and hn is not None:
        queried = float(_interval_deltas(samples, qn, counter=True).sum())
        hit = float(_interval_deltas(samples, hn, counter=True).sum())
        if queried > 0:
            prefix = PrefixStats(
                source="server_cache",
                shared_token_fraction=_r(min(1.0, hit / queried)),
                sharing_request_fraction=0.0,
                groups=0,
                mean_group_size=0.0,
            )
    arrivals = _arrival_stats(times, per_interval, duration)
    arrivals_from = f"arrivals counted from {arrivals_name}"
    if request_log is not None:
        if first.wall_at is None or last.wall_at is None:
            raise TrafficError("a request log needs samples with wall-clock times (wall_at)")
        # the log has whole seconds: a request logged in the window's first second counts
        lo, hi = math.floor(first.wall_at), last.wall_at
        logged = request_log[(request_log >= lo) & (request_log < hi)]
        if logged.shape[0] >= 2:
            arrivals = arrival_stats(logged)
            rate = logged.shape[0] / duration
            arrivals_from = f"arrivals from the request log ({logged.shape[0]} in the window)"
        else:
            arrivals_from += (f" (the request log has {logged.shape[0]} request(s) in the "
                              "window: is it this server's, and is the clock the same?)")
    stats: dict[str, Any] = {
        "requests": max(n, 1),
        "duration_s": _r(duration),
        "rate_rps": _r(rate),
        "input_tokens": inp,
        "output_tokens": out,
        "correlation": None,
        "arrivals": arrivals,
        "concurrency": concurrency,
        "prefix": prefix,
    }
    fingerprint = stats_fingerprint(stats)
    if load is None:
        load = LoadSpec(mode="open", requests=min(max(n, 1), DEFAULT_REPLAY_REQUESTS))
    return TrafficShape(
        name=name or "live",
        fingerprint=fingerprint,
        source=SourceInfo(
            path=url,
            format="vllm_metrics",
            note=f"{len(samples)} /metrics samples over {duration:.0f} s; {arrivals_from}",
        ),
        precision=Precision(
            input_tokens=prec_in,
            output_tokens=prec_out,
            note=("lengths from histogram buckets (upper bounds "
                  f"{_bounds_text(prompt.bounds)}); the value is a bound on W1/mean between "
                  "the true and the stored distribution. No input/output correlation, no "
                  "inter-arrival CV; prefix sharing is the server cache's measured hit share "
                  "(a lower bound of the ideal share: block-granular and bounded)"),
        ),
        load=load,
        **stats,
    )


def _bounds_text(bounds: Sequence[float]) -> str:
    return ", ".join(f"{b:g}" for b in bounds)
