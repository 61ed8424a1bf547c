"""Closed-loop trials: measured segments until warm and precise (or pruned), the abort
rule, and the time metrics of a trial.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from autotune.engine import VllmServer
from autotune.store import FailureReason
from autotune.trial._replay import ClientKw, PhaseFn, _LoopMode, _Plan, _schedule
from autotune.trial._spec import _ARMED, INTERRUPT, TrialOutcome, TrialSpec

if TYPE_CHECKING:
    from autotune.load import Abort, RunResult, ServerSnapshot
    from autotune.measure import Measurement, SegmentWatch
    from autotune.traffic import RequestSpec, Schedule

logger = logging.getLogger(__name__)


class ClosedLoopTrial(_LoopMode):
    """The closed-loop trial mode (:class:`~autotune.trial._modes.TrialMode`): the shape's
    requests on ``concurrency`` streams, each sending its next request when the previous
    one finished."""

    name = "closed"

    def measure(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                outcome: TrialOutcome, phase: PhaseFn, client: ClientKw) -> list[Measurement]:
        return _measure_segments(spec, plan, server, outcome, phase, client)


def _measure_segments(spec: TrialSpec, plan: _Plan, server: VllmServer,
                      outcome: TrialOutcome, phase: PhaseFn,
                      client_kw: ClientKw) -> list[Measurement]:
    """Closed loop: one continuous run per repeat, cut into segments; warm-up until two
    segments agree with no kernel JIT in the last, measurement until the interval is
    within the precision (or a cap, or the pruner); the schedule refilled as needed."""
    runs = _SegmentedRuns(spec, plan, server, outcome, phase, client_kw)
    results: list[Measurement] = []
    _ARMED.set()
    try:
        for r in range(max(1, spec.measure.repeats)):
            if INTERRUPT.is_set():
                outcome.stop = "interrupted"
                break
            m = runs.repeat(r)
            if m is not None:
                results.append(m)
            if runs.done:
                break
    finally:
        _ARMED.clear()
        runs.refill.close()
    return results


class _Refill:
    """A closed loop's refills (``refill`` of :func:`autotune.load.run_schedule`): chunk k
    of the shape's traffic (the schedule's length, seed ``seed + 1000 k``), numbered on
    from the schedule. The next chunk is built in a thread ahead of need: built on the
    event loop it would stall every stream (140 ms for 1,280 requests of 512 tokens)."""

    def __init__(self, spec: TrialSpec, plan: _Plan) -> None:
        self.spec = spec
        self.plan = plan
        self.n_chunk = len(plan.schedule.requests)
        self.prefetch = ThreadPoolExecutor(1, thread_name_prefix="autotune-schedule")
        self.ahead: dict[int, Future[list[RequestSpec]]] = {
            1: self.prefetch.submit(self.numbered, 1)}

    def chunk(self, k: int) -> Schedule:
        """Chunk ``k`` of the traffic, as a schedule of the trial's mode and streams."""
        schedule = self.plan.schedule
        return _schedule(self.spec, self.plan.max_len, seed=self.spec.seed + 1000 * k,
                         mode=schedule.mode, concurrency=schedule.concurrency,
                         num_requests=self.n_chunk)

    def numbered(self, k: int) -> list[RequestSpec]:
        return [replace(r, index=self.n_chunk * k + i)
                for i, r in enumerate(self.chunk(k).requests)]

    def __call__(self, next_index: int) -> list[RequestSpec]:
        ((k, fut),) = self.ahead.items()
        self.ahead.clear()
        self.ahead[k + 1] = self.prefetch.submit(self.numbered, k + 1)
        got = fut.result()
        if got and got[0].index != next_index:  # a schedule shorter than asked
            got = [replace(r, index=next_index + i) for i, r in enumerate(got)]
        return got

    def close(self) -> None:
        self.prefetch.shutdown(wait=False, cancel_futures=True)


