"""Optuna over the fused-MoE config space, for one token count, with any timer.

A :class:`KernelTimer` times one config (microseconds per call) or raises
:class:`KernelFailure` (the config does not compile, runs out of shared memory, crashes
the worker): a failure is data, recorded with its reason and told to Optuna as a pruned
trial so TPE learns to avoid its region, never scored as a time. The GPU timer lives in
:mod:`autotune.kernels._worker`; tests drive this module with a pure function.

Per token count: vLLM's default config is timed first (the baseline, and Optuna's first
point), then TPE samples the grid; configs the rules of :mod:`._space` prune cost no
timing, and a config equivalent to one already timed reuses its time. Before the verdict
the leaders and the default are timed again with more iterations, in one interleaved
round, so the winner is not a lucky reading.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from autotune.kernels._moe_shape import MoeShape
from autotune.kernels._space import (
    GRID,
    HOPPER_SMEM,
    KEYS,
    KernelConfig,
    canonical,
    default_config,
    prune_reason,
)

__all__ = ["Candidate", "KernelFailure", "KernelTimer", "SearchSettings", "SizeResult",
           "search_size"]

logger = logging.getLogger(__name__)


class KernelFailure(Exception):
    """One config could not be timed; ``reason``: out_of_resources, compile_error, crash,
    timeout or error."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message


class KernelTimer(Protocol):
    """Times the fused-MoE call at ``m`` tokens with ``config``: microseconds per call
    (mean over ``iters``), or raises :class:`KernelFailure`."""

    def __call__(self, config: KernelConfig, m: int, *, iters: int) -> float: ...


@dataclass(frozen=True)
class SearchSettings:
    """How hard to search one token count."""

    trials: int = 48  # configs timed (failures included) before the re-check
    search_iters: int = 20  # graph replays per timing while searching (vLLM tunes with 20)
    recheck: int = 3  # leaders timed again, beside the default
    recheck_iters: int = 100
    seed: int = 0
    smem_limit: int = HOPPER_SMEM
    max_asks: int = 2000  # bound on samples (pruned or repeated ones cost no timing)


@dataclass
class Candidate:
    """One timed (or failed, or pruned) config at one token count."""

    m: int
    config: KernelConfig
    phase: str  # "default", "search", "recheck"
    us: float | None = None
    reason: str | None = None  # why it has no time: a failure or a pruning rule
    message: str = ""

    def row(self) -> dict[str, Any]:
        return {"m": self.m, "phase": self.phase, **self.config,
                "us": self.us, "reason": self.reason, "message": self.message[:300]}


@dataclass
class SizeResult:
    """The verdict for one token count: the winner, the default, and every candidate."""

    m: int
    best: KernelConfig
    best_us: float | None
    default: KernelConfig
    default_us: float | None
    candidates: list[Candidate] = field(default_factory=list)
    timed: int = 0
    failed: int = 0
    pruned: int = 0
    seconds: float = 0.0

    @property
    def speedup(self) -> float | None:
        """Default time / winner time from the re-check round (1.0: the default won)."""
        if self.best_us and self.default_us:
            return self.default_us / self.best_us
        return None

    def summary(self) -> dict[str, Any]:
        return {"m": self.m, "best": self.best, "best_us": self.best_us,
                "default": self.default, "default_us": self.default_us,
                "speedup": self.speedup, "timed": self.timed, "failed": self.failed,
                "pruned": self.pruned, "seconds": round(self.seconds, 1)}


def _time(timer: KernelTimer, config: KernelConfig, m: int, iters: int,
          phase: str) -> Candidate:
    try:
        us = float(timer(config, m, iters=iters))
    except KernelFailure as exc:
        return Candidate(m, dict(config), phase, reason=exc.reason, message=exc.message)
    if not math.isfinite(us) or us <= 0:
        return Candidate(m, dict(config), phase, reason="error",
                         message=f"the timer returned {us!r} us")
    return Candidate(m, dict(config), phase, us=us)


def _sampler(seed: int) -> Any:
    import optuna

    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=12,
                                      constant_liar=False)


def _recheck(timer: KernelTimer, m: int, leaders: Sequence[KernelConfig],
             default: KernelConfig, s: SearchSettings, out: list[Candidate]
             ) -> dict[str, float]:
    """Time the leaders and the default again (interleaved); canonical key -> us."""
    times: dict[str, float] = {}
    for config in [default, *leaders]:
        key = repr(sorted(config.items()))
        if key in times:
            continue
        c = _time(timer, config, m, s.recheck_iters, "recheck")
        out.append(c)
        if c.us is not None:
            times[key] = c.us
    return times


def search_size(m: int, shape: MoeShape, timer: KernelTimer, *,
                settings: SearchSettings | None = None, deadline: float | None = None,
                warm: Sequence[KernelConfig] = (),
                on_candidate: Callable[[Candidate], None] | None = None) -> SizeResult:
    """Search the best config for ``m`` tokens (until ``settings.trials`` configs are
    timed or the monotonic ``deadline`` passes), then re-check the leaders."""
    import optuna
    from optuna.trial import TrialState

    s = settings or SearchSettings()
    t0 = time.monotonic()
    default = canonical(default_config(m, shape), m, shape)
    result = SizeResult(m=m, best=default, best_us=None, default=default, default_us=None)
    seen: dict[str, Candidate] = {}

    def record(c: Candidate) -> None:
        result.candidates.append(c)
        if on_candidate is not None:
            on_candidate(c)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=_sampler(s.seed))
    dists: dict[str, optuna.distributions.BaseDistribution] = {
        k: optuna.distributions.CategoricalDistribution(list(v)) for k, v in GRID.items()}
    for config in [default, *warm]:
        study.enqueue_trial(dict(config), skip_if_exists=True)
    asks = 0
    while result.timed < s.trials and asks < s.max_asks:
        if deadline is not None and time.monotonic() > deadline and result.timed > 0:
            break
        asks += 1
        trial = study.ask(dists)
        config = {k: int(trial.params[k]) for k in KEYS}
        why = prune_reason(config, m, shape, s.smem_limit)
        if why is not None:
            result.pruned += 1
            study.tell(trial, state=TrialState.PRUNED)
            continue
        key = repr(sorted(canonical(config, m, shape).items()))
        if key not in seen:
            c = _time(timer, canonical(config, m, shape), m, s.search_iters,
                      "default" if not seen else "search")
            seen[key] = c
            result.timed += 1
            result.failed += c.us is None
            record(c)
        c = seen[key]
        if c.us is None:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, c.us)
    ranked = sorted((c for c in seen.values() if c.us is not None), key=lambda c: c.us or 0.0)
    leaders = [c.config for c in ranked[: s.recheck]]
    rechecked: list[Candidate] = []
    times = _recheck(timer, m, leaders, default, s, rechecked) if ranked else {}
    for c in rechecked:
        record(c)
    result.default_us = times.get(repr(sorted(default.items())))
    if times:
        best_key = min(times, key=lambda k: times[k])
        result.best = next(c.config for c in rechecked
                           if repr(sorted(c.config.items())) == best_key)
        result.best_us = times[best_key]
    result.seconds = time.monotonic() - t0
    logger.info("m=%d: %d timed, %d failed, %d pruned; best %s us (default %s us)", m,
                result.timed, result.failed, result.pruned, result.best_us, result.default_us)
    return result
