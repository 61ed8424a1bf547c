"""The statistics a trial and a study decide with (pure; numpy and scipy, and the
measurement settings' defaults).

* :func:`mean_interval`: the 95 % t-interval of a rate over equal-count segments of one
  continuous run (batch means: each segment's rate is one reading);
* :func:`drift`: whether a measurement's segments moved between its halves (a server
  still speeding up after its warm-up: the interval then is not the steady rate's);
* :class:`SegmentRule`: when a warm-up has converged, when a measurement is precise enough,
  and when a trial is a clear loser (the pruner), as one pure decision per segment;
* :func:`ratio_to_defaults`: the interval of a config's throughput ratio to vLLM's
  defaults over readings on separate server starts (delta method on the log scale with
  the between-start variance pooled over the re-checked configs), and the verdict;
  a capacity's brackets set how narrow that interval can be, and an open bracket gives
  only a bound (:func:`bracket_bound`).

``docs/measurement.md`` says why each rule is what it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats as _st

from autotune.config import MeasureSettings

__all__ = [
    "CAPACITY_BRACKETS",
    "ONE_START_METHODS",
    "RAMP_FACTOR",
    "Drift",
    "Interval",
    "RatioBound",
    "RatioInterval",
    "SegmentRule",
    "Verdict",
    "allowed_misses",
    "bracket_bound",
    "decide_verdict",
    "drift",
    "fmt_ratio",
    "mean_interval",
    "ratio_to_defaults",
    "relative_half_width",
    "starts_needed",
]

CONFIDENCE = 0.95
_MEASURE = MeasureSettings()  # the defaults of the measurement settings


@dataclass(frozen=True)
class Interval:
    """A point estimate with its two-sided interval (same unit)."""

    value: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


def _finite(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray([float(v) for v in values], dtype=float)
    return arr[np.isfinite(arr)]


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """Student-t interval of the mean of ``values`` (None with fewer than 2 finite values).

    Applied to segment rates of one run (batch means): segments as long as a wave of the
    closed loop are close to independent, so the t-interval of their mean is the interval
    of the run's rate.
    """
    arr = _finite(values)
    if arr.size < 2:
        return None
    m = float(arr.mean())
    t = float(_st.t.ppf(0.5 + confidence / 2, arr.size - 1))
    half = t * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    return Interval(m, m - half, m + half)


@dataclass(frozen=True)
class Drift:
    """The change of a measurement's mean rate from its first half of segments to its
    second, relative to the first (+0.10: 10 % faster at the end), and whether it is
    significant at 95 % (Welch's t-test of the two halves)."""

    relative: float
    significant: bool


def drift(values: Sequence[float], confidence: float = CONFIDENCE) -> Drift | None:
    """The drift of a run's segment rates, first half against second (the middle segment
    of an odd count left out); None under 4 finite segments. A steady server's halves
    agree within their noise; a significant drift says the warm-up ended before the server
    reached its steady rate (kernels still compiling or autotuning, caches filling) and
    the measured mean lies between the two."""
    arr = _finite(values)
    if arr.size < 4:
        return None
    h = arr.size // 2
    a, b = arr[:h], arr[arr.size - h:]
    if not a.mean() > 0:
        return None
    rel = float(b.mean() / a.mean() - 1.0)
    va, vb = float(a.var(ddof=1)) / h, float(b.var(ddof=1)) / h
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Drift(rel, bool(b.mean() != a.mean()))
    df = (va + vb) ** 2 / ((va**2 + vb**2) / (h - 1))  # Welch-Satterthwaite; se > 0 here
    t = abs(float(b.mean() - a.mean())) / se
    return Drift(rel, bool(t > float(_st.t.ppf(0.5 + confidence / 2, df))))


#: a load level fails when its misses would be this unlikely (or less) from a server that
#: just meets the bar: its miss rate is then credibly above the allowance
LEVEL_ALPHA = 0.05


def allowed_misses(n: int, share: float, alpha: float = LEVEL_ALPHA) -> int:
    """The most of ``n`` requests that may miss when ``share`` of them may: the (1 - alpha)
    quantile of Binomial(n, share), so that a server whose true miss rate is the
    allowance fails with at most ``alpha`` chance. At the 99 % goodput bar that is 2
    misses of 40 or 56, 3 of 100 and 15 of 1,000 (where ``floor(share x n)`` gave 0, 0,
    1 and 10: one slow request failed a level of 56); 0 when ``share`` is 0."""
    if n <= 0 or share <= 0:
        return 0
    if share >= 1:
        return n
    return int(_st.binom.ppf(1.0 - alpha, n, share))


def relative_half_width(iv: Interval | None) -> float:
    """Half the interval's width over its value (inf when unknown or the value is <= 0)."""
    if iv is None or not iv.value > 0:
        return math.inf
    return (iv.high - iv.low) / 2 / iv.value


Decision = Literal["continue", "warm", "stop_precise", "stop_cap", "stop_pruned"]


#: a warm-up's last three segments moving one way by more than this many tolerances are a
#: ramp still under way (:meth:`SegmentRule.ramping`), even if the last two agree
RAMP_FACTOR = 3.0


@dataclass(frozen=True)
class SegmentRule:
    """How a trial's continuous run is cut into warm-up and measurement (pure).

    Warm-up: done when two consecutive segments agree within ``warmup_tolerance``
    (relative to the larger), they are not the tail of a steep ramp (:meth:`ramping`) and
    no kernel was JIT-compiled during the last one, or after
    ``warmup_max_segments``/``warmup_max_s`` (then not converged). Measurement: stops when
    the ``confidence`` interval of the mean segment rate is within ``precision`` of it
    (relative half-width) after at least ``min_segments``, or at ``measure_max_segments``/
    ``measure_max_s``; or, when ``incumbent_low`` is given, as soon as the interval's top
    after ``prune_after`` segments lies below it (a clear loser).
    """

    # the settings' five (MeasureSettings: their one default and range, --help text)
    precision: float = _MEASURE.precision
    warmup_tolerance: float = _MEASURE.warmup_tolerance
    warmup_max_segments: int = 12
    warmup_max_s: float = _MEASURE.warmup_max_s
    #: 3 let a few agreeing segments stop a run that then drifted: replayed on 17 measured
    #: H200 runs at 2 %, 5 of them stopped early and read up to 4.6 % off their full
    #: run (p90 2.4 %); with 5, at most 2.0 % (p90 0.5 %) for ~0.7 segments more
    #: (experiments/h200-trust/stop-replay.py)
    min_segments: int = _MEASURE.min_segments
    measure_max_segments: int = 40
    measure_max_s: float = _MEASURE.measure_max_s
    prune_after: int = 2
    confidence: float = CONFIDENCE

    @classmethod
    def of(cls, measure: MeasureSettings) -> SegmentRule:
        """The rule of these measurement settings (the other knobs at their defaults)."""
        return cls(precision=measure.precision, warmup_tolerance=measure.warmup_tolerance,
                   warmup_max_s=measure.warmup_max_s, min_segments=measure.min_segments,
                   measure_max_s=measure.measure_max_s)

    def warmup(self, rates: Sequence[float], jit_in_last: bool, elapsed_s: float) -> Decision:
        """``"warm"`` when the warm-up is over (converged or capped), else ``"continue"``."""
        if self.warmup_converged(rates, jit_in_last):
            return "warm"
        if len(rates) >= self.warmup_max_segments or elapsed_s >= self.warmup_max_s:
            return "warm"
        return "continue"

    def warmup_converged(self, rates: Sequence[float], jit_in_last: bool) -> bool:
        return (len(rates) >= 2 and not jit_in_last and self.agree(rates[-2], rates[-1])
                and not self.ramping(rates))

    def ramping(self, rates: Sequence[float]) -> bool:
        """The last three segments move one way by more than ``RAMP_FACTOR`` x the
        tolerance: two agreeing segments there are the tail of a steep ramp, whose end
        one more segment shows. (On an H200 at 256 streams a warm-up of 4,777 / 5,889 /
        6,196 tok/s stopped on its last two, 5.0 % apart, and the run went on climbing
        5-6 % a segment: ``experiments/h200-trust/README.md``.)"""
        if len(rates) < 3:
            return False
        a, b, c = rates[-3:]
        top = max(abs(a), abs(c))
        steady = (a < b < c) or (a > b > c)
        return (steady and top > 0 and math.isfinite(top)
                and abs(c - a) / top > RAMP_FACTOR * self.warmup_tolerance)

    def agree(self, a: float, b: float) -> bool:
        top = max(abs(a), abs(b))
        return top > 0 and math.isfinite(top) and abs(a - b) / top <= self.warmup_tolerance

    def measure(self, rates: Sequence[float], elapsed_s: float,
                incumbent_low: float | None = None) -> Decision:
        """After each measured segment: stop (precise, capped, pruned) or continue."""
        iv = mean_interval(rates, self.confidence)
        if (incumbent_low is not None and iv is not None and len(rates) >= self.prune_after
                and iv.high < incumbent_low):
            return "stop_pruned"
        if len(rates) >= self.min_segments and relative_half_width(iv) <= self.precision:
            return "stop_precise"
        if len(rates) >= self.measure_max_segments or elapsed_s >= self.measure_max_s:
            return "stop_cap"
        return "continue"


# --- the verdict ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioInterval:
    """A ratio to the defaults: its median estimate and interval, and how it was made."""

    median: float
    ci_low: float
    ci_high: float
    method: str
    n_config: int
    n_defaults: int
    # the delta method's pooled between-start SD of log readings and its degrees of
    # freedom (None for within-run intervals): what :func:`starts_needed` works from
    log_sd: float | None = None
    df: int | None = None
    # capacity: the variance one start of each config adds to the log ratio through the
    # search's resolution (each config's mean squared log bracket width / 12, summed)
    log_bracket_var: float = 0.0
    # one start each: the start-to-start SD of log readings taken from elsewhere (earlier
    # studies, or the CPU default) that widened the interval; None when none did
    prior_log_sd: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "ci_low": self.ci_low, "ci_high": self.ci_high}

    @property
    def one_start(self) -> bool:
        """No config was started twice: the interval holds one run's own noise (or the
        range a capacity's brackets allow), never the start-to-start spread."""
        return self.method in ONE_START_METHODS


