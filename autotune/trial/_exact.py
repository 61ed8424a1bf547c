"""The exact replay trial mode (``--replay exact``): a hash-id trace replayed request by
request with its recorded prefix blocks and times (:mod:`autotune.load._exact`), then the
shape's fitted sessions on the same server, so that the two prefix-cache hit rates stand
side by side (how much of the trace's reuse the fitted shape carries).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from autotune.engine import VllmServer
from autotune.trial._open_trial import _warm_up_open
from autotune.trial._replay import ClientKw, PhaseFn, _LoopMode, _Plan
from autotune.trial._sessions import MAX_SESSIONS, measured_replay
from autotune.trial._spec import TrialOutcome, TrialSpec

if TYPE_CHECKING:
    from autotune.load import SessionSchedule
    from autotune.measure import Measurement
    from autotune.traffic import Schedule

__all__ = ["FITTED_KEYS", "ExactReplayTrial", "exact_plan", "fitted_plan"]

logger = logging.getLogger(__name__)

#: the fitted replay's figures the exact replay's measurement carries (in its ``server``
#: figures, under ``fitted_replay_`` + the key)
FITTED_KEYS = ("prefix_cache_hit_rate", "prefix_cache_hits", "prefix_cache_queries")


class ExactReplayTrial(_LoopMode):
    """The exact replay trial mode (:class:`~autotune.trial._modes.TrialMode`): a short
    warm-up of the shape's independent requests, the trace's exact replay (measured), then
    the fitted session replay of the same length and time scale (its prefix-cache figures
    added to the measurement as ``server_fitted_replay_*``; none when the shape has no
    sessions)."""

    name = "exact"

    def measure(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                outcome: TrialOutcome, phase: PhaseFn, client: ClientKw) -> list[Measurement]:
        _warm_up_open(spec, plan, server, outcome, phase, client)
        exact = exact_plan(spec, plan)
        phase("measuring", f"the exact replay of {spec.measure.trace}: "
              f"{len(exact.requests)} requests")
        m = measured_replay(spec, exact, server, outcome, client)
        if m is None:
            return []
        fitted = fitted_plan(spec, plan, len(exact.requests))
        if fitted is None:
            return [m]
        phase("measuring", f"the fitted session replay, for comparison: "
              f"{len(fitted.sessions)} sessions")
        mf = measured_replay(spec, fitted, server, TrialOutcome(number=spec.number, ok=False),
                             client)
        if mf is None:
            return [m]
        extra = {f"fitted_replay_{k}": mf.server[k] for k in FITTED_KEYS if k in mf.server}
        logger.info("trial %d: prefix-cache hit rate %s exact, %s fitted", spec.number,
                    m.server.get("prefix_cache_hit_rate"), extra.get(
                        "fitted_replay_prefix_cache_hit_rate"))
        return [m.model_copy(update={"server": {**m.server, **extra}})]


def _ratio(spec: TrialSpec) -> float:
    m = spec.measure
    return (m.exact_block_tokens or m.trace_block_tokens) / m.trace_block_tokens


def exact_plan(spec: TrialSpec, plan: _Plan) -> Schedule:
    """The exact replay of ``--trace`` (its first ``--num-requests``): lengths times
    ``--exact-block-tokens / --trace-block-tokens``, times times the shape's
    ``load.time_scale``, clipped to the server's context."""
    from autotune.load import exact_schedule, model_prompts, read_hash_trace

    m = spec.measure
    assert m.trace is not None  # replays_exact() checked it
    reqs = read_hash_trace(m.trace, limit=m.num_requests)
    return exact_schedule(
        reqs, token_ids=model_prompts(spec.model).token_ids,
        block_tokens=m.exact_block_tokens or m.trace_block_tokens,
        trace_block_tokens=m.trace_block_tokens,
        time_scale=spec.shape.load.time_scale if spec.shape is not None else 1.0,
        max_total_tokens=plan.max_len, seed=spec.seed)


def fitted_plan(spec: TrialSpec, plan: _Plan, requests: int) -> SessionSchedule | None:
    """The shape's fitted sessions at the exact replay's length and time scale, as many as
    carry about ``requests`` turns, open loop at the recorded session rate (None when the
    shape has no sessions or no session rate)."""
    from autotune.load import model_prompts, session_schedule

    shape = spec.shape
    s = shape.sessions if shape is not None else None
    if shape is None or s is None or not s.rate_sps > 0:
        return None
    n = max(1, min(MAX_SESSIONS, math.ceil(requests / max(1.0, s.turns.mean))))
    return session_schedule(
        shape, token_ids=model_prompts(spec.model).token_ids, seed=spec.seed,
        num_sessions=n, time_scale=shape.load.time_scale, length_scale=_ratio(spec),
        max_total_tokens=plan.max_len)
