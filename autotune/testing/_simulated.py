"""An executor that evaluates a function of the params instead of starting a server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from autotune.events import ParamValue, PhaseReporter, StudyCallback, StudyEvent
from autotune.parallelism import GpuPool, Node
from autotune.store import FailureReason
from autotune.trial import TrialOutcome, TrialSpec

__all__ = ["SimulatedExecutor", "TimelineEntry", "fidelity_outcome"]

#: ``evaluate(params, spec)``: the trial's metrics (Measurement.flat() keys), a failure
#: reason (a :class:`~autotune.store.FailureReason` value) when the config "fails to start",
#: or a whole :class:`TrialOutcome` (a pruned trial, quality figures; its number, wall time
#: and GPUs are the simulation's).
Evaluate = Callable[[dict[str, ParamValue], TrialSpec], "dict[str, float] | str | TrialOutcome"]
#: ``duration(params, spec)``: the trial's simulated wall time (seconds)
Duration = Callable[[dict[str, ParamValue], TrialSpec], float]


def fidelity_outcome(spec: TrialSpec, *, full: float, coarse: float,
                     coarse_half_width: float = 0.06, full_half_width: float = 0.02
                     ) -> TrialOutcome:
    """A simulated throughput trial read at two fidelities, as a real one is: first a
    coarse reading ``coarse`` (interval +-``coarse_half_width``), where the pruner
    (``spec.incumbent_low``: its interval wholly below) and the screen (``spec.screen``:
    :meth:`autotune.measure.Screen.promotes`) may stop it, then the full-resolution
    reading ``full`` (+-``full_half_width``). Stopped early, its metrics are the coarse
    reading's (``outcome.stop`` says which rule stopped it)."""
    lo, hi = coarse * (1 - coarse_half_width), coarse * (1 + coarse_half_width)
    early = {"output_tokens_per_s": coarse, "output_tokens_per_s_ci_low": lo,
             "output_tokens_per_s_ci_high": hi}
    if spec.incumbent_low is not None and hi < spec.incumbent_low:
        return TrialOutcome(number=spec.number, ok=True, metrics=early, segments=[coarse],
                            pruned=True, stop="pruned")
    record = spec.screen.record(coarse, lo, hi, 0.0) if spec.screen is not None else None
    if record is not None and not record["promoted"]:
        return TrialOutcome(number=spec.number, ok=True, metrics=early, segments=[coarse],
                            coarse=record, screened=True, stop="screened")
    return TrialOutcome(number=spec.number, ok=True, coarse=record, segments=[coarse, full],
                        stop="precise", metrics={
                            "output_tokens_per_s": full,
                            "output_tokens_per_s_ci_low": full * (1 - full_half_width),
                            "output_tokens_per_s_ci_high": full * (1 + full_half_width)})


@dataclass(frozen=True)
class TimelineEntry:
    """One simulated trial: when it ran (simulated seconds) and on which GPUs."""

    number: int
    start: float
    end: float
    gpus: tuple[int, ...]


@dataclass
class _Flight:
    spec: TrialSpec
    on_phase: PhaseReporter | None
    start: float
    node: str = ""
    gpus: tuple[int, ...] = ()
    end: float | None = None