@dataclass(frozen=True)
class RatioBound:
    """All a capacity ratio can say when a bracket is open (a search that found no failing
    level): ``at_least`` (the config's capacity has no top) or ``at_most`` (the defaults')."""

    kind: Literal["at_least", "at_most"]
    value: float

    def as_dict(self) -> dict[str, str | float]:
        return {"kind": self.kind, "value": self.value}


def _open(iv: Interval) -> bool:
    return not math.isfinite(iv.high)


def _mean_log(xs: Sequence[float]) -> float:
    return float(np.log(np.asarray(xs, dtype=float)).mean())


def bracket_bound(config: Sequence[Interval], defaults: Sequence[Interval]
                  ) -> RatioBound | None:
    """The bound on a capacity ratio when one side's brackets are open (``high`` inf: the
    search ended before a level failed, so the capacity is at least ``low``): the config's
    open gives ``at_least`` exp(mean log low_c - mean log high_d), the defaults' open
    ``at_most`` exp(mean log high_c - mean log low_d). None when both sides are closed (a
    ratio, not a bound) or both have an open bracket (nothing bounds the ratio), or a side
    has no bracket with a low end > 0."""
    if not config or not defaults or any(not iv.low > 0 for iv in (*config, *defaults)):
        return None
    c_open, d_open = any(map(_open, config)), any(map(_open, defaults))
    if c_open == d_open:
        return None
    if c_open:
        return RatioBound("at_least", math.exp(_mean_log([iv.low for iv in config])
                                               - _mean_log([iv.high for iv in defaults])))
    return RatioBound("at_most", math.exp(_mean_log([iv.high for iv in config])
                                          - _mean_log([iv.low for iv in defaults])))


