"""An executor that evaluates a function of the params instead of starting a server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.events import PhaseReporter, StudyCallback, StudyEvent
from autotune.schema import FailureReason
from autotune.trial import TrialOutcome, TrialSpec

__all__ = ["SimulatedExecutor"]

#: ``evaluate(params, spec)``: the trial's metrics (Measurement.flat() keys), or a failure
#: reason (a :class:`~autotune.schema.FailureReason` value) when the config "fails to start".
Evaluate = Callable[[dict[str, Any], TrialSpec], "dict[str, float] | str"]


class SimulatedExecutor(StudyCallback):
    """An :class:`~autotune.parallel.Executor` whose trials are ``evaluate(params, spec)``.

    Subscribe it to the study too (``callbacks=[executor]``): it learns each trial's params
    from ``on_trial_start``. ``slots`` trials may be in flight; ``wait`` finishes the oldest
    one (so parallel studies see staggered results, as with real servers). Each trial
    reports the phases starting and measuring; ``wall_s`` is the simulated trial time."""

    def __init__(self, evaluate: Evaluate, *, slots: int = 1, wall_s: float = 1.0) -> None:
        self.evaluate = evaluate
        self.slots = slots
        self.wall_s = wall_s
        self.params: dict[int, dict[str, Any]] = {}
        self._pending: list[tuple[TrialSpec, PhaseReporter | None]] = []

    def on_trial_start(self, event: StudyEvent) -> None:
        if event.trial_number is not None:
            self.params[event.trial_number] = dict(event.trial_params)

    def submit(self, spec: TrialSpec, *, on_phase: PhaseReporter | None = None) -> TrialSpec:
        self._pending.append((spec, on_phase))
        return spec

    def in_flight(self) -> int:
        return len(self._pending)

    def wait(self, timeout_s: float | None = None) -> list[TrialOutcome]:
        if not self._pending:
            return []
        spec, on_phase = self._pending[0]
        outcome = self._run(spec, on_phase)  # in flight until it returns (cancel_all sees it)
        self._pending.pop(0)
        return [outcome]

    def _run(self, spec: TrialSpec, on_phase: PhaseReporter | None) -> TrialOutcome:
        if on_phase is not None:
            on_phase(spec.number, "starting", 0.0, " ".join(spec.flags))
        result = self.evaluate(self.params.pop(spec.number, {}), spec)
        if isinstance(result, str):
            return TrialOutcome(number=spec.number, ok=False, reason=result or FailureReason.CRASH,
                                message=f"simulated failure: {result}", wall_s=self.wall_s)
        if on_phase is not None:
            on_phase(spec.number, "measuring", self.wall_s / 2, "simulated")
        return TrialOutcome(number=spec.number, ok=True, metrics=dict(result),
                            start_s=self.wall_s / 4, wall_s=self.wall_s)

    def cancel_all(self) -> list[int]:
        numbers = [s.number for s, _ in self._pending]
        self._pending.clear()
        return numbers

    def shutdown(self) -> None:
        self._pending.clear()