class _SegmentedRuns:
    """The repeats of a closed-loop trial: each one continuous run, its sends stopped by
    a :class:`autotune.measure.SegmentWatch` (warm-up on the first repeat only)."""

    def __init__(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                 outcome: TrialOutcome, phase: PhaseFn, client_kw: ClientKw) -> None:
        self.spec, self.plan, self.server, self.outcome = spec, plan, server, outcome
        self.phase, self.client_kw = phase, client_kw
        self.rule = spec.rule
        self.seg_n = spec.measure.segment_requests or max(plan.schedule.concurrency or 1, 16)
        self.refill = _Refill(spec, plan)
        self.done = False  # no repeat after this one (aborted, interrupted, pruned)

    def repeat(self, r: int) -> Measurement | None:
        """Repeat ``r``: its measurement, or None when it measured no whole segment."""
        from autotune.load import replay
        from autotune.measure import LogWatch, SegmentWatch, measure, snapshot_metrics

        spec, server, outcome = self.spec, self.server, self.outcome
        self.phase("warming_up", f"segments of {self.seg_n} requests" if r == 0
                   else f"repeat {r + 1}: one segment")
        ctl = SegmentWatch(self.rule if r == 0 else replace(self.rule, warmup_max_segments=1),
                           self.seg_n, LogWatch(server.log_path), spec.incumbent_low,
                           spec.number, self.phase, screen=spec.screen if r == 0 else None)
        t_run = time.monotonic()
        before = snapshot_metrics(server.base_url)
        run = replay(self.plan.schedule if r == 0 else self.refill.chunk(100 + r),
                     **self.client_kw, control=ctl, refill=self.refill, stagger=spec.stagger,
                     metrics_interval_s=5.0, abort=_abort(spec, min(20, self.seg_n)),
                     interrupt=INTERRUPT)
        server.check_alive()
        if _aborted(spec, run, outcome, server):
            self.done = True
            return None
        self.done = run.interrupted_at_s is not None  # an interrupted repeat is the last
        _count_prompt_tokens(outcome, run, before, snapshot_metrics(server.base_url))
        wall = time.monotonic() - t_run
        warm_s = min(ctl.warm_end if ctl.warm_end is not None else wall, wall)
        if r == 0:
            self._record_warmup(ctl, warm_s)
            outcome.coarse = ctl.coarse
        outcome.measure_s += max(0.0, wall - warm_s)
        bounds = _complete(spec, run, ctl.bounds, r)
        if run.interrupted_at_s is not None and len(bounds) < 2:
            outcome.stop = "interrupted"  # before this repeat measured a whole segment
            return None
        m = measure(run, slo=spec.slo, segments=bounds)
        outcome.segments += list(m.segment_tokens_per_s)
        outcome.stop = ("interrupted" if run.interrupted_at_s is not None
                        else ctl.stop or "schedule_end")
        logger.info("trial %d repeat %d: %s out tok/s (%s, %d segments, warm-up %s)",
                    spec.number, r, m.output_tokens_per_s, outcome.stop,
                    len(m.segment_tokens_per_s), outcome.warmup)
        self._warn_drift(m.segment_tokens_per_s)
        if ctl.stop == "pruned":
            outcome.pruned = self.done = True
        if ctl.stop == "screened":
            outcome.screened = self.done = True
        return m

    def _record_warmup(self, ctl: SegmentWatch, warm_s: float) -> None:
        self.outcome.warmup_s = warm_s
        self.outcome.warmup = {
            "seconds": round(warm_s, 2), "segments": len(ctl.warm_rates),
            "converged": ctl.converged, "jit_in_last_segment": ctl.jit_last,
            "jit_events": ctl.watch.events, "jit_segments_measuring": ctl.jit_measuring,
            "rates": [round(x, 1) for x in ctl.warm_rates]}

    def _warn_drift(self, segments: Sequence[float]) -> None:
        """A measurement whose segments moved between its halves: the warm-up ended early."""
        from autotune.measure import drift

        spec = self.spec
        d = drift(segments)
        if d is None or not d.significant or abs(d.relative) <= self.rule.precision:
            return
        logger.warning(
            "trial %d: its measured segments moved %+.1f %% from the first half to the "
            "second (significant at 95 %%): the server was not steady when its warm-up "
            "ended (%s); a longer --warmup-max-s covers it%s", spec.number,
            100 * d.relative,
            "converged" if self.outcome.warmup and self.outcome.warmup.get("converged")
            else "at its cap",
            "" if spec.measure.output_jitter > 0 else
            " (with --output-jitter 0, streams of equal lengths may also be falling "
            "back into step: docs/measurement.md, section 4)")