def _bracket_var(brackets: Sequence[Interval]) -> float:
    """The variance of a log capacity within its bracket, one start's: the mean squared
    log width / 12 (uniform on the log scale between the passing and the failing level)."""
    widths = [math.log(iv.high / iv.low) for iv in brackets if iv.low > 0]
    return sum(w * w for w in widths) / len(widths) / 12.0 if widths else 0.0


def ratio_to_defaults(
    config: Sequence[float],
    defaults: Sequence[float],
    *,
    others: Sequence[Sequence[float]] = (),
    within: Mapping[str, Interval | None] | None = None,
    spread: Sequence[Sequence[float]] | None = None,
    brackets: Mapping[str, Sequence[Interval]] | None = None,
    confidence: float = CONFIDENCE,
    prior: tuple[float, int | None] | None = None,
) -> RatioInterval | None:
    """Interval of mean(config) / mean(defaults) from readings on separate server starts.

    Delta method on the log scale: log ratio = mean log(config) - mean log(defaults), its
    variance s^2 (1/n_c + 1/n_d) with s^2 the between-start variance of log readings
    pooled over the config, the defaults and ``others`` (the other re-checked configs:
    the relative noise of a start is taken to be the same for every config, which gives
    the variance more degrees of freedom than two starts of one config would), and a
    Student-t quantile with the pooled degrees of freedom. ``median`` is exp(log ratio),
    the median of that log-normal. With no repeated start at all (nothing to pool), the
    within-run intervals ``within={"config": iv, "defaults": iv}`` are used instead
    (method ``within_run``): they see only a run's own noise, not a start's.

    ``spread``, when given, replaces (config, defaults, *others) as the groups the
    between-start variance is pooled over, while the estimate still comes from ``config``
    and ``defaults``: a study whose estimate uses fresh-server readings only passes every
    config's readings on all its starts, search readings included (a search reading picked
    for being high only widens its config's spread), so one fresh start each is not
    mistaken for "no start-to-start noise measured".

    ``brackets`` (a capacity: ``{"config": [...], "defaults": [...]}``, the bracket
    [highest pass, lowest fail] of each reading) sets the resolution: with one start each
    the interval is every ratio the brackets allow, [low_c / high_d, high_c / low_d]
    (method :data:`CAPACITY_BRACKETS`); with repeated starts each config adds its mean
    squared log bracket width / 12 over its starts to the variance. An open bracket (no
    failing level) gives no ratio (None; :func:`bracket_bound` gives its bound).

    ``prior`` = (log SD, df or None): a start-to-start spread measured elsewhere (earlier
    studies; df None for a stated default). With one start each it widens the interval by
    the variance two starts add, 2 SD^2 (in quadrature with the within-run one; either side
    of the brackets' range), at the Student-t quantile of its df (the normal one for None).
    """
    c, d = _finite(config), _finite(defaults)
    c, d = c[c > 0], d[d > 0]
    if c.size == 0 or d.size == 0:
        return None
    cb, db = (list(brackets.get("config") or []), list(brackets.get("defaults") or [])
              ) if brackets is not None else ([], [])
    if brackets is not None and (not cb or not db or any(
            _open(iv) or not iv.low > 0 for iv in (*cb, *db))):
        return None
    est = float(np.log(c).mean() - np.log(d).mean())
    ss, df = 0.0, 0
    groups: list[Sequence[float]] = (list(spread) if spread is not None
                                     else [list(c), list(d), *others])
    for group in (_finite(g) for g in groups):
        group = group[group > 0]
        if group.size >= 2:
            logs = np.log(group)
            ss += float(((logs - logs.mean()) ** 2).sum())
            df += group.size - 1
    bv = 0.0
    if df > 0:
        s2 = ss / df
        var = s2 * (1 / c.size + 1 / d.size)
        method = f"delta method on log readings, between-start variance pooled (df={df})"
        if spread is not None:
            method += " over every config's starts, search readings included"
        if brackets is not None:
            # a start's reading is its bracket's low end: the true capacity lies anywhere
            # up to the lowest failing level, so the mean over starts is no finer than that
            wc, wd = _bracket_var(cb), _bracket_var(db)
            var += wc / c.size + wd / d.size
            bv = wc + wd
            method += ", widened by the capacity brackets"
        se = math.sqrt(var)
        q = float(_st.t.ppf(0.5 + confidence / 2, df))
    elif brackets is not None:
        lo = _mean_log([iv.low for iv in cb]) - _mean_log([iv.high for iv in db])
        hi = _mean_log([iv.high for iv in cb]) - _mean_log([iv.low for iv in db])
        wide = _prior_half(prior, confidence)
        return RatioInterval(median=math.exp(est), ci_low=math.exp(min(lo, est) - wide),
                             ci_high=math.exp(max(hi, est) + wide), method=CAPACITY_BRACKETS,
                             n_config=int(c.size), n_defaults=int(d.size),
                             prior_log_sd=prior[0] if prior else None)
    else:
        ivs = within or {}
        ci, di = ivs.get("config"), ivs.get("defaults")
        if ci is None or di is None or not (ci.value > 0 and di.value > 0):
            return None
        if not all(math.isfinite(x) for x in (ci.low, ci.high, di.low, di.high)):
            return None  # an open interval (a capacity bracket without an upper end)
        z = float(_st.norm.ppf(0.5 + confidence / 2))
        # relative standard errors of each mean, from their own intervals
        se = math.hypot((ci.high - ci.low) / 2 / z / ci.value,
                        (di.high - di.low) / 2 / z / di.value)
        q = z
        method = WITHIN_RUN_ONLY
        if prior is not None:  # the spread two starts add, from elsewhere
            se = math.sqrt(se * se + 2 * prior[0] ** 2)
            q = _prior_q(prior, confidence)
    lo, hi = est - q * se, est + q * se
    return RatioInterval(median=math.exp(est), ci_low=math.exp(lo), ci_high=math.exp(hi),
                         method=method, n_config=int(c.size), n_defaults=int(d.size),
                         log_sd=math.sqrt(ss / df) if df > 0 else None,
                         df=df if df > 0 else None, log_bracket_var=bv,
                         prior_log_sd=prior[0] if prior and df == 0 else None)


