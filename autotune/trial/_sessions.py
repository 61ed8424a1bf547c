"""The session trial mode: a shape's conversations and agent sessions replayed turn by
turn (:mod:`autotune.load._sessions`), so that the server's prefix cache is measured on
what production sends: each turn's prompt extends the previous one and its answer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.engine import VllmServer
from autotune.errors import ConfigError
from autotune.trial._closed import _abort, _aborted, _count_prompt_tokens
from autotune.trial._open_trial import CapacityTrial, _measure_capacity, _warm_up_open
from autotune.trial._replay import ClientKw, PhaseFn, _LoopMode, _Plan
from autotune.trial._spec import TrialOutcome, TrialSpec

if TYPE_CHECKING:
    from autotune.load import SessionSchedule
    from autotune.measure import Measurement
    from autotune.traffic import Schedule, TrafficShape
    from autotune.trial._levels import LevelPlan

logger = logging.getLogger(__name__)

#: sessions one replay draws at most (an open loop's cap of time ends it first)
MAX_SESSIONS = 5000


class SessionTrial(_LoopMode):
    """The session trial mode (:class:`~autotune.trial._modes.TrialMode`): a short warm-up
    of independent requests, then per repeat one session replay (new sessions at the
    shape's session rate, or ``--concurrency`` sessions at once) for at most
    ``--measure-max-s``; its measurement carries the session figures (``session_*``) and the
    server's prefix-cache hit rate over the whole replay."""

    name = "sessions"

    def measure(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                outcome: TrialOutcome, phase: PhaseFn, client: ClientKw) -> list[Measurement]:
        _warm_up_open(spec, plan, server, outcome, phase, client)
        results: list[Measurement] = []
        repeats = max(1, spec.measure.repeats)
        for r in range(repeats):
            sched = session_plan(spec, plan, token_seed=r)
            phase("measuring", f"replay {r + 1}/{repeats}: {len(sched.sessions)} sessions, "
                  f"{sched.turns()} turns at most")
            m = measured_replay(spec, sched, server, outcome, client)
            if m is None:
                break
            results.append(m)
        return results


class SessionCapacityTrial(CapacityTrial):
    """Session capacity levels are windows of the steady state, bounded in time whatever
    the think times: sessions already mid-conversation and new ones, their prior
    conversations put into the prefix cache by a bounded warm-up, then
    ``--capacity-level-s`` of turns at their recorded times.

    The session capacity trial mode (:class:`~autotune.trial._modes.TrialMode`,
    ``--objective capacity`` on a shape whose sessions are replayed turn by turn): the
    bracketing search of :class:`~autotune.trial._open_trial.CapacityTrial` with levels at a
    scale of the recorded session rate (:func:`~autotune.load.steady_sessions`), every turn
    of a level's window sent causally; a level passes when its turns meet the SLOs as the
    goodput bar asks. The capacity is in sessions/s (``capacity_sps``) and in requests
    (turns) per second (``capacity_rps``, the objective: the same ranking, and what cost
    counts). For the cache: an idle session's prefix is put into the cache in the order
    the sessions last spoke, without the other traffic production sent during its think
    time, so a cache that cannot hold every idle session loses fewer of them than in
    production (docs/traffic.md)."""

    name = "session_capacity"

    def measure(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                outcome: TrialOutcome, phase: PhaseFn, client: ClientKw) -> list[Measurement]:
        return _measure_capacity(spec, plan, server, outcome, phase, client,
                                 sessions=SessionLevels.of(spec, plan.max_len))


@dataclass(frozen=True)
class SessionLevels:
    """The load levels of a session capacity search: at a request rate ``r`` (the scale x
    the shape's recorded request rate), sessions start open loop at the same scale of the
    recorded session rate (``recorded_sps``), as many as carry the level's requests over
    the mean turns per session; think times as recorded."""

    shape: TrafficShape
    token_ids: tuple[int, ...]
    recorded_rps: float
    recorded_sps: float
    max_len: int

    @classmethod
    def of(cls, spec: TrialSpec, max_len: int) -> SessionLevels:
        """The levels of ``spec``'s shape; one line when it has no session rate."""
        from autotune.load import model_prompts
        from autotune.trial._levels import recorded_rate

        shape = spec.shape
        if shape is None or shape.sessions is None:
            raise ConfigError(f"trial {spec.number}: no shape with sessions to replay")
        sps = shape.sessions.rate_sps
        if not (sps > 0 and math.isfinite(sps)):
            raise ConfigError(
                f"a session capacity search scales the session rate, and shape "
                f"{shape.name!r} has none (its trace's sessions carry no arrival times); "
                "fit it from a trace with timestamps or use --replay independent")
        return cls(shape=shape, token_ids=tuple(model_prompts(spec.model).token_ids),
                   recorded_rps=recorded_rate(shape), recorded_sps=float(sps),
                   max_len=max_len)

    def level_at(self, plan: LevelPlan) -> Callable[[float, int | None], SessionSchedule]:
        """Each level's sessions (:data:`~autotune.trial._levels.LevelAt`) under ``plan``:
        the turns of ``plan.seconds(rate)`` seconds of the steady state at the level's
        session rate (:func:`~autotune.load.steady_sessions`: sessions already
        mid-conversation and new ones; think times as recorded, however long), drawn from
        ``plan.seed`` (``token_seed``: other words), without the turns the context cannot
        hold (what a level offers is what it sends)."""
        from autotune.load import steady_sessions

        def at(rate: float, token_seed: int | None) -> SessionSchedule:
            sched = steady_sessions(
                self.shape, token_ids=self.token_ids, seed=plan.seed,
                rate_sps=rate / self.recorded_rps * self.recorded_sps,
                window_s=plan.seconds(rate), max_total_tokens=self.max_len,
                token_seed=token_seed, max_sessions=MAX_SESSIONS).within_context()
            if not sched.sessions:
                raise ConfigError(
                    f"no session of shape {self.shape.name!r} has a turn in a level of "
                    f"{plan.seconds(rate):.3g} s that fits the server's context "
                    f"({self.max_len} tokens); raise --max-model-len, fit the shape to "
                    "this model, or raise --capacity-level-s")
            return sched

        return at


def session_plan(spec: TrialSpec, plan: _Plan, *, token_seed: int = 0) -> SessionSchedule:
    """The sessions one replay of ``spec`` sends: open loop at the shape's session rate
    (times its ``load.time_scale``) for ``--measure-max-s``, or closed loop of
    ``--concurrency`` sessions; ``--num-requests`` turns over the mean turns per session
    when given."""
    from autotune.load import model_prompts, session_schedule

    shape = spec.shape
    if shape is None or shape.sessions is None:
        raise ConfigError(f"trial {spec.number}: no shape with sessions to replay")
    s = shape.sessions
    cap_s = spec.measure.measure_max_s
    conc = spec.measure.concurrency
    if spec.measure.num_requests is not None:
        n = math.ceil(spec.measure.num_requests / max(1.0, s.turns.mean))
    elif conc is not None:
        n = max(4 * conc, 16)
    else:
        n = math.ceil(s.rate_sps / shape.load.time_scale * cap_s) + 1
    return session_schedule(
        shape, token_ids=model_prompts(spec.model).token_ids, seed=spec.seed,
        num_sessions=max(1, min(MAX_SESSIONS, n)), mode="closed" if conc else "open",
        concurrency=conc, time_scale=shape.load.time_scale, max_total_tokens=plan.max_len,
        duration_s=cap_s, token_seed=token_seed)


def measured_replay(spec: TrialSpec, sched: SessionSchedule | Schedule, server: VllmServer,
                    outcome: TrialOutcome, client: ClientKw) -> Measurement | None:
    """One measured replay (a session replay, or the exact replay of a trace): its
    measurement with the server's figures over the whole replay (None when most requests
    failed: the outcome says why)."""
    from autotune.load import replay
    from autotune.measure import snapshot_metrics
    from autotune.trial._levels import with_server

    t_run = time.monotonic()
    before = snapshot_metrics(server.base_url)
    run = replay(sched, **client, metrics_interval_s=2.0, abort=_abort(spec))
    server.check_alive()
    if _aborted(spec, run, outcome, server):
        return None
    after = snapshot_metrics(server.base_url)
    _count_prompt_tokens(outcome, run, before, after)
    m = with_server(run, spec.slo, before, after)
    outcome.measure_s += time.monotonic() - t_run
    outcome.stop = "cap" if run.stopped_at_s is not None else "schedule_end"
    logger.info("trial %d: %d sessions, %d requests, prefix-cache hit rate %s, %s out tok/s",
                spec.number, int(m.sessions.get("sessions", 0)), len(run.records),
                m.server.get("prefix_cache_hit_rate"), m.output_tokens_per_s)
    return m
