"""Which objective a study maximises, from how its traffic is replayed (pure).

A **closed loop** (``concurrency`` streams, each sending its next request when the last
one ends) loads the server as hard as the config lets it: its output tokens/s is the
config's, so ``throughput`` ranks configs. An **open loop** replays recorded arrivals at
their own rate: a server that keeps up serves exactly what arrives, so its tokens/s is the
arrival rate times the mean output length whatever the config; ranking configs by it
ranks noise. For an open loop the question a config decides is the highest rate it
sustains within the SLOs (``capacity``, the default), or, on request, how many requests
meet the SLOs at the recorded rate (``goodput`` with ``--slo``). ``docs/measurement.md``,
section 13, says more.

:func:`resolve_objective` turns ``--objective auto`` (the default) into one of these
and refuses, before any server starts, an objective that ranks nothing on the shape
(:func:`resolve_study` reads the shape for it, once per study);
:func:`replayed_shape` is the shape as the trials replay it (an open-loop shape with
``--concurrency N`` becomes a closed loop of N streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.config import TuneSettings
    from autotune.traffic import TrafficShape

__all__ = ["ResolvedStudy", "is_open_loop", "replayed_shape", "resolve_objective",
           "resolve_study"]


def is_open_loop(shape: TrafficShape, concurrency: int | None = None) -> bool:
    """Whether the study replays ``shape`` as recorded arrivals (open loop): its load says
    so and no ``--concurrency`` turns it into a closed loop."""
    return shape.load.mode == "open" and concurrency is None


def _rate(shape: TrafficShape) -> str:
    rate = shape.load.rate_rps or shape.rate_rps
    return f"{rate:.3g} req/s" if rate else "its recorded rate"


def resolve_objective(settings: TuneSettings, shape: TrafficShape) -> TuneSettings:
    """``settings`` with the objective the traffic calls for, validated again (a capacity
    study gets the default SLOs). ``auto``: ``capacity`` for an open loop, ``throughput``
    for a closed loop. A :class:`ConfigError` (one line, with the ways out) for an
    objective that ranks nothing on an open loop: ``throughput`` and ``pareto`` (whose
    first objective is tokens/s), and ``goodput`` without ``--slo``."""
    from autotune.config import TuneSettings

    objective = settings.objective
    open_loop = is_open_loop(shape, settings.measure.concurrency)
    if objective == "auto":
        objective = "capacity" if open_loop else "throughput"
    elif open_loop and objective in ("throughput", "pareto"):
        raise ConfigError(
            f"--objective {objective} ranks nothing on shape {shape.name!r}: it replays "
            f"recorded arrivals (open loop, {_rate(shape)}), and a server that keeps up serves "
            "exactly what arrives, so its tokens/s is the traffic's, not the config's; leave "
            "--objective out (capacity: the highest rate a config sustains within --slo), use "
            "--objective goodput --slo ttft_p99=2.0,tpot_p99=0.1 (requests within the SLOs at "
            "the recorded rate), or replay the shape as a closed loop with --concurrency N")
    elif open_loop and objective == "goodput" and not settings.measure.slo:
        raise ConfigError(
            f"--objective goodput on shape {shape.name!r} needs --slo: it replays recorded "
            f"arrivals (open loop, {_rate(shape)}), so without SLOs goodput is the requests/s "
            "that arrive, whatever the config; add e.g. --slo ttft_p99=2.0,tpot_p99=0.1, or "
            "leave --objective out (capacity)")
    if objective == settings.objective:
        return settings
    return TuneSettings(**{**settings.model_dump(), "objective": objective})


@dataclass(frozen=True)
class ResolvedStudy:
    """A study's settings with the objective resolved from its shape, and the shape as
    ``settings.shape`` holds it, read once (:func:`resolve_study`): what the command line
    hands to :func:`autotune.study.tune`, so nothing on the way reads the file again."""

    settings: TuneSettings
    shape: TrafficShape  # as recorded (the trials replay replayed_shape() of it)


def resolve_study(settings: TuneSettings | ResolvedStudy) -> ResolvedStudy:
    """Read ``settings.shape`` and resolve the objective from it
    (:func:`resolve_objective`); resolved ones are returned as they are."""
    from autotune.traffic import load_shape

    if isinstance(settings, ResolvedStudy):
        return settings
    shape = load_shape(settings.shape)
    return ResolvedStudy(settings=resolve_objective(settings, shape), shape=shape)


def replayed_shape(shape: TrafficShape, concurrency: int | None) -> TrafficShape:
    """The shape as the study's trials replay it: an open-loop shape with
    ``--concurrency N`` as a closed loop of N streams (its lengths, not its arrivals: the
    way out of an open loop for a throughput study); any other shape as it is. The
    fingerprint does not depend on the load, so the registry still finds the shape."""
    from autotune.traffic import LoadSpec

    if shape.load.mode != "open" or concurrency is None:
        return shape
    return shape.with_load(LoadSpec(mode="closed", concurrency=concurrency,
                                    requests=shape.load.requests))