def _prior_q(prior: tuple[float, int | None], confidence: float) -> float:
    """The quantile a borrowed spread is used at: Student-t of its df, normal without one."""
    df = prior[1]
    return float(_st.t.ppf(0.5 + confidence / 2, df) if df else
                 _st.norm.ppf(0.5 + confidence / 2))


def _prior_half(prior: tuple[float, int | None] | None, confidence: float) -> float:
    """How far a borrowed start-to-start spread widens a one-start range (log scale)."""
    return 0.0 if prior is None else _prior_q(prior, confidence) * math.sqrt(2) * prior[0]


def fmt_ratio(r: float) -> str:
    """A ratio to vLLM's defaults for people, everywhere it prints: three decimals and an
    x (1.094x), so that a gain of a few tenths of a percent stays visible."""
    return f"{r:.3f}x"


# the ratio's method when no config was started twice (a study without its re-check)
WITHIN_RUN_ONLY = "within-run intervals only (no repeated server start)"
# the same for a capacity: the interval is every ratio the two brackets allow
CAPACITY_BRACKETS = "capacity brackets (one start each)"
# the methods of a ratio that rests on one server start of each config: never a winner
ONE_START_METHODS = (WITHIN_RUN_ONLY, CAPACITY_BRACKETS)

# beyond this many starts of each config the answer is "not worth it", not a number
MAX_STARTS_NEEDED = 50


