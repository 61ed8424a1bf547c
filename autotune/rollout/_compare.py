"""New servers against old ones, from their own ``/metrics`` over the same window (pure).

Each server is scraped at the same ticks; a window's figures are the deltas between the
scrape at the window's start and the latest one, summed over the servers of a side (new or
old). Latency quantiles come from the histograms' bucket deltas, linear within a bucket as
Prometheus' ``histogram_quantile``; their 95 % interval is the distribution-free one of an
order statistic: the ranks ``n q -+ 1.96 sqrt(n q (1 - q))`` read through the same
interpolation. A rank in the +Inf bucket has no upper bound: too few requests for that
quantile yet, so the metric stays undecided.

The new/old ratio of a quantile is judged on the log scale: centre ``log(q_new / q_old)``,
half-width ``sqrt(h_new^2 + h_old^2)`` (the two sides are independent). Errors (requests
that finished aborted or in error) are judged on the difference of the two error fractions
(Agresti-Caffo interval).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from autotune.traffic import Histogram
from autotune.traffic._metrics import histogram_delta

__all__ = [
    "LATENCY_HISTOGRAMS",
    "METRICS",
    "Judgement",
    "MetricVerdict",
    "ServerScrape",
    "SideFigures",
    "judge",
    "parse_scrape",
    "quantile_interval",
    "side_figures",
]

Z95: Final = 1.959964
#: histogram read for each latency, first name found wins (vLLM 0.2x/0.3x, then older)
LATENCY_HISTOGRAMS: Final[dict[str, tuple[str, ...]]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "tpot": ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds",
             "vllm:inter_token_latency_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds",),
}
#: the SLO metrics a step can be judged on (``--metrics``); "errors" is always judged
METRICS: Final = tuple(f"{k}_{p}" for k in LATENCY_HISTOGRAMS for p in ("p50", "p99"))
_ERROR_REASONS: Final = ("abort", "error")

Decision = Literal["pass", "regress", "undecided"]


@dataclass(frozen=True)
class ServerScrape:
    """What a rollout reads from one server's ``/metrics`` at one tick."""

    taken_at: float  # time.time()
    histograms: Mapping[str, Histogram]  # the latency histograms (cumulative)
    finished: float  # requests finished, every reason (counter)
    errors: float  # requests finished aborted or in error (counter)
    output_tokens: float  # vllm:generation_tokens_total (counter)
    running: float  # gauge
    waiting: float  # gauge


def parse_scrape(text: str, *, taken_at: float) -> ServerScrape:
    """A :class:`ServerScrape` from a vLLM ``/metrics`` page (raises
    :class:`~autotune.errors.TrafficError` when it is not one)."""
    from autotune.load import parse_metrics
    from autotune.traffic import parse_vllm_metrics

    names = [n for ns in LATENCY_HISTOGRAMS.values() for n in ns]
    sample = parse_vllm_metrics(text, taken_at=taken_at, extra_histograms=names)
    snap = parse_metrics(text, taken_at=taken_at)
    finished = errors = 0.0
    for line in text.splitlines():  # the finish reason is a label: the snapshot sums it away
        if line.startswith("vllm:request_success_total{"):
            try:
                value = float(line.rsplit(None, 1)[1])
            except (IndexError, ValueError):
                continue
            finished += value
            if any(f'finished_reason="{r}"' in line for r in _ERROR_REASONS):
                errors += value
    return ServerScrape(
        taken_at=taken_at,
        histograms={k: v for k, v in sample.histograms.items() if k in names},
        finished=finished,
        errors=errors,
        output_tokens=snap.counters.get("vllm:generation_tokens", 0.0),
        running=snap.gauges.get("vllm:num_requests_running", 0.0),
        waiting=snap.gauges.get("vllm:num_requests_waiting", 0.0),
    )


@dataclass(frozen=True)
class SideFigures:
    """One side's window (new or old servers summed): histogram deltas and counts."""

    histograms: Mapping[str, Histogram]  # by latency key (ttft, tpot, e2e)
    finished: float
    errors: float
    output_tokens_per_s: float
    running: float  # at the window's end
    waiting: float


def _sum_hist(a: Histogram | None, b: Histogram | None) -> Histogram | None:
    if a is None or b is None:
        return a or b
    if a.bounds != b.bounds:
        return a if a.count >= b.count else b
    return Histogram(a.bounds, tuple(x + y for x, y in zip(a.counts, b.counts, strict=True)),
                     a.sum + b.sum, a.count + b.count)


def _pick(h: Mapping[str, Histogram], key: str) -> Histogram | None:
    return next((h[n] for n in LATENCY_HISTOGRAMS[key] if n in h), None)


def side_figures(pairs: Sequence[tuple[ServerScrape, ServerScrape]]) -> SideFigures:
    """The window of a side from each server's (start, end) scrapes."""
    hists: dict[str, Histogram] = {}
    finished = errors = tokens = running = waiting = 0.0
    rate = 0.0
    for start, end in pairs:
        for key in LATENCY_HISTOGRAMS:
            d = histogram_delta(_pick(start.histograms, key), _pick(end.histograms, key))
            s = _sum_hist(hists.get(key), d)
            if s is not None:
                hists[key] = s
        finished += max(0.0, end.finished - start.finished)
        errors += max(0.0, end.errors - start.errors)
        tokens = max(0.0, end.output_tokens - start.output_tokens)
        span = end.taken_at - start.taken_at
        rate += tokens / span if span > 0 else 0.0
        running += end.running
        waiting += end.waiting
    return SideFigures(hists, finished, errors, rate, running, waiting)