class SimulatedExecutor(StudyCallback):
    """An :class:`~autotune.exec.Executor` whose trials are ``evaluate(params, spec)``.

    Subscribe it to the study too (``callbacks=[executor]``): it learns each trial's params
    from ``on_trial_start``. ``slots`` trials may be in flight; ``wait`` finishes the one
    that ends first on a simulated clock (each lasts ``duration(params, spec)``, default
    ``wall_s``; ties: the oldest), so parallel studies see staggered results, as with real
    servers. Each trial reports the phases starting and measuring.

    ``gpus``: a node of that many GPUs instead of slots: each trial takes
    ``spec.server_gpus`` of them (whole GPUs, none shared) and starts only when they are
    free; ``gpu_memory_gib`` is one GPU's memory for the parallelism rules' estimate.
    ``timeline`` records every finished trial's simulated start, end and GPUs."""

    def __init__(self, evaluate: Evaluate, *, slots: int = 1, wall_s: float = 1.0,
                 gpus: int | None = None, gpu_memory_gib: float | None = None,
                 duration: Duration | None = None) -> None:
        self.evaluate = evaluate
        self.pool: GpuPool | None = GpuPool.single(gpus) if gpus else None
        self.slots = gpus if gpus else slots
        self.wall_s = wall_s
        self.gpu_memory_gib = gpu_memory_gib
        self.duration = duration
        self.params: dict[int, dict[str, ParamValue]] = {}
        self.clock = 0.0
        self.timeline: list[TimelineEntry] = []
        self._pending: list[_Flight] = []

    # -- placement (autotune.exec) ------------------------------------------------------
    def reservation(self, spec: TrialSpec) -> int:
        return max(1, spec.server_gpus) if self.pool is not None else 0

    def fits(self, spec: TrialSpec) -> bool:
        if self.pool is None:
            return len(self._pending) < self.slots
        return self.pool.fits(self.reservation(spec))

    def has_room(self) -> bool:
        return self.pool.free() > 0 if self.pool is not None else len(self._pending) < self.slots

    def gpu_node(self) -> Node | None:
        if self.pool is None:
            return None
        return Node(gpus=self.pool.largest_node, gpu_memory_gib=self.gpu_memory_gib)

    # -- the executor ------------------------------------------------------------------------
    def on_trial_start(self, event: StudyEvent) -> None:
        if event.trial_number is not None:
            self.params[event.trial_number] = dict(event.trial_params)

    def submit(self, spec: TrialSpec, *, on_phase: PhaseReporter | None = None) -> TrialSpec:
        flight = _Flight(spec, on_phase, start=self.clock)
        if self.pool is not None:
            flight.node, flight.gpus = self.pool.take(self.reservation(spec))
        self._pending.append(flight)
        return spec

    def in_flight(self) -> int:
        return len(self._pending)

    def wait(self, timeout_s: float | None = None) -> list[TrialOutcome]:
        if not self._pending:
            return []
        for f in self._pending:  # params are known once the loop said the trial started
            if f.end is None:
                params = self.params.get(f.spec.number, {})
                wall = self.duration(params, f.spec) if self.duration else self.wall_s
                f.end = f.start + wall
        flight = min(self._pending, key=lambda f: f.end or 0.0)  # the oldest on a tie
        outcome = self._run(flight)  # in flight until it returns (cancel_all sees it)
        self._pending.remove(flight)
        if self.pool is not None:
            self.pool.release(flight.node, flight.gpus)
        self.clock = max(self.clock, flight.end or 0.0)
        self.timeline.append(TimelineEntry(flight.spec.number, flight.start, self.clock,
                                           flight.gpus))
        return [outcome]

    def _run(self, f: _Flight) -> TrialOutcome:
        spec, on_phase = f.spec, f.on_phase
        wall = (f.end or 0.0) - f.start
        gpus = f.gpus or None
        if on_phase is not None:
            on_phase(spec.number, "starting", 0.0, " ".join(spec.flags))
        result = self.evaluate(self.params.pop(spec.number, {}), spec)
        if isinstance(result, TrialOutcome):
            return replace(result, number=spec.number, wall_s=wall, gpus=gpus)
        if isinstance(result, str):
            return TrialOutcome(number=spec.number, ok=False,
                                reason=FailureReason(result or FailureReason.CRASH),
                                message=f"simulated failure: {result}", wall_s=wall, gpus=gpus)
        if on_phase is not None:
            on_phase(spec.number, "measuring", wall / 2, "simulated")
        return TrialOutcome(number=spec.number, ok=True, metrics=dict(result),
                            start_s=wall / 4, wall_s=wall, gpus=gpus)

    def cancel_all(self) -> list[int]:
        numbers = [f.spec.number for f in self._pending]
        for f in self._pending:
            if self.pool is not None:
                self.pool.release(f.node, f.gpus)
        self._pending.clear()
        return numbers

    def shutdown(self) -> None:
        self.cancel_all()
