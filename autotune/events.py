"""What a running study tells its subscribers (Ray Tune's ``Callback`` pattern).

The study loop (:mod:`autotune.study`) emits events; MLflow tracking
(:class:`autotune.results.MlflowCallback`), ``trials.csv``
(:class:`autotune.results.TrialsCsvCallback`) and the CLI's progress display are
subscribers. A study runs with none of them. Every hook is a no-op by default, so a
subscriber overrides only what it needs. A subscriber's error is its own: hooks are called
in the driver, in order, after the trial is final in the Optuna storage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna

    from autotune.config import TuneSettings
    from autotune.engine import EngineInfo
    from autotune.results import TuneResult
    from autotune.space import SearchSpace
    from autotune.traffic import TrafficShape
    from autotune.trial import TrialOutcome

__all__ = [
    "PHASES",
    "EventListener",
    "ParamValue",
    "PhaseReporter",
    "StudyCallback",
    "StudyCallbacks",
    "StudyContext",
    "StudyEvent",
    "TrialRecord",
]

logger = logging.getLogger(__name__)

#: ``on_trial_phase`` phases, in the order a trial goes through them.
PHASES = ("starting", "warming_up", "measuring", "capacity", "recheck", "quality")

#: ``(trial number, phase, seconds since the trial started, detail)``: how a trial reports
#: its phases through the executor (see :meth:`autotune.exec.Executor.submit`).
PhaseReporter = Callable[[int, str, float, str], None]

#: A sampled value of a knob, as Optuna stores it (its distributions' choices).
ParamValue = float | int | str | bool | None


@dataclass
class StudyEvent:
    """Progress of a study, for displays: ``kind`` in study_started, note, trial_started,
    trial_finished, trial_rejected, recheck_started, study_finished."""

    kind: str
    study_name: str
    done: int
    total: int
    running: int
    best_value: float | None = None
    best_number: int | None = None
    # the best trial's interval (per GPU), when measured: its throughput's, or its capacity
    # bracket (``best_ci_high`` None with a low end: no level failed, a lower bound)
    best_ci_low: float | None = None
    best_ci_high: float | None = None
    baseline_value: float | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None
    trial_number: int | None = None
    trial_ok: bool | None = None
    trial_value: float | None = None
    trial_ci_low: float | None = None  # the finished trial's interval, as ``best_ci_*``
    trial_ci_high: float | None = None
    trial_reason: str | None = None
    trial_params: dict[str, ParamValue] = field(default_factory=dict)
    message: str = ""


@dataclass(frozen=True)
class StudyContext:
    """What a study is about, given to subscribers when it starts."""

    study: optuna.Study
    settings: TuneSettings
    space: SearchSpace
    shape: TrafficShape
    model: Path
    engine: EngineInfo
    gpu_type: str
    out_dir: Path
    tracking_uri: str = ""

    @property
    def study_name(self) -> str:
        return str(self.study.study_name)


@dataclass(frozen=True)
class TrialRecord:
    """A finished trial as the study told it to Optuna (``state`` ok, failed, infeasible).

    ``outcome`` is the :class:`autotune.trial.TrialOutcome` (None for a sample the space's
    rules rejected: it never ran; ``violations`` says why)."""

    number: int
    params: dict[str, ParamValue]
    flags: tuple[str, ...]
    env: dict[str, str]
    state: str
    reason: str | None
    value: float | list[float] | None
    baseline: bool
    outcome: TrialOutcome | None = None
    violations: tuple[str, ...] = ()

    @property
    def rejected(self) -> bool:
        return self.outcome is None


class StudyCallback:
    """A subscriber to a study's events; every hook is a no-op by default."""

    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        """The study is created (or loaded) and about to ask for its first trial."""

    def on_note(self, event: StudyEvent) -> None:
        """Something people should know (``event.message``): the quality reference, the
        start of the re-check phase."""

    def on_trial_start(self, event: StudyEvent) -> None:
        """A trial was handed to the executor (``event.trial_number``, ``trial_params``)."""

    def on_trial_phase(self, number: int, phase: str, elapsed_s: float, detail: str) -> None:
        """A running trial entered ``phase`` (one of :data:`PHASES`)."""

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        """A trial is final in the Optuna storage (also a rejected sample: ``record.rejected``)."""

    def on_study_end(self, event: StudyEvent, result: TuneResult | None) -> None:
        """The study's result files are written (``result``), or it stopped on an error or
        an interrupt (``result`` None)."""


class StudyCallbacks(StudyCallback):
    """Calls each subscriber in turn."""

    def __init__(self, callbacks: Sequence[StudyCallback] = ()) -> None:
        self.callbacks = list(callbacks)

    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        for cb in self.callbacks:
            cb.on_study_start(event, context)

    def on_note(self, event: StudyEvent) -> None:
        for cb in self.callbacks:
            cb.on_note(event)

    def on_trial_start(self, event: StudyEvent) -> None:
        for cb in self.callbacks:
            cb.on_trial_start(event)

    def on_trial_phase(self, number: int, phase: str, elapsed_s: float, detail: str) -> None:
        for cb in self.callbacks:
            cb.on_trial_phase(number, phase, elapsed_s, detail)

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        for cb in self.callbacks:
            cb.on_trial_end(event, record)

    def on_study_end(self, event: StudyEvent, result: TuneResult | None) -> None:
        for cb in self.callbacks:
            cb.on_study_end(event, result)


class EventListener(StudyCallback):
    """Hands every :class:`StudyEvent` to one function (``tune(on_event=...)``)."""

    def __init__(self, fn: Callable[[StudyEvent], None]) -> None:
        self.fn = fn

    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        self.fn(event)

    def on_note(self, event: StudyEvent) -> None:
        self.fn(event)

    def on_trial_start(self, event: StudyEvent) -> None:
        self.fn(event)

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        if not record.rejected:
            self.fn(event)

    def on_study_end(self, event: StudyEvent, result: TuneResult | None) -> None:
        if result is not None:
            self.fn(event)