def starts_needed(ratio: RatioInterval | None, *, confidence: float = CONFIDENCE,
                  max_starts: int = MAX_STARTS_NEEDED) -> int | None:
    """Starts of each of the two configs that would show ``ratio.median`` above 1, if the
    start-to-start spread stays as measured (``ratio.log_sd``): the least ``n`` with
    ``t(df_n) * sqrt((2 log_sd^2 + log_bracket_var) / n) < log(median)``, where ``df_n``
    is the pooled degrees of freedom with both configs at ``n`` starts (the other
    re-checked configs' share kept) and ``log_bracket_var`` a capacity's bracket
    resolution per start. None when no number of starts would: the ratio is at most 1, the
    interval came from within-run figures alone (no start-to-start spread measured), or it
    would take more than ``max_starts``. A planning figure: the spread itself is estimated
    from few starts."""
    if (ratio is None or ratio.log_sd is None or ratio.df is None or ratio.median <= 1.0
            or not math.isfinite(ratio.median)):
        return None
    gap = math.log(ratio.median)
    per_start = 2 * ratio.log_sd ** 2 + ratio.log_bracket_var  # the log ratio's, n = 1
    if per_start <= 0:
        return max(ratio.n_config, ratio.n_defaults)
    rest = ratio.df - (ratio.n_config - 1) - (ratio.n_defaults - 1)  # the other configs'
    for n in range(2, max_starts + 1):
        df = rest + 2 * (n - 1)
        q = float(_st.t.ppf(0.5 + confidence / 2, df))
        if q * math.sqrt(per_start / n) < gap:
            return n
    return None


@dataclass(frozen=True)
class Verdict:
    """``winner`` when the ratio's interval lies above 1 over repeated server starts;
    ``unconfirmed`` when it lies above 1 from one start of each config (a lead the next
    start may not repeat); else ``defaults_best``."""

    verdict: Literal["winner", "unconfirmed", "defaults_best"]
    ratio: RatioInterval | None
    reason: str


def decide_verdict(ratio: RatioInterval | None, *, candidate_is_defaults: bool = False) -> Verdict:
    """A winner is declared only if the whole interval of its ratio to the defaults is > 1
    and the interval holds the start-to-start spread (a second server start of each config);
    from one start each such a lead is ``unconfirmed``."""
    if candidate_is_defaults:
        return Verdict("defaults_best", ratio, "the best config found is vLLM's defaults")
    if ratio is None:
        return Verdict("defaults_best", None,
                       "no ratio to the defaults could be estimated (the defaults or the "
                       "candidate have no reading)")
    if ratio.ci_low > 1.0 and ratio.one_start:
        return Verdict("unconfirmed", ratio,
                       f"leads, unconfirmed: one server start each: {fmt_ratio(ratio.median)} "
                       f"the defaults ({ratio.method}); a fresh-server re-check of it and of "
                       "the defaults confirms it or not")
    if ratio.ci_low > 1.0:
        return Verdict("winner", ratio,
                       f"{fmt_ratio(ratio.median)} the defaults, 95 % interval "
                       f"[{ratio.ci_low:.3f}, {ratio.ci_high:.3f}] lies above 1")
    return Verdict("defaults_best", ratio,
                   f"best ratio {fmt_ratio(ratio.median)}, 95 % interval [{ratio.ci_low:.3f}, "
                   f"{ratio.ci_high:.3f}] does not lie above 1: vLLM's defaults remain best")
