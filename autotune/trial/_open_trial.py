"""The open-loop trial modes on a running server: the open loop (warm-up to the steady
state, measured segments at the recorded arrival times) and the capacity search (the load
levels of ``--objective capacity``). How an open-loop run is cut into segments is
:mod:`autotune.trial._open_segments`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from autotune.engine import VllmServer
from autotune.trial._closed import _abort, _aborted, _count_prompt_tokens
from autotune.trial._replay import ClientKw, PhaseFn, _LoopMode, _Plan, _schedule
from autotune.trial._spec import TrialOutcome, TrialSpec

if TYPE_CHECKING:
    from autotune.load import Abort, RequestRecord
    from autotune.measure import LogWatch, Measurement, SegmentRule
    from autotune.traffic import Schedule
    from autotune.trial._capacity import CapacityRecord, CapacityResult, Level
    from autotune.trial._levels import LevelPlan
    from autotune.trial._open_segments import OpenRun
    from autotune.trial._sessions import SessionLevels

logger = logging.getLogger(__name__)


class OpenLoopTrial(_LoopMode):
    """The open-loop trial mode (:class:`~autotune.trial._modes.TrialMode`): the shape's
    requests at their recorded arrival times, whatever the server does."""

    name = "open"

    def measure(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                outcome: TrialOutcome, phase: PhaseFn, client: ClientKw) -> list[Measurement]:
        return _measure_open(spec, plan, server, outcome, phase, client)


class CapacityTrial:
    """The capacity trial mode (:class:`~autotune.trial._modes.TrialMode`,
    ``--objective capacity``): load levels at scaled recorded arrivals, bracketing the
    highest rate that meets the SLOs. With no level passing it records the outcome itself
    (measured, ok, no capacity) and returns no measurement."""

    name = "capacity"
    counts_prompt_tokens = False  # load levels do not count prompt tokens

    def measure(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                outcome: TrialOutcome, phase: PhaseFn, client: ClientKw) -> list[Measurement]:
        return _measure_capacity(spec, plan, server, outcome, phase, client)

    def metrics(self, spec: TrialSpec, outcome: TrialOutcome) -> dict[str, float]:
        if outcome.capacity is None:
            return {}
        return _capacity_metrics(outcome.capacity, outcome.gpus, spec.server_gpus)


def _warm_up_open(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
                  phase: PhaseFn, client_kw: ClientKw) -> None:
    """The open-loop warm-up: a fixed closed-loop replay of the shape's own requests."""
    from autotune.load import replay

    schedule = plan.schedule
    n_warm = spec.measure.warmup_requests
    if n_warm is None:
        conc = schedule.concurrency or 8
        n_warm = min(2 * conc, max(1, len(schedule.requests) // 4))
    t_warm = time.monotonic()
    if n_warm > 0:
        phase("warming_up", f"{n_warm} requests")
        warm = _schedule(spec, plan.max_len, seed=spec.seed + 10_000, mode="closed",
                         concurrency=schedule.concurrency or 8, num_requests=n_warm)
        replay(warm, **client_kw)
        server.check_alive()
    outcome.warmup_s = time.monotonic() - t_warm
    outcome.warmup = {"seconds": round(outcome.warmup_s, 2), "segments": 1 if n_warm else 0,
                      "converged": False, "jit_in_last_segment": False}


# seconds of arrivals in one segment of a capacity trial's warm-up (at most half a level)
WARM_SEGMENT_S = 10.0


def _warm_up_capacity(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
                      phase: PhaseFn, client_kw: ClientKw,
                      recorded: float, level_plan: LevelPlan) -> LogWatch:
    """A capacity trial's warm-up, on the traffic its levels send: the shape's own open-loop
    arrivals at the first level's rate (other words than any level's: ``token_seed`` 0),
    cut by wall time into segments of ~10 s (at most half a level), until the server holds
    the shape's steady state (two request durations, no kernel JIT compilation in the last
    segment: autotune.trial._open_segments), or at ``--warmup-max-s``. Then the sends stop and what
    is in flight is cancelled (no tail to wait out), and the server drains. A fixed
    handful of requests at a low concurrency left the large batches to the first level,
    which on the H200 paid for the compiles (experiments/h200-shapes). Returns the log
    watch the levels go on reading (each level's ``jit_compiled``). An explicit
    ``--warmup-requests N`` keeps the fixed warm-up instead (N requests, closed loop; 0:
    none)."""
    from autotune.load import replay
    from autotune.measure import LogWatch
    from autotune.trial._levels import drain

    rule = spec.rule
    watch = LogWatch(server.log_path)
    if spec.measure.warmup_requests is not None:  # asked for: the fixed warm-up (0: none)
        _warm_up_open(spec, plan, server, outcome, phase, client_kw)
        return watch
    rate = spec.capacity_search().start * recorded
    phase("warming_up", f"the shape's arrivals at {rate:.3g} req/s until steady state")
    seg_s = min(WARM_SEGMENT_S, level_plan.level_s / 2)
    # arrivals for the whole cap and one segment more: the cap, not the schedule, ends it
    n = int(min(50_000, max(16, math.ceil(rate * (rule.warmup_max_s + seg_s)))))
    sched = _schedule(spec, plan.max_len, seed=spec.seed + 10_000, mode="open",
                      num_requests=n, rate_rps=rate, time_scale=1.0, token_seed=0,
                      busiest=True)
    if sched.concurrency is not None:  # no client-side cap, as the levels
        sched = replace(sched, concurrency=None)
    t0 = time.monotonic()
    ctl = _open_run(spec, sched, rule, seg_s, watch, phase, measure=False, rate=rate)
    replay(sched, **client_kw, abort=_both(ctl, _abort(spec)))  # a dead server ends it
    server.check_alive()
    drain(client_kw["base_url"], level_plan.drain_timeout_s)
    outcome.warmup_s = time.monotonic() - t0
    outcome.warmup = {**ctl.warmup_record(), "jit_events": watch.events}
    return watch


def _open_run(spec: TrialSpec, sched: Schedule, rule: SegmentRule, seg_s: float,
              watch: LogWatch, phase: PhaseFn, *, measure: bool, rate: float) -> OpenRun:
    """The segment hook of an open-loop run at ``rate`` req/s (autotune.trial._open_segments)."""
    from autotune.trial._open_segments import OpenRun

    return OpenRun(send_at=[float(r.send_at_s or 0.0) for r in sched.requests],
                   output=[r.max_tokens for r in sched.requests], rate_rps=rate, rule=rule,
                   segment_s=seg_s, measure=measure, jit=watch.jit_since_last,
                   number=spec.number, on_segment=phase, slo=spec.slo)


def _measure_capacity(spec: TrialSpec, plan: _Plan, server: VllmServer,
                      outcome: TrialOutcome, phase: PhaseFn,
                      client_kw: ClientKw, sessions: SessionLevels | None = None
                      ) -> list[Measurement]:
    """--objective capacity: warm up, then the bracketing search over the arrival-rate
    scale on this server (autotune.levels). The measurement is the level the capacity
    rests on; the levels and the bracket go to ``outcome.capacity``. ``sessions``: each
    level replays sessions turn by turn at the scaled session rate (the warm-up stays the
    shape's independent arrivals: it brings the server to its batches, not its cache)."""
    from autotune.trial._levels import (
        LevelPlan,
        find_capacity,
        fit_level,
        recorded_rate,
        start_after_warmup,
        warmup_bound,
    )

    recorded = recorded_rate(spec.shape)
    level_plan = spec.capacity_plan or LevelPlan(seed=spec.seed)
    watch = _warm_up_capacity(spec, plan, server, outcome, phase, client_kw, recorded,
                              level_plan)
    asked_s = level_plan.level_s
    warm = outcome.warmup
    # a request's duration measured behind a queue is the queue's: no stretch from it
    level_plan, stretched = fit_level(level_plan, None if warm is None or warm.get("overloaded")
                                      else warm.get("request_s"))
    asked = spec.capacity_search()
    search, lower = start_after_warmup(asked, warm)
    failed_at = warmup_bound(asked, warm, spec.slo)
    sps = sessions.recorded_sps if sessions is not None else None
    rate = _rate_text(recorded, sps)
    if failed_at is not None:
        top = (f"the bracket's top is {rate(failed_at)}, where the server "
               "fell behind")
        lower = f"{lower}; {top}" if lower else top
    for line in (stretched, lower):
        if line:
            logger.info("trial %d: %s", spec.number, line)
            phase("capacity", line)

    def build(**kw: Any) -> Schedule:
        return _schedule(spec, plan.max_len, **kw)

    t_run = time.monotonic()
    phase("capacity", f"level 1 at {search.start:.3g}x {rate(1.0)}")
    res, m = find_capacity(recorded_rps=recorded, build=build, client_kw=client_kw,
                           slo=spec.slo, search=search, plan=level_plan,
                           check=server.check_serving,
                           on_level=_on_level(spec.number, phase, rate),
                           jit=watch.jit_since_last, failed_at=failed_at,
                           level_at=sessions.level_at(level_plan) if sessions else None,
                           recorded_sps=sps,
                           prune_below=(spec.incumbent_low / recorded
                                        if spec.incumbent_low else None),
                           screen=_screen_test(spec, outcome, recorded, t_run))
    outcome.measure_s = time.monotonic() - t_run
    if outcome.warmup is not None:  # levels during which a kernel was still compiled
        outcome.warmup["jit_segments_measuring"] = sum(lv.jit_compiled for lv in res.levels)
    cap = res.to_dict(asked.goodput)
    outcome.capacity = cap = {**cap, "level_s": level_plan.level_s, "level_s_asked": asked_s,
                              "level_note": stretched, "start": search.start,
                              "start_note": lower}
    outcome.stop = f"capacity_{res.status}"
    outcome.message = res.summary(search, level_plan.max_s)
    if res.status == "pruned" and spec.incumbent_low and res.high is not None:
        outcome.pruned = True
        outcome.message = (
            f"pruned after {len(res.levels)} level(s): a level failed at {rate(res.high)}, "
            f"below the incumbent's capacity of {spec.incumbent_low:.3g} req/s, so this "
            "config cannot win (--pruner none measures it to the end)")
    if res.status == "screened":
        _mark_screened(outcome, len(res.levels))
    logger.info("trial %d: %s", spec.number, outcome.message)
    if m is None:  # no level met the SLOs: measured, but no capacity (infeasible)
        outcome.ok = True
        outcome.metrics = {**_capacity_metrics(cap, outcome.gpus, spec.server_gpus),
                           "measure_s": round(outcome.measure_s, 3)}
        return []
    return [m]


def _rate_text(recorded: float, sps: float | None) -> Callable[[float], str]:
    """A scale as the rate it offers: req/s, or sessions/s first for a session search."""
    def rate(scale: float) -> str:
        if sps is None:
            return f"{scale * recorded:.3g} req/s"
        return f"{scale * sps:.3g} sessions/s ({scale * recorded:.3g} req/s)"

    return rate


def _on_level(number: int, phase: PhaseFn, rate: Callable[[float], str]
              ) -> Callable[[Level, CapacityResult], None]:
    """The capacity search's progress: each level and the bracket so far, as phases."""
    def on_level(lv: Level, res: CapacityResult) -> None:
        logger.info("trial %d level %d: %.3gx = %s %s", number, len(res.levels), lv.scale,
                    rate(lv.scale), lv.outcome())
        if res.low is not None and res.high is not None:
            bracket = (f"bracket [{rate(res.low)}, {rate(res.high)}], "
                       f"{res.high / res.low:.3g}x wide")
        elif res.low is not None:
            bracket = f"at least {rate(res.low)}, no level failed yet"
        else:
            bracket = f"below {rate(res.high or 0)}, no level passed yet"
        sent = (f" (busiest stretch {lv.busiest_rps:.3g} req/s)"
                if lv.busiest_rps is not None else "")
        phase("capacity", f"level {len(res.levels)}: {rate(lv.scale)} mean{sent} "
              f"{lv.outcome()}; {bracket}")

    return on_level


def _mark_screened(outcome: TrialOutcome, levels: int) -> None:
    """The capacity search stopped at its coarse bracket: the outcome says so."""
    c = outcome.coarse
    if c is None:
        return
    outcome.screened = True
    outcome.message = (
        f"screened after {levels} level(s): its capacity bracket [{c['ci_low']:.3g}, "
        f"{c['ci_high']:.3g}] req/s was not among the leaders (bar {c['bar']:.3g} req/s); "
        "--no-screen measures every trial to full resolution")


def _screen_test(spec: TrialSpec, outcome: TrialOutcome, recorded: float,
                 t_run: float) -> Callable[[CapacityResult], bool] | None:
    """Screen, then refine: the capacity search's test after each level. The first
    bracket closed within the coarse width is the trial's coarse reading (kept on the
    outcome); True (stop, screened) when it is no leader."""
    from autotune.measure import bracket_closed

    screen = spec.screen
    if screen is None:
        return None

    def test(res: CapacityResult) -> bool:
        if outcome.coarse is not None or not bracket_closed(res.low, res.high, screen.bracket):
            return False
        assert res.low is not None and res.high is not None  # bracket_closed says so
        low, high = res.low * recorded, res.high * recorded
        outcome.coarse = screen.record(low, low, high, time.monotonic() - t_run)
        return not outcome.coarse["promoted"]

    return test


def _capacity_metrics(cap: CapacityRecord, gpus: tuple[int, ...] | None,
                      server_gpus: int = 1) -> dict[str, float]:
    """capacity_rps (the objective), its interval, output tokens/s at capacity, the
    capacity in sessions/s (``capacity_sps``) for a session search, and the
    servers and GPUs the recorded traffic needs (recorded rate / capacity; GPUs: the
    server's, or the ones it was given when more) from ``CapacityResult.to_dict()``."""
    recorded = float(cap["recorded_rps"])
    out: dict[str, float] = {"capacity_recorded_rps": recorded,
                             "capacity_levels": float(len(cap["levels"]))}
    if (high := cap.get("ci_high_rps")) is not None:
        out["capacity_rps_ci_high"] = float(high)
    if (sps := cap.get("recorded_sps")) is not None:  # a session search: sessions/s
        out["capacity_recorded_sps"] = float(sps)
        if (high_s := cap.get("ci_high_sps")) is not None:
            out["capacity_sps_ci_high"] = float(high_s)
        if (cap_s := cap.get("capacity_sps")) is not None:
            out["capacity_sps"] = float(cap_s)
    rps, low = cap.get("capacity_rps"), cap["low"]
    if rps is None or rps <= 0 or low is None:  # a capacity > 0 has a low end
        return out
    servers = recorded / rps
    out.update({"capacity_rps": float(rps), "capacity_rps_ci_low": float(rps),
                "capacity_scale": float(low), "servers_needed": servers,
                "gpus_needed": servers * max(1, server_gpus, len(gpus or ()))})
    at = [lv for lv in cap["levels"] if lv["passed"] and lv["scale"] == low]
    if at:
        out["capacity_goodput_fraction"] = float(at[-1]["goodput_fraction"])
        if (tok := at[-1]["output_tokens_per_s"]) is not None:
            out["output_tokens_per_s_at_capacity"] = float(tok)
        if (busiest := at[-1].get("busiest_rps")) is not None:  # the rate it sent
            out["capacity_busiest_rps"] = float(busiest)
    return out


def _measure_open(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
                  phase: PhaseFn, client_kw: ClientKw) -> list[Measurement]:
    """Open loop: one continuous run of the shape's arrivals per repeat, cut into segments
    of ~10 s: warm-up until the server holds the shape's steady state, then measurement
    until the interval is within the precision (or ``--measure-max-s``); sized by those
    caps, not by a number of requests (``--num-requests`` still bounds it when given).
    An explicit ``--warmup-requests N`` runs the fixed closed-loop warm-up first."""
    from autotune.load import replay
    from autotune.measure import LogWatch, measure, snapshot_metrics
    from autotune.trial._open_segments import cut_bounds, idle_note

    rule = spec.rule
    fixed = spec.measure.warmup_requests is not None
    if fixed:  # asked for: the fixed warm-up (0: none); the run then measures at once
        _warm_up_open(spec, plan, server, outcome, phase, client_kw)
        rule = replace(rule, warmup_max_s=0.0)
    rate = plan.schedule_rate
    n = spec.measure.num_requests or int(min(50_000, max(16, math.ceil(
        rate * (rule.warmup_max_s + rule.measure_max_s + 3 * _open_segment_s(rule))))))
    sched = _schedule(spec, plan.max_len, seed=spec.seed, concurrency=spec.measure.concurrency,
                      num_requests=n)
    results: list[Measurement] = []
    repeats = max(1, spec.measure.repeats)
    for r in range(repeats):
        phase("warming_up" if r == 0 and not fixed else "measuring",
              f"replay {r + 1}/{repeats}: the shape's arrivals at {rate:.3g} req/s")
        watch = LogWatch(server.log_path)
        ctl = _open_run(spec, sched, rule if r == 0 else replace(rule, warmup_max_s=0.0),
                        _open_segment_s(rule), watch, phase, measure=True, rate=rate)
        t_run = time.monotonic()
        before = snapshot_metrics(server.base_url)
        run = replay(sched, **client_kw, abort=_both(ctl, _abort(spec)),
                     metrics_interval_s=2.0)
        server.check_alive()
        if run.aborted not in (None, "precise", "cap") and _aborted(spec, run, outcome, server):
            return results
        _count_prompt_tokens(outcome, run, before, snapshot_metrics(server.base_url))
        if r == 0 and not fixed:
            warm = outcome.warmup = {**ctl.warmup_record(), "jit_events": watch.events,
                                     "jit_segments_measuring": ctl.jit_measuring}
            outcome.warmup_s = float(warm["seconds"])
        bounds = cut_bounds(ctl.bounds, ctl.cut)
        m = measure(run, slo=spec.slo, segments=bounds if len(bounds) >= 2 else None)
        results.append(m)
        wall = time.monotonic() - t_run
        outcome.measure_s += max(0.0, wall - (ctl.warm_end or 0.0))
        outcome.segments += list(m.segment_tokens_per_s)
        outcome.stop = ctl.stop if ctl.stop in ("precise", "cap") else "schedule_end"
        logger.info("trial %d repeat %d: %s out tok/s (%s, %d segments)", spec.number, r,
                    m.output_tokens_per_s, outcome.stop, len(m.segment_tokens_per_s))
    notes = [n for n in (idle_note(results[0].server, spec.flags), results[0].interval_note)
             if n] if results else []
    if notes:  # what the reading means: the trial says so (its message)
        outcome.message = "; ".join(notes)
        logger.info("trial %d: %s", spec.number, outcome.message)
    return results


#: seconds of run time in one segment of an open-loop trial
OPEN_SEGMENT_S = 10.0


def _open_segment_s(rule: SegmentRule) -> float:
    """An open loop's segment: OPEN_SEGMENT_S, shorter when the measurement cap would not
    hold ``min_segments`` of them (at least 1 s)."""
    return max(1.0, min(OPEN_SEGMENT_S, rule.measure_max_s / max(1, rule.min_segments)))


def _both(first: OpenRun, second: Abort | None) -> Abort:
    """An open loop's hook and a stop-on-failures hook as one: each sees every record; the
    first line wins. The open loop's time caps (its ``tick``) stay on the result."""
    if second is None:
        return first

    def check(rec: RequestRecord, done: int, failed: int) -> str | None:
        a = first(rec, done, failed)
        b = second(rec, done, failed)
        return a or b

    check.tick = first.tick  # type: ignore[attr-defined]
    return check
