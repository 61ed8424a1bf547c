"""Load levels on one running server: the shape's open-loop arrivals at a scale of the
recorded rate, judged against the SLOs (the probes of :mod:`autotune.capacity`).

A level replays ``level_s`` seconds of arrivals at ``scale`` x the recorded rate (at
least ``min_requests``, at most ``max_requests`` requests), then waits until the server
has nothing running or waiting, so the next level starts from an idle server: no restart
per level. A level stops as soon as it can no longer pass (more requests missed the SLOs
or failed than the goodput bar allows), so an overloaded level costs seconds, not the
whole replay of a backlog.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from autotune.errors import ConfigError, LoadgenError
from autotune.load import Abort, RequestRecord, RunResult, SessionSchedule, replay
from autotune.measure import (
    Measurement,
    Slo,
    measure,
    meets_slo,
    server_figures,
    slo_misses,
    snapshot_metrics,
)
from autotune.trial._capacity import CapacityResult, CapacitySearch, Level, search_capacity
from autotune.trial._replay import ClientKw

if TYPE_CHECKING:
    from autotune.load import ServerSnapshot
    from autotune.measure import Percentiles
    from autotune.traffic import Schedule, TrafficShape
    from autotune.trial._spec import WarmupRecord

__all__ = [
    "LEVEL_MIN_REQUESTS",
    "LEVEL_S",
    "LEVEL_SPAN",
    "CapacityFields",
    "LevelPlan",
    "capacity_spec",
    "drain",
    "find_capacity",
    "fit_level",
    "level_abort",
    "level_allows",
    "prime_contexts",
    "recorded_rate",
    "remeasure_lowest",
    "request_seconds",
    "run_level",
    "start_after_warmup",
    "warmup_bound",
    "worst_misses",
]

logger = logging.getLogger(__name__)

#: builds the schedule of one level: keyword arguments of autotune.traffic.build_schedule
#: (seed, mode, num_requests, rate_rps, time_scale)
Build = Callable[..., "Schedule"]
#: the schedule of one level at a request rate (req/s) and a level's token seed, where it is
#: not drawn by ``Build`` (a session capacity search: sessions, turn by turn)
LevelAt = Callable[[float, "int | None"], "Schedule | SessionSchedule"]


def recorded_rate(shape: TrafficShape | None) -> float:
    """The arrival rate capacity scales: the shape's recorded rate (else its open-loop
    replay rate). A shape with neither (or none) has no arrivals to scale: a one-line
    error."""
    rate = float(shape.rate_rps or 0.0) if shape is not None else 0.0
    load = shape.load if shape is not None else None
    if rate <= 0 and load is not None and load.mode == "open" and load.rate_rps:
        rate = float(load.rate_rps)
    if not (rate > 0 and math.isfinite(rate)):
        raise ConfigError(
            f"capacity (--objective capacity, bench --capacity) needs a shape with arrivals: "
            f"shape {shape.name if shape is not None else '?'!r} has no recorded arrival "
            "rate (a closed-loop or synthetic shape); fit the shape from a trace with "
            "arrival timestamps ('autotune shape fit' of that trace), or use "
            "--objective throughput")
    return rate


#: seconds of arrivals per load level, at least (a level lasts LEVEL_SPAN requests)
LEVEL_S = 10.0
#: requests per load level, at least: at the 99 % goodput bar a level of 40 passes only with
#: no request missing an SLO, i.e. a miss rate under ~7 % at 95 % confidence (the rule of
#: three); 10 passed with a miss rate of up to 26 %, and pass or fail was a coin toss
LEVEL_MIN_REQUESTS = 40


@dataclass(frozen=True)
class LevelPlan:
    """How long each load level runs."""

    level_s: float = LEVEL_S  # seconds of arrivals per level, at least
    min_requests: int = LEVEL_MIN_REQUESTS
    max_requests: int = 2000
    drain_timeout_s: float = 120.0  # wait at most this long for an idle server after a level
    seed: int = 0
    # the levels of one search stop once the next would end after this many seconds (None,
    # the default: no cap; the search runs until its bracket is within the tolerance): the
    # bracket is then as narrow as the levels made it, and the trial says so
    max_s: float | None = None

    def requests(self, rate_rps: float) -> int:
        n = min(self.max_requests, max(self.min_requests, math.ceil(rate_rps * self.level_s)))
        if self.max_s is not None:  # at a low rate, min_requests must not outlast the cap
            n = min(n, max(1, math.ceil(rate_rps * self.max_s / 2)))
        return int(n)

    def seconds(self, rate_rps: float) -> float:
        """How long a level at ``rate_rps`` sends arrivals."""
        return self.requests(rate_rps) / rate_rps if rate_rps > 0 else self.level_s


class CapacityFields(TypedDict, total=False):
    """The ``TrialSpec`` fields of a capacity measurement (:func:`capacity_spec` gives
    both; none: a measurement of another objective)."""

    capacity: CapacitySearch
    capacity_plan: LevelPlan


#: a level's arrivals last at least this many times the shape's typical request: a level
#: starts from an idle server, which fills up for about one request's duration; shorter
#: levels judge mostly requests served before the server was full (a burst, not a rate).
#: On the H200 the mooncake shape's requests took 10-15 s, and its 20-s levels read
#: capacities 12.5-25 req/s for one config from start to start (experiments/h200-shapes).
LEVEL_SPAN = 3.0
#: ... at most this many times the level length asked for (a shape of minute-long requests
#: would otherwise make every level cost many minutes)
LEVEL_STRETCH_MAX = 4.0


def request_seconds(records: Iterable[RequestRecord],
                    output_tokens: Iterable[int | None]) -> float | None:
    """A typical request's duration on this server: the median time to first token plus
    the median output length asked for (``output_tokens``: the schedule's ``max_tokens``)
    at the median time per output token, from finished requests (``records``, e.g. the
    warm-up's). Not their median end-to-end time: a warm-up cut off mid-way finishes the
    short requests first. None when fewer than 5 requests finished with 2+ tokens."""
    import statistics

    ttft, per_token = [], []
    for r in records:
        if (r.ok and r.first_token_s is not None and r.end_s is not None
                and r.output_tokens >= 2):
            ttft.append(r.first_token_s - r.send_s)
            per_token.append((r.end_s - r.first_token_s) / (r.output_tokens - 1))
    outs = [int(n) for n in output_tokens if n]
    if len(ttft) < 5 or not outs:
        return None
    return statistics.median(ttft) + statistics.median(outs) * statistics.median(per_token)


def fit_level(plan: LevelPlan, request_s: float | None) -> tuple[LevelPlan, str]:
    """The level plan for requests of ``request_s`` seconds: ``plan`` when its levels
    already last ``LEVEL_SPAN`` requests, else levels stretched to that (at most
    ``LEVEL_STRETCH_MAX`` x the length asked for); and a line saying so ("" unchanged)."""
    if request_s is None or not math.isfinite(request_s) or request_s <= 0:
        return plan, ""
    want = LEVEL_SPAN * request_s
    if plan.level_s >= want:
        return plan, ""
    cap = LEVEL_STRETCH_MAX * plan.level_s
    level_s = round(min(want, cap), 1)
    if level_s <= plan.level_s:  # a stretch the rounding undoes (3 x 6.68 s = 20.0)
        return plan, ""
    capped = " (the stretch cap)" if want > cap else ""  # not the rounding of want
    return dataclasses.replace(plan, level_s=level_s), (
        f"levels of {level_s:g} s of arrivals{capped}, not {plan.level_s:g}: this shape's "
        f"requests take ~{request_s:.3g} s on this server, and a level must last "
        f"{LEVEL_SPAN:g} of them to judge a sustained rate, not a burst")


def start_after_warmup(search: CapacitySearch, warmup: WarmupRecord | None
                       ) -> tuple[CapacitySearch, str]:
    """The search to run after a warm-up at ``search.start``: when the server fell behind
    those arrivals (``warmup["overloaded"]``: its backlog only grew) it served
    ``served_share`` of what arrived, about its saturation rate, which no rate within the
    SLOs exceeds: start one step of the tolerance below it (at least ``min_scale``) and
    step by the tolerance from there, so that a capacity just under saturation is
    bracketed in two levels; say so ("" when unchanged)."""
    share = warmup.get("served_share") if warmup is not None else None
    if not (warmup and warmup.get("overloaded")) or not isinstance(share, (int, float)):
        return search, ""
    step = 1.0 + max(search.tolerance, 0.1)  # a finer first step would creep
    start = search.start * max(share, 1e-9) / step
    start = max(search.min_scale, float(f"{start:.3g}"))
    if start >= search.start:
        return search, ""
    return dataclasses.replace(search, start=start, step=min(step, 2.0)), (
        f"the server fell behind the arrivals at {search.start:g}x the recorded rate in the "
        f"warm-up (its backlog grew; it served {share:.0%} of what arrived): the levels start "
        f"at {start:.3g}x, a step below that")


def warmup_bound(search: CapacitySearch, warmup: WarmupRecord | None,
                 slo: Slo | None) -> float | None:
    """The scale the capacity search may take as its bracket's top from the start: the
    warm-up's (``search.start``) when the server fell behind those arrivals there
    (``warmup["overloaded"]``: its backlog grew through the last 20 s, latencies not far
    within the SLOs) and no kernel was still compiling in its last segment, under an
    SLO a growing queue breaks (a TTFT or end-to-end limit: the wait counts in both). None
    otherwise: a queue that grows by half the arrivals misses such a limit within any
    level, so a level there would only spend the time cap to fail."""
    if warmup is None or not warmup.get("overloaded") or warmup.get("jit_in_last_segment"):
        return None
    if slo is None or (slo.ttft_s is None and slo.e2e_s is None):
        return None
    return search.start


def capacity_spec(*, goodput: float, max_error_rate: float, start: float, tolerance: float,
                  level_s: float, max_levels: int, seed: int = 0,
                  max_s: float | None = None) -> CapacityFields:
    """The ``TrialSpec`` fields of a capacity measurement (``capacity``, ``capacity_plan``):
    what ``tune --objective capacity`` and ``bench --capacity`` pass to a trial."""
    search = CapacitySearch(goodput=goodput, max_error_rate=max_error_rate, start=start,
                            tolerance=tolerance, min_scale=min(start, 1.0 / 64),
                            max_scale=max(start, 64.0), max_levels=max_levels)
    return CapacityFields(capacity=search,
                          capacity_plan=LevelPlan(level_s=level_s, seed=seed, max_s=max_s))


def level_allows(offered: int, search: CapacitySearch) -> tuple[int, int]:
    """How many of a level's ``offered`` requests may miss the SLOs (failed ones included)
    and how many may fail: more than the bar's share only when that is not credibly above
    it (:func:`~autotune.measure.allowed_misses`), so that a level of 56 at the 99 % bar
    fails on its third miss, not on one slow request."""
    from autotune.measure import allowed_misses

    return (allowed_misses(offered, 1.0 - search.goodput),
            allowed_misses(offered, search.max_error_rate))


#: the misses a level names, worst first
WORST_MISSES = 5


def worst_misses(records: Iterable[RequestRecord], slo: Slo | None) -> list[str]:
    """The requests that missed an SLO threshold by most (relative to the limit), worst
    first, at most ``WORST_MISSES``: which request (its session and turn), which
    threshold, its figure and the limit; failed requests after them."""
    from autotune.measure import slo_excess

    over: list[tuple[float, str]] = []
    failed: list[str] = []
    for r in records:
        who = f"request {r.index}" + (f" (session {r.session}, turn {(r.turn or 0) + 1})"
                                      if r.session is not None else "")
        if not r.ok:
            failed.append(f"{who}: failed ({r.error or 'error'})")
        elif (ex := slo_excess(r, slo)) is not None:
            name, v, lim = ex
            over.append((v / lim, f"{who}: {name} {v:.3g} s > {lim:.3g} s"))
    over.sort(key=lambda x: -x[0])
    return ([w for _, w in over] + failed)[:WORST_MISSES]


def level_abort(offered: int, slo: Slo | None, search: CapacitySearch) -> Abort:
    """Stop a level once it cannot pass any more: more misses (failed requests included)
    than :func:`level_allows` for ``1 - goodput`` of the offered requests, or more
    failures than it allows for the error bar."""
    may_miss, may_fail = level_allows(offered, search)
    missed = [0]

    def check(rec: RequestRecord, done: int, failed: int) -> str | None:
        if not meets_slo(rec, slo):
            missed[0] += 1
        if missed[0] > may_miss:
            return (f"{missed[0]} of {offered} requests missed the SLOs or failed "
                    f"(at most {may_miss} may)")
        if failed > may_fail:
            return f"{failed} of {offered} requests failed (at most {may_fail} may)"
        return None

    return check


def drain(base_url: str, timeout_s: float) -> None:
    """Wait until the server reports nothing running or waiting (best effort): after each
    level, and between two trials that share a server (autotune.trial)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            g = snapshot_metrics(base_url).gauges
        except LoadgenError:
            return
        busy = g.get("vllm:num_requests_running", 0.0) + g.get("vllm:num_requests_waiting", 0.0)
        if busy <= 0:
            return
        time.sleep(0.25)
    logger.warning("the server still had requests after %.0f s; the next load starts anyway",
                   timeout_s)


def with_server(run: RunResult, slo: Slo | None, before: ServerSnapshot | None,
                after: ServerSnapshot | None) -> Measurement:
    """The run's measurement with the server's figures over the whole run: its counters
    from ``before`` to ``after`` and its gauges (KV cache usage) over the run's samples,
    not the idle snapshot after it (a session replay or level; None snapshots: the run's
    own)."""
    m = measure(run, slo=slo, server_before=before, server_after=after)
    if before is None or after is None:
        return m
    return m.model_copy(update={"server": server_figures(before, after, run.snapshots)})


def _snapshot(base_url: str) -> ServerSnapshot | None:
    """The server's counters now (None when its /metrics does not answer)."""
    try:
        return snapshot_metrics(base_url)
    except LoadgenError:
        return None


def _pct(p: Percentiles | None) -> float | None:
    return p.p99 if p is not None else None


def level_schedule(build: Build, plan: LevelPlan, rate: float,
                   token_seed: int | None) -> Schedule:
    """A level's arrivals at a mean of ``rate`` req/s, from the busiest stretch of the
    recording: ``plan.requests(rate)`` of them, more when that stretch runs faster than the
    mean so that they still last ``plan.level_s`` seconds (a burst at 4x the mean rate
    sends 40 requests in a quarter of the time; without a time cap)."""
    n = plan.requests(rate)
    kw = {"seed": plan.seed, "mode": "open", "rate_rps": rate, "time_scale": 1.0,
          "token_seed": token_seed, "busiest": True}
    schedule = build(num_requests=n, **kw)
    span = max((r.send_at_s or 0.0) for r in schedule.requests)
    if plan.max_s is None and 0 < span < plan.level_s and n < plan.max_requests:
        more = min(plan.max_requests, math.ceil(n * plan.level_s / span))
        schedule = build(num_requests=more, **kw)
    return schedule


def sent_rate(schedule: Schedule) -> float | None:
    """The rate a level's schedule sends: its requests over their send span (the busiest
    stretch of the recording it replays); None for fewer than two sends."""
    times = [r.send_at_s for r in schedule.requests if r.send_at_s is not None]
    span = max(times) - min(times) if len(times) >= 2 else 0.0
    return (len(times) - 1) / span if span > 0 else None


def run_level(scale: float, *, recorded_rps: float, build: Build, client_kw: ClientKw,
              slo: Slo | None, search: CapacitySearch, plan: LevelPlan,
              token_seed: int | None = None, level_at: LevelAt | None = None,
              ) -> tuple[Level, Measurement | None]:
    """One load level on the running server at ``client_kw["base_url"]``: pass or fail.
    Every level draws its arrivals and lengths from ``plan.seed``; ``token_seed`` (the
    level's number) gives its prompts their own words, so that no level is served from a
    prefix cache filled by an earlier one (the shape's sharing within the level stays).
    ``level_at``: the level's schedule where not ``build``'s (sessions turn by turn: every
    turn of the level's sessions is offered, and the measurement carries the server's
    prefix-cache figures over the level)."""
    rate = scale * recorded_rps
    schedule = (level_at(rate, token_seed) if level_at is not None
                else level_schedule(build, plan, rate, token_seed))
    if not isinstance(schedule, SessionSchedule) and schedule.concurrency is not None:
        # no cap on requests in flight: a client-side queue would hide the server's queue
        # from the latencies (they count from the send), and so the capacity
        schedule = dataclasses.replace(schedule, concurrency=None)
    offered = len(schedule.requests)
    sessions = isinstance(schedule, SessionSchedule)
    primed_s = prime_contexts(schedule, client_kw, plan.seconds(rate)) if sessions else 0.0
    before = _snapshot(client_kw["base_url"]) if sessions else None
    t0 = time.monotonic()
    run = replay(schedule, **client_kw, abort=level_abort(offered, slo, search),
                 metrics_interval_s=2.0 if sessions else None)
    seconds = time.monotonic() - t0
    after = _snapshot(client_kw["base_url"]) if sessions else None
    met, failed, missed_by = 0, 0, Counter[str]()
    for r in run.records:
        why = slo_misses(r, slo)
        met += not why
        failed += not r.ok
        missed_by.update(why)
    m = (with_server(run, slo, before, after) if any(r.ok for r in run.records) else None)
    good, err = met / offered, failed / offered
    may_miss, may_fail = level_allows(offered, search)
    passed = run.aborted is None and offered - met <= may_miss and failed <= may_fail
    level = Level(
        scale=scale, offered_rps=rate, passed=passed, goodput_fraction=good, error_rate=err,
        offered=offered, output_tokens_per_s=m.output_tokens_per_s if m else None,
        ttft_p99_s=_pct(m.ttft_s) if m else None, tpot_p99_s=_pct(m.tpot_s) if m else None,
        e2e_p99_s=_pct(m.e2e_s) if m else None, seconds=round(seconds, 2),
        stopped_early=run.aborted is not None, note=run.aborted or "",
        finished=len(run.records), missed_by=dict(sorted(missed_by.items())),
        warmup_s=round(primed_s, 2), worst_misses=worst_misses(run.records, slo),
        busiest_rps=None if isinstance(schedule, SessionSchedule) else sent_rate(schedule),
    )  # fmt: skip
    drain(client_kw["base_url"], plan.drain_timeout_s)
    return level, m


def prime_contexts(schedule: Schedule | SessionSchedule, client_kw: ClientKw,
                   bound_s: float) -> float:
    """A session level's bounded warm-up: the conversations its sessions already had
    before the level (:meth:`~autotune.load.SessionSchedule.context_primer`) sent once
    each with a 1-token answer, so that the server's prefix cache holds them as the
    steady state would; for at most ``bound_s`` seconds (a context not sent by then is
    a miss, as if the cache had lost it). Returns the seconds it took."""
    primer = (schedule.context_primer() if isinstance(schedule, SessionSchedule) else None)
    if primer is None:
        return 0.0
    t0 = time.monotonic()
    run = replay(dataclasses.replace(primer, duration_s=bound_s), **client_kw)
    sent = len(run.records)
    if sent < len(primer.sessions):
        logger.info("the level's warm-up sent %d of %d conversations so far in its %.3g s; "
                    "the rest start cold", sent, len(primer.sessions), bound_s)
    drain(client_kw["base_url"], bound_s)
    return time.monotonic() - t0


@dataclass
class _Probe:
    """The probe search_capacity calls, keeping each passing level's measurement."""

    recorded_rps: float
    build: Build
    client_kw: ClientKw
    slo: Slo | None
    search: CapacitySearch
    plan: LevelPlan
    check: Callable[[], None] | None = None  # raises if the server died
    jit: Callable[[], bool] | None = None  # was a kernel JIT-compiled since the last call?
    level_at: LevelAt | None = None  # the levels' schedules where not build's (sessions)
    measured: dict[float, Measurement] = field(default_factory=dict)
    levels_run: int = 0
    longest_s: float = 0.0  # the longest level so far, its tail and drain included

    def _run(self, scale: float) -> tuple[Level, Measurement | None]:
        if self.jit is not None:
            self.jit()  # what came before (the warm-up, a drain) is not this level's
        self.levels_run += 1
        t0 = time.monotonic()
        level, m = run_level(scale, recorded_rps=self.recorded_rps, build=self.build,
                             client_kw=self.client_kw, slo=self.slo, search=self.search,
                             plan=self.plan, token_seed=self.levels_run,
                             level_at=self.level_at)
        if self.check is not None:
            self.check()
        if self.jit is not None and self.jit():
            level = dataclasses.replace(level, jit_compiled=True)
        self.longest_s = max(self.longest_s, time.monotonic() - t0)
        return level, m

    def __call__(self, scale: float) -> Level:
        level, m = self._run(scale)
        if not level.passed and level.jit_compiled:
            # a fail that may be the compile's, not the load's: once more, compiled now
            logger.info("level at %.3gx failed while a kernel was JIT-compiled: run again",
                        scale)
            level, m = self._run(scale)
            level = dataclasses.replace(level, reruns=1)
        if m is not None and level.passed:
            self.measured[scale] = m
        return level


def find_capacity(*, recorded_rps: float, build: Build, client_kw: ClientKw,
                  slo: Slo | None, search: CapacitySearch | None = None,
                  plan: LevelPlan | None = None, check: Callable[[], None] | None = None,
                  on_level: Callable[[Level, CapacityResult], None] | None = None,
                  jit: Callable[[], bool] | None = None,
                  failed_at: float | None = None, level_at: LevelAt | None = None,
                  recorded_sps: float | None = None, prune_below: float | None = None,
                  screen: Callable[[CapacityResult], bool] | None = None,
                  ) -> tuple[CapacityResult, Measurement | None]:
    """The bracketing search on one running server; returns the bracket and the
    measurement of the level the capacity rests on (None when no level passed).
    ``jit``: whether the server logged a kernel JIT compilation since its last call (each
    level's ``jit_compiled``: a warm-up that did not cover the traffic); ``failed_at``:
    the bracket's top known before the search (:func:`warmup_bound`). A session search
    gives ``level_at`` (each level's sessions at a request rate) and ``recorded_sps`` (the
    recorded session rate the scale multiplies too). ``prune_below``: the incumbent's
    capacity as a scale, ``screen`` the coarse bracket's test (:func:`search_capacity`)."""
    search = search or CapacitySearch()
    plan = plan or LevelPlan()
    probe = _Probe(recorded_rps, build, client_kw, slo, search, plan, check, jit, level_at)
    res = search_capacity(probe, recorded_rps=recorded_rps, search=search, on_level=on_level,
                          room=_room(plan, recorded_rps, probe), failed_at=failed_at,
                          recorded_sps=recorded_sps, prune_below=prune_below,
                          screen=screen)
    if res.low is None and res.levels and res.status not in ("pruned", "screened"):
        remeasure_lowest(probe, res, search, on_level)
    return res, (probe.measured.get(res.low) if res.low is not None else None)


def remeasure_lowest(probe: Callable[[float], Level], res: CapacityResult,
                     search: CapacitySearch,
                     on_level: Callable[[Level, CapacityResult], None] | None = None) -> None:
    """No level passed: the lowest one runs once more before the config is called
    infeasible (a noisy neighbour or one slow start must not cost a config its place).
    A pass makes it the bracket's low end; ``res`` is updated in place."""
    scale = min(lv.scale for lv in res.levels)
    logger.info("no load level passed: the lowest (%.3gx) runs once more", scale)
    level = dataclasses.replace(probe(scale), remeasured=True)
    res.levels.append(level)
    if level.passed:
        res.low = scale
        higher = [lv.scale for lv in res.levels if not lv.passed and lv.scale > scale]
        res.high = min(higher) if higher else res.high
        res.status = ("found" if res.high is not None
                      and res.high / scale - 1.0 <= search.tolerance else "levels")
    if on_level is not None:
        on_level(level, res)


def _room(plan: LevelPlan, recorded_rps: float, probe: _Probe
          ) -> Callable[[float], bool] | None:
    """Whether a level at a scale still ends within ``plan.max_s`` of now (None: no cap):
    its arrivals, or as long as the longest level so far took (the requests still running
    when the arrivals stop, and the drain), whichever is longer."""
    if plan.max_s is None:
        return None
    deadline = time.monotonic() + plan.max_s

    def room(scale: float) -> bool:
        need = max(plan.seconds(scale * recorded_rps), probe.longest_s)
        return time.monotonic() + need <= deadline

    return room