def _complete(spec: TrialSpec, run: RunResult, bounds: list[float],
              repeat: int) -> list[float]:
    """The segment bounds whose segments hold every token that arrived in them: all of
    them, unless INTERRUPT cancelled requests in flight (their tokens are not recorded, so
    a segment after the earliest one's send would read low)."""
    if run.interrupted_at_s is None:
        return bounds
    cut = run.complete_before_s if run.complete_before_s is not None else run.interrupted_at_s
    kept = [b for b in bounds if b <= cut]
    whole = max(0, len(kept) - 1)
    logger.warning("trial %d: interrupted in repeat %d at %.1f s; %s", spec.number, repeat + 1,
                   run.interrupted_at_s,
                   f"{whole} of its {len(bounds) - 1} measured segments are whole and kept"
                   if whole else "it had measured no whole segment: nothing of it is kept")
    return kept


def _count_prompt_tokens(outcome: TrialOutcome, run: RunResult, before: ServerSnapshot,
                         after: ServerSnapshot) -> None:
    """Add one run's prompt tokens: asked for (served requests) and counted by the server."""
    from autotune.measure import server_figures

    outcome.prompt_tokens_sent += sum(r.sent_prompt_tokens for r in run.records if r.ok)
    counted = server_figures(before, after).get("prompt_tokens")
    if counted is not None:
        outcome.prompt_tokens_server = (outcome.prompt_tokens_server or 0.0) + counted


def _abort(spec: TrialSpec, min_requests: int = 20) -> Abort | None:
    """The stop-on-failures hook of a measured replay (issue 18), or None. A segmented run
    judges from one segment on (so a segment of nothing but failures, which stops the run,
    is also told as the failures' cause)."""
    from autotune.load import failure_abort

    if spec.abort_failed_fraction is None:
        return None
    return failure_abort(min_requests=min_requests,
                         max_failed_fraction=spec.abort_failed_fraction,
                         shape_path=spec.shape_path, context=spec.max_model_len)


def _aborted(spec: TrialSpec, run: RunResult, outcome: TrialOutcome,
             server: VllmServer) -> bool:
    """A replay stopped because most requests failed: the trial fails with that line,
    unless the engine behind the API server died (``server.check_serving`` raises
    :class:`EngineCrashedError`, reason ``died``, with the log's root cause: a worker's
    exception says more than "most requests failed")."""
    if not run.aborted:
        return False
    server.check_serving()
    outcome.reason = FailureReason.ABORTED
    outcome.message = run.aborted
    logger.warning("trial %d: %s", spec.number, run.aborted)
    return True


def _time_metrics(outcome: TrialOutcome) -> None:
    """The warm-up and measuring figures beside the measurement's own (MLflow, trials.csv)."""
    if outcome.warmup is not None:
        outcome.metrics.update({
            "warmup_s": float(outcome.warmup["seconds"]),
            "warmup_segments": float(outcome.warmup["segments"]),
            "warmup_converged": float(bool(outcome.warmup["converged"])),
            "warmup_jit_in_last_segment": float(bool(outcome.warmup["jit_in_last_segment"])),
        })  # fmt: skip
    outcome.metrics["measure_s"] = round(outcome.measure_s, 3)
