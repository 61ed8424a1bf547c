"""Capacity under SLOs: the bracketing search over the arrival-rate scale (pure).

The capacity of one server for a traffic shape is the highest scale ``s`` of the shape's
recorded arrival rate at which the server still serves at least ``goodput`` (99 %) of the
offered requests within every SLO, with no more than ``max_error_rate`` failed. The
search runs on one running server: each probe replays the shape's open-loop arrivals at
``s`` x the recorded rate for a bounded time (:mod:`autotune.trial`) and says pass or
fail; this module only decides where to probe next:

1. probe ``start`` (1.0: the recorded rate, or where the warm-up put the capacity); when
   the warm-up before the search already saw the server fall behind the arrivals at some
   scale (``failed_at``), that scale is the bracket's top from the start;
2. step from there until a pass and a fail bracket the capacity (or ``max_scale``:
   capacity at least that; ``min_scale``: no capacity): up after a pass, down after a
   fail, by ``step`` first and then by the square of the last step, at most 2x. With no
   idea where the capacity is, ``step`` is 2 (doubling); when the warm-up put the start
   just under it, it is ``1 + tolerance`` (1.25, 1.56, 2, 2, ...): a capacity within that
   step is bracketed within the tolerance by the second level, a far one is still reached
   by doubling. A step up never passes the middle of a bracket the warm-up topped;
3. bisect the bracket [highest pass, lowest fail] at its geometric mean until
   ``high / low - 1 <= tolerance`` or ``max_levels`` probes are spent.

The capacity is the bracket's low end (a rate the server was seen to sustain), and the
bracket is its interval. Pass/fail near the edge is noisy; the bisection only ever probes
inside the current bracket, so a noisy answer narrows the bracket to the wrong side by at
most one step and never makes it inconsistent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, NotRequired, TypedDict, cast

from autotune.errors import ConfigError

__all__ = ["CapacityRecord", "CapacityResult", "CapacitySearch", "Level", "LevelRecord",
           "flat_note", "search_capacity"]

Status = Literal["found", "levels", "time", "capped", "none", "pruned", "screened"]


@dataclass(frozen=True)
class CapacitySearch:
    """How the bracketing search runs (``autotune tune --objective capacity``)."""

    goodput: float = 0.99  # share of the offered requests that must meet every SLO
    max_error_rate: float = 0.05  # share of the offered requests that may fail
    start: float = 1.0  # the first scale of the recorded rate
    tolerance: float = 0.25  # stop when high / low - 1 <= tolerance (a bracket 1.25x wide)
    min_scale: float = 1.0 / 64
    max_scale: float = 64.0
    max_levels: int = 10  # probes (load levels) per search, at most
    # the first step up or down from ``start`` (then squared, at most 2): 2 without a clue
    # where the capacity is; 1 + tolerance from a start the warm-up put just under it
    step: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 < self.goodput <= 1.0:
            raise ConfigError(f"capacity goodput is {self.goodput}; use a share in (0, 1], "
                              "e.g. 0.99")
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise ConfigError(f"max error rate is {self.max_error_rate}; use a share in [0, 1]")
        if not (0 < self.min_scale <= self.start <= self.max_scale and
                all(map(math.isfinite, (self.min_scale, self.start, self.max_scale)))):
            raise ConfigError(
                f"capacity scales: need 0 < min {self.min_scale} <= start {self.start} <= "
                f"max {self.max_scale}")
        if not 0.0 < self.tolerance < 1.0:
            raise ConfigError(f"capacity tolerance is {self.tolerance}; use a fraction in "
                              "(0, 1), e.g. 0.1")
        if self.max_levels < 2:
            raise ConfigError(f"capacity max levels is {self.max_levels}; a bracket needs >= 2")
        if not 1.0 < self.step <= 2.0:
            raise ConfigError(f"capacity step is {self.step}; use a factor in (1, 2]")


class LevelRecord(TypedDict):
    """``Level.to_dict()``: one load level as stored (``outcome.capacity["levels"]``)."""

    scale: float
    offered_rps: float
    passed: bool
    goodput_fraction: float
    error_rate: float
    offered: int
    output_tokens_per_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    e2e_p99_s: float | None
    seconds: float
    stopped_early: bool
    note: str
    jit_compiled: bool
    reruns: int
    finished: int
    missed_by: dict[str, int]
    # absent in records written before they were kept
    warmup_s: NotRequired[float]
    worst_misses: NotRequired[list[str]]
    remeasured: NotRequired[bool]
    # the rate the level sent: its requests over their send span, the recording's busiest
    # stretch at ``scale`` (``offered_rps`` is the mean rate that scale gives); absent in
    # records written before it was kept, None for sessions replayed turn by turn
    busiest_rps: NotRequired[float | None]


class CapacityRecord(TypedDict):
    """``CapacityResult.to_dict()``: the bracket and every level as stored
    (``TrialOutcome.capacity``, the ``autotune.capacity`` attribute). A trial adds how
    long its levels ran and where the search started (the keys marked not required)."""

    recorded_rps: float
    low: float | None
    high: float | None
    flat_misses_rps: list[float] | None
    status: Status
    capacity_rps: float | None
    ci_low_rps: float | None
    ci_high_rps: float | None
    levels: list[LevelRecord]
    # the bracket's top is the warm-up's (absent in records written before it was kept)
    high_from_warmup: NotRequired[bool]
    level_s: NotRequired[float]
    level_s_asked: NotRequired[float]
    level_note: NotRequired[str]
    start: NotRequired[float]
    start_note: NotRequired[str]
    # a session capacity search (sessions replayed turn by turn): the recorded session rate
    # the scale multiplies as well, and the capacity and its interval's top in sessions/s
    recorded_sps: NotRequired[float]
    capacity_sps: NotRequired[float | None]
    ci_high_sps: NotRequired[float | None]


@dataclass(frozen=True)
class Level:
    """One probe: the load at ``scale`` x the recorded rate and what the server did."""

    scale: float
    offered_rps: float  # the arrival rate offered (scale x recorded rate)
    passed: bool
    goodput_fraction: float  # requests that met every SLO / offered requests
    error_rate: float  # failed requests / offered requests
    offered: int = 0  # requests the level's schedule held
    output_tokens_per_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    e2e_p99_s: float | None = None
    seconds: float = 0.0
    stopped_early: bool = False  # stopped once it could no longer pass
    note: str = ""
    jit_compiled: bool = False  # the server log showed a kernel JIT-compiled during it
    reruns: int = 0  # run again: its first run failed while a kernel was JIT-compiled
    finished: int = 0  # requests that ended (a level stopped early cancels the rest)
    # of those, how many exceeded each SLO threshold or failed ({"tpot": 4, "ttft": 1}; a
    # request over two thresholds counts in both): which SLO binds
    missed_by: dict[str, int] = field(default_factory=dict)
    # a session level's warm-up before it (the conversations already under way put into
    # the prefix cache), seconds; 0 for other levels
    warmup_s: float = 0.0
    # the requests that missed by most, worst first, each with its figure and the limit
    # ("request 12 (session 3, turn 2): ttft 3.1 s > 2 s")
    worst_misses: list[str] = field(default_factory=list)
    remeasured: bool = False  # run again: no level of the search had passed
    # the rate the level sent (its requests over their send span): a level replays the
    # recording's busiest stretch, which runs faster than the mean rate ``offered_rps``
    busiest_rps: float | None = None

    def to_dict(self) -> LevelRecord:
        return cast(LevelRecord, asdict(self))

    def outcome(self) -> str:
        """"pass (99.3% within SLOs)", or for a level stopped once it could no longer pass,
        why ("fail, stopped early: 5 of 432 requests missed the SLOs ..."): its goodput share
        then counts only the requests finished by the stop, which reads as a collapse."""
        jit = "; a kernel was JIT-compiled during it" if self.jit_compiled else ""
        if self.reruns:
            jit += "; run again after a first run that failed while a kernel compiled"
        if self.remeasured:
            jit += "; measured again, as no level had passed"
        if self.missed_by:
            jit += "; over " + ", ".join(f"{k} {n}" for k, n in self.missed_by.items())
        if self.worst_misses:
            jit += "; worst: " + "; ".join(self.worst_misses[:3])
        if self.stopped_early and self.note:
            return f"fail, stopped early: {self.note}{jit}"
        return (f"{'pass' if self.passed else 'fail'} ({self.goodput_fraction:.1%} within "
                f"SLOs){jit}")


@dataclass
class CapacityResult:
    """The bracket: capacity = ``low`` x the recorded rate, interval [low, high]."""

    recorded_rps: float
    low: float | None = None  # the highest scale that passed (None: none passed)
    high: float | None = None  # the lowest scale that failed (None: none failed)
    # found: bracket within tolerance; levels: probes spent first; time: the time cap
    # ended the search first (--capacity-max-s); capped: passed at max_scale; none: failed
    # at min_scale; pruned: its top fell below the incumbent's capacity (``prune_below``);
    # screened: its coarse bracket was no leader (``screen``: screen, then refine)
    status: Status = "levels"
    levels: list[Level] = field(default_factory=list)
    # ``high`` is the warm-up's: the server fell behind the arrivals there (no level failed
    # below it)
    high_from_warmup: bool = False
    # sessions replayed turn by turn: the recorded session rate (sessions/s), scaled with
    # the request rate; the capacity is then also in sessions/s (None: independent requests)
    recorded_sps: float | None = None

    @property
    def capacity_rps(self) -> float | None:
        return self.low * self.recorded_rps if self.low is not None else None

    @property
    def capacity_sps(self) -> float | None:
        """The capacity in sessions/s (a session capacity search; else None)."""
        if self.low is None or self.recorded_sps is None:
            return None
        return self.low * self.recorded_sps

    @property
    def ci_high_sps(self) -> float | None:
        if self.high is None or self.recorded_sps is None:
            return None
        return self.high * self.recorded_sps

    @property
    def ci_low_rps(self) -> float | None:
        return self.capacity_rps

    @property
    def ci_high_rps(self) -> float | None:
        return self.high * self.recorded_rps if self.high is not None else None

    def at_capacity(self) -> Level | None:
        """The passing level the capacity rests on."""
        passed = [lv for lv in self.levels if lv.passed and lv.scale == self.low]
        return passed[-1] if passed else None

    def flat_misses(self, goodput: float) -> tuple[float, float] | None:
        """The rates (req/s) between which every level that ended enough requests (50)
        missed the SLOs for about the share the goodput bar allows (half to twice ``1 -
        goodput``), when they span 1.3x or more: there the miss rate barely grows with the
        load, so where the capacity lands within that range is chance from start to start
        (the H200's azure shape: from 14 to 22 req/s each failing level failed by one miss
        over the bar, e.g. 5 of 443 requests, TPOT p99 near its SLO all along, and the
        defaults' capacity read 9-14 req/s). None otherwise, and for levels recorded
        before ``finished`` was."""
        q = 1.0 - goodput
        if q <= 0:
            return None
        band = [lv.offered_rps for lv in self.levels if lv.finished >= 50
                and q / 2 <= (lv.finished - round(lv.goodput_fraction * lv.offered))
                / lv.finished <= 2 * q]
        if len(band) < 2 or max(band) / min(band) < 1.3:
            return None
        return min(band), max(band)

    def summary(self, search: CapacitySearch | None = None, max_s: float | None = None) -> str:
        """One line for logs and trial messages; with the search it ran (and its time cap,
        ``max_s``), why the bracket is not within the tolerance when it is not."""
        r = self.recorded_rps
        if self.recorded_sps is not None:
            line = self._session_line()
        elif self.low is None:
            line = (f"no load level met the SLOs: even {self.high or 0:.3g}x the recorded "
                    f"rate ({(self.high or 0) * r:.3g} req/s) failed ({len(self.levels)} levels)")
        elif self.high is None:
            line = (f"capacity at least {self.low * r:.3g} req/s ({self.low:.3g}x the "
                    f"recorded {r:.3g} req/s; no level failed), {self.status}, "
                    f"{len(self.levels)} levels")
        else:
            top = (" (its top: the warm-up, where the server fell behind the arrivals)"
                   if self.high_from_warmup else "")
            line = (f"capacity {self.low * r:.3g} req/s ({self.low:.3g}x the recorded "
                    f"{r:.3g} req/s), interval [{self.low * r:.3g}, {self.high * r:.3g}] "
                    f"req/s{top}, {self.status}, {len(self.levels)} levels")
        why = self.reason(search, max_s) if search is not None else ""
        return f"{line}: {why}" if why else line

    def _session_line(self) -> str:
        """:meth:`summary`'s line for a session capacity search: sessions/s first, the
        requests (turns) per second they send beside."""
        sps, r = self.recorded_sps or 0.0, self.recorded_rps
        n = len(self.levels)
        if self.low is None:
            return (f"no load level met the SLOs: even {self.high or 0:.3g}x the recorded "
                    f"session rate ({(self.high or 0) * sps:.3g} sessions/s, "
                    f"{(self.high or 0) * r:.3g} req/s of turns) failed ({n} levels)")
        at = (f"{self.low * sps:.3g} sessions/s ({self.low * r:.3g} req/s of turns; "
              f"{self.low:.3g}x the recorded {sps:.3g} sessions/s)")
        if self.high is None:
            return f"capacity at least {at}, no level failed, {self.status}, {n} levels"
        top = (" (its top: the warm-up, where the server fell behind the arrivals)"
               if self.high_from_warmup else "")
        return (f"capacity {at}, interval [{self.low * sps:.3g}, {self.high * sps:.3g}] "
                f"sessions/s{top}, {self.status}, {n} levels")

    def reason(self, search: CapacitySearch, max_s: float | None = None) -> str:
        """Why the bracket is not closed within ``search.tolerance`` ("" when it is): what
        ended the search first, and what to change."""
        width = f"{1.0 + search.tolerance:.3g}x"
        if self.status == "found":
            return ""
        if self.status == "time":
            cap = f"--capacity-max-s {max_s:g}" if max_s is not None else "--capacity-max-s"
            return (f"the time cap ({cap}) ended the search before the bracket was within "
                    f"{width}; leave the cap out (the search then takes as long as that "
                    "resolution needs) or raise it")
        if self.status == "levels":
            return (f"--capacity-max-levels {search.max_levels} levels were spent before the "
                    f"bracket was within {width}; raise it")
        if self.status == "pruned":
            return ("stopped early: a level failed below the incumbent's capacity, so this "
                    "config cannot win (--pruner none measures it to the end)")
        if self.status == "capped":
            return (f"the server still met the SLOs at the highest rate searched "
                    f"({search.max_scale:g}x the recorded rate): its capacity is at least "
                    "that, no bracket above it")
        return (f"even the lowest rate searched ({search.min_scale:.3g}x the recorded rate) "
                "missed the SLOs")

    def to_dict(self, goodput: float | None = None) -> CapacityRecord:
        flat = self.flat_misses(goodput) if goodput is not None else None
        out: CapacityRecord = {
            "recorded_rps": self.recorded_rps, "low": self.low, "high": self.high,
            "flat_misses_rps": list(flat) if flat else None,
            "status": self.status, "capacity_rps": self.capacity_rps,
            "ci_low_rps": self.ci_low_rps, "ci_high_rps": self.ci_high_rps,
            "high_from_warmup": self.high_from_warmup,
            "levels": [lv.to_dict() for lv in self.levels]}
        if self.recorded_sps is not None:
            out["recorded_sps"] = self.recorded_sps
            out["capacity_sps"] = self.capacity_sps
            out["ci_high_sps"] = self.ci_high_sps
        return out


def flat_note(flat: Sequence[float]) -> str:
    """What a ``flat_misses`` range means, for the capacity line and the report."""
    return (f"from {flat[0]:,.3g} to {flat[1]:,.3g} req/s every level missed the SLOs for "
            "about the share the goodput bar allows: the misses barely grow with the load "
            "there, so the capacity can land anywhere in that range from one server start to "
            "the next; an SLO the traffic meets with more room, or a lower "
            "--capacity-goodput, makes it sharper")


def _open(res: CapacityResult, s: CapacitySearch) -> bool:
    """Whether the search still steps rather than bisects: no pass yet, no fail yet, or
    only the warm-up's top above a pass while that bracket is wider than the tolerance."""
    if res.low is None or res.high is None:
        return True
    return res.high_from_warmup and res.high / res.low - 1.0 > s.tolerance


class _OutOfTime(Exception):
    """The time cap left no room for the next level (internal to search_capacity)."""


class _Pruned(Exception):
    """The bracket's top fell below ``prune_below`` (internal to search_capacity)."""


class _Screened(Exception):
    """The coarse bracket was no leader (internal to search_capacity)."""


def search_capacity(probe: Callable[[float], Level], *, recorded_rps: float,
                    search: CapacitySearch | None = None,
                    on_level: Callable[[Level, CapacityResult], None] | None = None,
                    room: Callable[[float], bool] | None = None,
                    failed_at: float | None = None,
                    recorded_sps: float | None = None,
                    prune_below: float | None = None,
                    screen: Callable[[CapacityResult], bool] | None = None) -> CapacityResult:
    """Bracket the capacity: ``probe(scale)`` runs one load level and says pass or fail.

    ``on_level(level, result_so_far)`` hears of each level as it ends (progress).
    ``room(scale)``: whether a level at ``scale`` still fits the time cap; asked before
    every level but the first, the search ends with status ``time`` when it says no (the
    bracket is then as narrow as the levels run made it).
    ``failed_at``: a scale the server was already seen not to sustain (the warm-up fell
    behind its arrivals there): the bracket's top until a level fails below it.
    ``recorded_sps``: the recorded session rate a session search scales with the request
    rate (the result then speaks of sessions/s).
    ``prune_below``: the incumbent's capacity (its low end) as a scale; the search stops
    with status ``pruned`` once a level fails below it (this config's capacity is then
    below the incumbent's: it cannot win).
    ``screen(result_so_far)``: asked after each level; True stops the search with status
    ``screened`` (its coarse bracket was no leader: screen, then refine)."""
    s = search or CapacitySearch()
    if not (recorded_rps > 0 and math.isfinite(recorded_rps)):
        raise ConfigError(f"recorded rate is {recorded_rps}; capacity needs a rate > 0")
    res = CapacityResult(recorded_rps=recorded_rps, recorded_sps=recorded_sps)
    if failed_at is not None:
        if not (failed_at > 0 and math.isfinite(failed_at)):
            raise ConfigError(f"failed_at is {failed_at}; a scale > 0 the server did not "
                              "sustain")
        res.high, res.high_from_warmup = failed_at, True
    def stop_if_pruned(lv: Level, r: CapacityResult) -> None:
        if on_level is not None:
            on_level(lv, r)
        if prune_below is not None and r.high is not None and r.high < prune_below:
            raise _Pruned
        if screen is not None and screen(r):
            raise _Screened

    try:
        return _bracket(probe, s, res, stop_if_pruned, room)
    except _OutOfTime:
        res.status = "time"
    except _Pruned:
        res.status = "pruned"
    except _Screened:
        res.status = "screened"
    return res


def _bracket(probe: Callable[[float], Level], s: CapacitySearch, res: CapacityResult,
             on_level: Callable[[Level, CapacityResult], None] | None,
             room: Callable[[float], bool] | None) -> CapacityResult:
    def run(scale: float) -> bool:
        if res.levels and room is not None and not room(scale):
            raise _OutOfTime
        lv = probe(scale)
        res.levels.append(lv)
        if lv.passed:
            res.low = scale if res.low is None else max(res.low, scale)
        elif res.high is None or scale < res.high:
            res.high, res.high_from_warmup = scale, False
        if on_level is not None:
            on_level(lv, res)
        return lv.passed

    scale, step = s.start, s.step
    passed = run(scale)
    # step (up after a pass, down after a fail) until a pass and a fail bracket the capacity
    while len(res.levels) < s.max_levels and _open(res, s):
        if passed:
            if scale >= s.max_scale:
                res.status = "capped"
                return res
            scale = min(scale * step, s.max_scale)
            if res.high is not None and res.low is not None:  # the warm-up's top
                scale = min(scale, math.sqrt(res.low * res.high))
        else:
            if scale <= s.min_scale:
                res.status = "none"
                return res
            scale = max(scale / step, s.min_scale)
        step = min(2.0, step * step)
        passed = run(scale)
    # bisect (geometric) inside the bracket
    while res.low is not None and res.high is not None:
        if res.high / res.low - 1.0 <= s.tolerance:
            res.status = "found"
            return res
        if len(res.levels) >= s.max_levels:
            break
        run(math.sqrt(res.low * res.high))
    if res.low is None:
        res.status = "none" if scale <= s.min_scale else "levels"
    elif res.high is None:
        res.status = "capped" if scale >= s.max_scale else "levels"
    return res
