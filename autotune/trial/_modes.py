"""How a trial measures its server: one :class:`TrialMode` per way of loading it, chosen
once from the spec by :func:`mode_for`.

A mode is a small strategy: closed loop (:class:`~autotune.trial._closed.ClosedLoopTrial`),
open loop and capacity search (:mod:`autotune.trial._open_trial`), sessions replayed turn
by turn (:class:`~autotune.trial._sessions.SessionTrial`) and their capacity search
(:class:`~autotune.trial._sessions.SessionCapacityTrial`), a hash-id trace replayed
exactly (:class:`~autotune.trial._exact.ExactReplayTrial`). A new mode is a class
with this interface and a row of :data:`MODES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from autotune.trial._closed import ClosedLoopTrial
from autotune.trial._exact import ExactReplayTrial
from autotune.trial._open_trial import CapacityTrial, OpenLoopTrial
from autotune.trial._replay_choice import replays_exact, replays_sessions
from autotune.trial._sessions import SessionCapacityTrial, SessionTrial

if TYPE_CHECKING:
    from autotune.engine import VllmServer
    from autotune.measure import Measurement
    from autotune.trial._replay import ClientKw, PhaseFn, _Plan
    from autotune.trial._spec import TrialOutcome, TrialSpec

__all__ = ["MODES", "TrialMode", "mode_for"]


class TrialMode(Protocol):
    """One way of measuring a trial on its running server.

    ``measure`` warms the server up and measures it (the replays or load levels the mode
    drives), recording its warm-up, measuring time, segments and stop in ``outcome``, and
    returns the measurements to combine: empty when it was interrupted before one, when
    most requests failed (``outcome.reason`` ``aborted``), or when the mode recorded the
    whole outcome itself (``outcome.ok`` set: a capacity search where no level passed).
    It raises for a server that died (the caller records why). ``counts_prompt_tokens``:
    the measurement's ``shape_prompt_tokens`` is the requests' prompt tokens sent.
    ``metrics(spec, outcome)``: the mode's own figures, added last to the trial's."""

    name: str
    counts_prompt_tokens: bool

    def measure(self, spec: TrialSpec, plan: _Plan, server: VllmServer,
                outcome: TrialOutcome, phase: PhaseFn, client: ClientKw) -> list[Measurement]:
        ...

    def metrics(self, spec: TrialSpec, outcome: TrialOutcome) -> dict[str, float]: ...


#: the trial modes by name
MODES: dict[str, TrialMode] = {m.name: m for m in (ClosedLoopTrial(), OpenLoopTrial(),
                                                   CapacityTrial(), SessionTrial(),
                                                   SessionCapacityTrial(),
                                                   ExactReplayTrial())}


def mode_for(spec: TrialSpec, plan: _Plan) -> TrialMode:
    """The trial's mode: a capacity search when the spec asks for one, a session replay
    when its shape's sessions are replayed turn by turn (``--replay``; both: the session
    capacity search), the exact replay of a hash-id trace (``--replay exact``), else the
    loop its replay schedule drives (closed or open)."""
    if replays_exact(spec):
        return MODES["exact"]
    if replays_sessions(spec):  # first: a --replay sessions that cannot be says so
        return MODES["sessions" if spec.capacity is None else "session_capacity"]
    return MODES["capacity" if spec.capacity is not None else plan.schedule.mode]
