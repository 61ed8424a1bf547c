"""An open-loop trial's run cut by wall time into segments: warm-up until the server holds
the shape's steady state, then (optionally) measurement until the interval is precise or a
time cap ends it (``docs/measurement.md``, section 13).

Recorded arrivals do not wait for the server, so two consecutive segments of a bursty open
loop rarely agree, whatever the server does: the closed loop's warm-up rule (two agreeing
segments) would run to its cap. What an open loop's warm-up waits for is the server's
population: starting empty, the requests in flight reach their steady state (Little's law:
rate x request duration) once every request in flight arrived after the load began, i.e.
after about one request duration. The warm-up ends after :data:`STEADY_SPANS` request
durations (as the finished requests measure them), at least one segment and the server
logging no kernel JIT compilation in the last one, or at ``warmup_max_s`` (then not
converged). The measurement's length comes from the precision it needs, not from a fixed
number of requests: it stops when the interval of the segments' token rate is within
``precision`` (after ``min_segments``), or at ``measure_max_s``.

Private to :mod:`autotune.trial`: :class:`OpenRun` is the abort hook of the replay.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autotune.measure import rate_interval, tell_phase

if TYPE_CHECKING:
    from autotune.load import RequestRecord
    from autotune.measure import SegmentRule, Slo
    from autotune.trial._spec import WarmupRecord

__all__ = ["STEADY_SPANS", "OpenRun", "backlog_grows", "cut_bounds", "idle_note"]

logger = logging.getLogger(__name__)

#: a server falls behind the arrivals when its backlog (requests sent and not finished)
#: grows through the last OVERLOAD_WINDOW_S seconds, in both halves of them (a burst that
#: the server absorbs raises the backlog and lets it fall again; a server that cannot keep
#: up only adds to it), by at least OVERLOAD_GROWTH requests and a quarter of where it
#: stood: the warm-up then ends (overloaded) instead of waiting for a steady state that
#: never comes. Tokens served against the offered rate are no such test: a recorded trace's
#: arrivals come in bursts and lulls, and a lull reads as a server that served too little
OVERLOAD_WINDOW_S = 20.0
OVERLOAD_GROWTH = 4
#: ... judged after this many seconds at the earliest: before, a server that is catching up
#: (kernels still compiling, the first long requests) reads as one that fell behind
OVERLOAD_MIN_S = 20.0
#: a server whose finished requests all met the SLOs with this much room (latency at most
#: this share of each limit), none in flight beyond it, is never called overloaded
COMFORT_SHARE = 0.5
#: an open loop's warm-up lasts this many request durations: after one, every request in
#: flight arrived under load; the second lets the population settle (and queues that the
#: first burst built drain or stay)
STEADY_SPANS = 2.0


@dataclass
class OpenRun:
    """The abort hook of an open-loop replay (``autotune.load.Abort``): segments of
    ``segment_s`` seconds of run time, warm-up, then measurement when ``measure``.

    ``send_at``: each request's send time (the schedule's, by request index); ``output``:
    the output lengths the schedule asks for (a typical request's duration);
    ``rule``: an :class:`autotune.measure.SegmentRule` (caps, precision, minimum segments);
    ``jit``: whether the server logged a kernel JIT compilation since the last call."""

    send_at: Sequence[float]
    output: Sequence[int]
    rate_rps: float
    rule: SegmentRule
    segment_s: float
    measure: bool = False
    jit: Callable[[], bool] | None = None
    on_segment: Callable[[str, str], None] | None = None  # (phase, detail)
    number: int = 0
    slo: Slo | None = None  # a server well within it is never overloaded
    records: list[RequestRecord] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    seg_start: float = 0.0
    seg_tokens: int = 0
    warm_rates: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    bounds: list[float] = field(default_factory=list)  # measured segments' edges (run time)
    warm_end: float | None = None
    converged: bool = False
    jit_last: bool = False
    jit_measuring: int = 0
    request_s: float | None = None
    in_flight: int = 0  # requests in flight at the warm-up's end
    overloaded: bool = False  # the warm-up ended because the server fell behind
    # (run time, requests sent and not finished): once a second and at each segment's end
    backlog: list[tuple[float, int]] = field(default_factory=list)
    warm_edges: list[float] = field(default_factory=list)  # the warm-up segments' ends
    stop: str | None = None  # warm (warm-up only) | precise | cap
    stopped_at: float | None = None
    cut: float | None = None  # the earliest send of a request in flight at the stop

    def __call__(self, rec: RequestRecord, done: int, failed: int) -> str | None:
        self.records.append(rec)
        self.finished.add(rec.index)
        now = rec.end_s if rec.end_s is not None else self.seg_start
        self.seg_tokens += rec.output_tokens if rec.ok else 0
        if now - self.seg_start < self.segment_s:
            return None
        return self._close_segment(now)

    def _close_segment(self, now: float) -> str | None:
        rate = self.seg_tokens / (now - self.seg_start)
        self.seg_start, self.seg_tokens = now, 0
        if self.warm_end is None:
            return self._warm_segment(now, rate)
        return self._measured_segment(now, rate)

    def tick(self, now: float) -> str | None:
        """Between completions (``autotune.loadgen.Abort``): a segment that has run past a
        cap ends now, so the warm-up and measurement caps hold while no request finishes
        (segments otherwise end on a completion)."""
        if self.warm_end is None:
            self.backlog.append((now, self._sent_by(now) - len(self.finished)))
        if self.stop is not None or now - self.seg_start < self.segment_s:
            return None
        if self.warm_end is None:
            past = now >= self.rule.warmup_max_s
        else:
            past = now - self.warm_end >= self.rule.measure_max_s
        return self._close_segment(now) if past else None

    def steady_in_flight(self) -> float | None:
        """Little's law: the requests in flight the shape holds in steady state."""
        return None if self.request_s is None else self.rate_rps * self.request_s

    def _overloaded(self, now: float) -> bool:
        """The server fell behind the arrivals (:data:`OVERLOAD_WINDOW_S`): its backlog grew
        through the last seconds, from OVERLOAD_MIN_S on, and its latencies are not far
        within the SLOs. It will not reach a steady state at this rate (its queue only
        grows), so waiting for one wastes the warm-up's cap."""
        self.overloaded = (now >= OVERLOAD_MIN_S and not self.comfortable(now)
                           and backlog_grows(self.backlog, now))
        return self.overloaded

    def comfortable(self, now: float) -> bool:
        """Every request finished in the last OVERLOAD_WINDOW_S seconds met each SLO limit
        with room (at most COMFORT_SHARE of it), and none in flight has been waiting
        longer than that share of what the SLOs allow it. False without an SLO."""
        from autotune.measure import slo_misses

        slo = self.slo
        if slo is None or all(x is None for x in (slo.ttft_s, slo.tpot_s, slo.e2e_s)):
            return False
        tight = slo.model_copy(update={k: v * COMFORT_SHARE for k, v in slo.model_dump().items()
                                       if v is not None})
        recent = [r for r in self.records
                  if r.end_s is not None and r.end_s >= now - OVERLOAD_WINDOW_S]
        if not recent or any(slo_misses(r, tight) for r in recent):
            return False
        sent = self._sent_by(now)
        for i in range(sent):
            if i in self.finished:
                continue
            allowed = (slo.e2e_s if slo.e2e_s is not None else
                       (slo.ttft_s or 0.0) + (slo.tpot_s or 0.0) * max(0, self.output[i] - 1))
            if allowed > 0 and now - self.send_at[i] > COMFORT_SHARE * allowed:
                return False
        return True

    def served_share(self) -> float | None:
        """The warm-up's served output tokens over the tokens asked for by the requests
        that arrived, after its first segment (which holds the ramp): about 1 for a
        server that keeps up, the share of the arrivals it can serve for one that fell
        behind. The arrivals actually sent are the denominator, not the mean rate: a
        recorded trace's lull is not a server that served too little."""
        if len(self.warm_rates) < 2 or len(self.warm_edges) < 2:
            return None
        t0, t1 = self.warm_edges[0], self.warm_edges[-1]
        served = sum(r * (b - a) for r, a, b in zip(self.warm_rates[1:], self.warm_edges,
                                                   self.warm_edges[1:], strict=False))
        asked = sum(o for s, o in zip(self.send_at, self.output, strict=False) if t0 < s <= t1)
        return served / asked if asked > 0 else None

    def _sent_by(self, t: float) -> int:
        return bisect.bisect_right(self.send_at, t)

    def _warm_segment(self, now: float, rate: float) -> str | None:
        from autotune.trial._levels import request_seconds

        self.warm_rates.append(rate)
        self.warm_edges.append(now)
        self.jit_last = self.jit() if self.jit is not None else False
        self.request_s = request_seconds(self.records, self.output)
        self.in_flight = self._sent_by(now) - len(self.finished)
        self.backlog.append((now, self.in_flight))
        overloaded = self._overloaded(now)
        steady = (self.request_s is not None and now >= STEADY_SPANS * self.request_s
                  and not self.jit_last and not backlog_grows(self.backlog, now))
        capped = now >= self.rule.warmup_max_s or overloaded
        little = self.steady_in_flight()
        detail = (f"segment {len(self.warm_rates)}: {rate:,.1f} tok/s, {self.in_flight} "
                  f"requests in flight"
                  + (f" (steady state ~{little:.3g})" if little is not None else "")
                  + (", a kernel was JIT-compiled" if self.jit_last else ""))
        logger.info("trial %d open-loop warm-up %s at %.1f s", self.number, detail, now)
        if not (steady or capped):
            self._tell("warming_up", detail)
            return None
        self.warm_end, self.converged = now, steady
        self.bounds = [now]
        if not self.measure:
            return self._end(now, "warm")
        self._tell("measuring", f"warm after {now:.0f} s" + (
            "" if steady else " (overloaded: the server fell behind the arrivals)"
            if overloaded else " (capped, not converged)"))
        return None

    def _measured_segment(self, now: float, rate: float) -> str | None:
        self.rates.append(rate)
        self.bounds.append(now)
        if self.jit is not None and self.jit():
            self.jit_measuring += 1
        rule = self.rule
        mean = sum(self.rates) / len(self.rates)
        lo, hi, _ = rate_interval(mean, self.rates)
        precise = (len(self.rates) >= rule.min_segments and lo is not None and hi is not None
                   and mean > 0 and (hi - lo) / 2 / mean <= rule.precision)
        if precise:
            return self._end(now, "precise")
        if now - (self.warm_end or 0.0) >= rule.measure_max_s:
            return self._end(now, "cap")
        self._tell("measuring", f"segment {len(self.rates)}: {rate:,.1f} tok/s")
        return None

    def _end(self, now: float, why: str) -> str:
        self.stop, self.stopped_at = why, now
        live = [s for i, s in enumerate(self.send_at) if s <= now and i not in self.finished]
        self.cut = min(live, default=now)
        return why

    def _tell(self, phase: str, detail: str) -> None:
        tell_phase(self.on_segment, self.number, phase, detail)

    def warmup_record(self) -> WarmupRecord:
        """``TrialOutcome.warmup`` of this run."""
        little = self.steady_in_flight()
        return {"seconds": round(self.warm_end if self.warm_end is not None
                                 else self.seg_start, 2),
                "segments": len(self.warm_rates), "converged": self.converged,
                "jit_in_last_segment": self.jit_last,
                "rates": [round(x, 1) for x in self.warm_rates],
                "rate_rps": round(self.rate_rps, 3),
                "request_s": None if self.request_s is None else round(self.request_s, 2),
                "requests_in_flight": self.in_flight,
                "steady_in_flight": None if little is None else round(little, 2),
                "overloaded": self.overloaded,
                "served_share": None if (share := self.served_share()) is None
                else round(share, 3),
                "rule": "steady_state"}


def backlog_grows(samples: Sequence[tuple[float, int]], now: float,
                  window_s: float = OVERLOAD_WINDOW_S) -> bool:
    """Whether the backlog (``(time, requests sent and not finished)`` samples) grew
    through the last ``window_s`` seconds: in each half of them (least-squares slopes above
    0, so a burst that rises and drains again is not a trend), by at least
    :data:`OVERLOAD_GROWTH` requests and a quarter of where it stood. Needs samples over at
    least 80 % of the window (the load generator takes one a second)."""
    pts = [(t, n) for t, n in samples if t >= now - window_s]
    if len(pts) < 6 or pts[-1][0] - pts[0][0] < 0.8 * window_s:
        return False
    mid = (pts[0][0] + pts[-1][0]) / 2
    halves = [[p for p in pts if p[0] <= mid], [p for p in pts if p[0] >= mid]]
    if any(len(h) < 3 or _slope(h) <= 0 for h in halves):
        return False
    grown = _slope(pts) * (pts[-1][0] - pts[0][0])
    start = min(n for _, n in halves[0])
    return grown >= max(OVERLOAD_GROWTH, 0.25 * start)


def _slope(pts: Sequence[tuple[float, int]]) -> float:
    """The least-squares slope of ``n`` over ``t`` (0 for points all at one time)."""
    mt = sum(t for t, _ in pts) / len(pts)
    mn = sum(n for _, n in pts) / len(pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (n - mn) for t, n in pts) / var if var > 0 else 0.0


def cut_bounds(bounds: Sequence[float], cut: float | None) -> list[float]:
    """The measured segments' edges whose segments hold every token that arrived in them:
    those up to ``cut`` (the earliest send of a request the stop cancelled: its tokens are
    not recorded); ``cut`` itself ends the window when no whole segment is left."""
    if cut is None:
        return list(bounds)
    kept = [b for b in bounds if b <= cut]
    if len(kept) == 1 and cut > kept[0]:
        kept.append(cut)
    return kept


#: vLLM's own default of --max-num-seqs (the batch limit a config without the flag has)
VLLM_MAX_NUM_SEQS = 256
#: a server that ran fewer requests on average than this share of its batch limit, and
#: queued none, was idle: the arrivals, not the config, set what it measured
IDLE_SHARE = 0.1


def idle_note(server: dict[str, float], flags: Sequence[str]) -> str:
    """A line when the server measured at a fixed arrival rate was idle (requests running
    far below its batch limit, none waiting; from its /metrics over the window), else ""
    (also when the server gave no such figures)."""
    running = server.get("requests_running")
    waiting = server.get("requests_waiting_max", server.get("requests_waiting"))
    if running is None or waiting is None or waiting > 0:
        return ""
    limit = VLLM_MAX_NUM_SEQS
    flags = list(flags)
    for i, f in enumerate(flags):
        if f == "--max-num-seqs" and i + 1 < len(flags):
            limit = int(flags[i + 1])
        elif f.startswith("--max-num-seqs="):
            limit = int(f.split("=", 1)[1])
    if running >= IDLE_SHARE * limit:
        return ""
    return (f"idle: the server ran {running:.3g} requests on average (batch limit {limit}) "
            "and queued none, so the arrivals, not the config, set this reading; "
            "--objective capacity asks what the config sustains")