def _value_at_rank(h: Histogram, rank: float) -> float:
    """The value at ``rank`` (0..n) of the histogram, linear within a bucket; inf in the
    +Inf bucket."""
    lo = 0.0
    seen = 0.0
    for i, c in enumerate(h.counts):
        hi = h.bounds[i] if i < len(h.bounds) else math.inf
        if c > 0 and seen + c >= rank:
            if math.isinf(hi):
                return math.inf
            return lo + (hi - lo) * max(0.0, min(1.0, (rank - seen) / c))
        seen += c
        lo = hi
    return math.inf


def quantile_interval(h: Histogram, q: float) -> tuple[float, float, float] | None:
    """(estimate, 95 % low, 95 % high) of quantile ``q``; None for an empty histogram."""
    n = float(sum(h.counts))
    if n <= 0:
        return None
    half = Z95 * math.sqrt(n * q * (1.0 - q))
    est = _value_at_rank(h, q * n)
    lo = _value_at_rank(h, max(q * n - half, 0.0)) if q * n - half > 0 else 0.0
    hi = _value_at_rank(h, q * n + half + 1.0) if q * n + half + 1.0 <= n else math.inf
    return est, lo, hi


@dataclass(frozen=True)
class MetricVerdict:
    """One metric of a step: the two sides' values, the new/old ratio (errors: the
    difference of the error fractions) with its 95 % interval, and the decision."""

    metric: str
    new: float | None
    old: float | None
    ratio: float | None  # errors: difference new - old
    low: float | None
    high: float | None
    limit: float  # pass when high <= limit, regress when low > limit
    decision: Decision

    def as_dict(self) -> dict[str, object]:
        def r(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, 6)

        return {"metric": self.metric, "new": r(self.new), "old": r(self.old),
                "ratio": r(self.ratio), "low": r(self.low), "high": r(self.high),
                "limit": self.limit, "decision": self.decision}


def _decide(low: float, high: float, limit: float) -> Decision:
    if low > limit:
        return "regress"
    return "pass" if high <= limit else "undecided"


def _latency(metric: str, new: SideFigures, old: SideFigures, tolerance: float
             ) -> MetricVerdict:
    key, pct = metric.rsplit("_", 1)
    q = int(pct[1:]) / 100.0
    limit = 1.0 + tolerance
    hn, ho = new.histograms.get(key), old.histograms.get(key)
    a = quantile_interval(hn, q) if hn else None
    b = quantile_interval(ho, q) if ho else None
    if a is None or b is None:
        return MetricVerdict(metric, a[0] if a else None, b[0] if b else None, None, None,
                             None, limit, "undecided")
    (en, ln, un), (eo, lo, uo) = a, b
    if min(en, ln, eo, lo) <= 0 or math.isinf(un) or math.isinf(uo):
        return MetricVerdict(metric, en, eo, en / eo if eo > 0 else None, None, None, limit,
                             "undecided")
    centre = math.log(en / eo)
    half = math.hypot((math.log(un) - math.log(ln)) / 2.0, (math.log(uo) - math.log(lo)) / 2.0)
    low, high = math.exp(centre - half), math.exp(centre + half)
    return MetricVerdict(metric, en, eo, en / eo, low, high, limit, _decide(low, high, limit))


def _errors(new: SideFigures, old: SideFigures, tolerance: float) -> MetricVerdict:
    """Agresti-Caffo interval of the difference of the error fractions."""
    if new.finished <= 0 or old.finished <= 0:
        return MetricVerdict("errors", None, None, None, None, None, tolerance, "undecided")
    pn = (new.errors + 1.0) / (new.finished + 2.0)
    po = (old.errors + 1.0) / (old.finished + 2.0)
    se = math.sqrt(pn * (1 - pn) / (new.finished + 2.0) + po * (1 - po) / (old.finished + 2.0))
    d = pn - po
    low, high = d - Z95 * se, d + Z95 * se
    return MetricVerdict("errors", new.errors / new.finished, old.errors / old.finished, d, low,
                         high, tolerance, _decide(low, high, tolerance))


@dataclass(frozen=True)
class Judgement:
    """A step's comparison at one tick: every metric, and the step's decision."""

    verdicts: tuple[MetricVerdict, ...]
    decision: Decision
    why: str


def judge(new: SideFigures, old: SideFigures, *, metrics: Sequence[str], tolerance: float,
          error_tolerance: float, min_requests: int) -> Judgement:
    """Pass when every metric passes; regress as soon as one regresses; else undecided
    (too few requests on a side counts as undecided)."""
    verdicts = [_latency(m, new, old, tolerance) for m in metrics]
    verdicts.append(_errors(new, old, error_tolerance))
    worse = [v.metric for v in verdicts if v.decision == "regress"]
    if min(new.finished, old.finished) < min_requests:
        return Judgement(tuple(verdicts), "undecided",
                         f"{int(new.finished)} new and {int(old.finished)} old requests "
                         f"finished; {min_requests} needed on each side")
    if worse:
        return Judgement(tuple(verdicts), "regress", "worse beyond the tolerance: "
                         + ", ".join(worse))
    open_ = [v.metric for v in verdicts if v.decision == "undecided"]
    if open_:
        return Judgement(tuple(verdicts), "undecided", "not decided yet: " + ", ".join(open_))
    return Judgement(tuple(verdicts), "pass", "not worse beyond the tolerance on any metric")
