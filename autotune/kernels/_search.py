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
round, so the winner is not a lucky reading. The winner goes in the file only when that
round shows it at least ``min_gain`` faster than the default (:func:`kept_default_reason`):
a kernel-level gain of a few percent is within what the model's own run can reverse
(measured on an H200 at M=64: 1.02x in the re-check, 1.39x slower per call in the model).

With a ``deadline`` (the share of a kernel budget a token count gets) the search stops
when the next timing and the re-check would not fit before it, and the re-check drops
leaders that would not fit (vLLM's default and the first leader are always re-checked).
What a timing costs is estimated by :class:`TimingCosts` from the timings so far: its
set-up (a Triton compile for a new config) plus its replays, which the microseconds read
give (:func:`replay_seconds`): a re-check at a large M costs seconds per config.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NotRequired, Protocol, TypedDict

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
from autotune.kernels._worker import GRAPH_CALLS, WARMUP_REPLAYS

if TYPE_CHECKING:
    from optuna.samplers import TPESampler

    from autotune.kernels._sizes import TokenCountRecord

__all__ = ["Candidate", "KernelFailure", "KernelTimer", "SearchSettings", "SizeResult", "SizeRow",
           "TimingCosts", "kept_default_reason", "replay_seconds", "search_size"]

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
    # the re-check's least speed-up (default_us / best_us >= 1 + min_gain) for the winner to
    # replace vLLM's default in the file; decides the verdict only, not what is timed
    min_gain: float = 0.03


def kept_default_reason(speedup: float | None, min_gain: float) -> str | None:
    """Why a token count whose re-check found a winner other than vLLM's default keeps the
    default in the file (``"1.020x below --min-gain 3%"``); None: the winner goes in. A
    default without a valid re-check time (None) cannot be compared: the winner, the
    only config known to run, goes in."""
    if speedup is None or speedup >= 1.0 + min_gain - 1e-9:
        return None
    # rounded down: 1.0299 is shown as 1.029x, not as "1.030x below 3%"
    shown = math.floor(speedup * 1000 + 1e-6) / 1000
    return f"{shown:.3f}x below --min-gain {min_gain * 100:g}%"


@dataclass
class Candidate:
    """One timed (or failed, or pruned) config at one token count."""

    m: int
    config: KernelConfig
    phase: str  # "default", "search", "recheck"
    us: float | None = None
    reason: str | None = None  # why it has no time: a failure or a pruning rule
    message: str = ""
    seconds: float | None = None  # wall time of the timing (set-up and replays)

    def row(self) -> dict[str, object]:
        return {"m": self.m, "phase": self.phase, **self.config,
                "us": self.us, "reason": self.reason, "message": self.message[:300]}


class SizeRow(TypedDict):
    """One token count in ``results.json`` (``sizes``): the verdict of :class:`SizeResult`,
    or only ``skipped`` (why it has no ``best``: the budget had no time for it)."""

    m: int
    best: KernelConfig | None
    best_us: NotRequired[float | None]
    default: NotRequired[KernelConfig]
    default_us: NotRequired[float | None]
    speedup: NotRequired[float | None]
    kept_default: NotRequired[str | None]
    timed: NotRequired[int]
    failed: NotRequired[int]
    pruned: NotRequired[int]
    seconds: NotRequired[float]
    skipped: NotRequired[str]
    traffic: NotRequired[TokenCountRecord]


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
    min_gain: float = 0.0  # the least speed-up for ``best`` to replace ``default`` in the file

    @property
    def speedup(self) -> float | None:
        """Default time / winner time from the re-check round (1.0: the default won), as
        measured: also when the file keeps the default (:attr:`kept_default`)."""
        if self.best_us and self.default_us:
            return self.default_us / self.best_us
        return None

    @property
    def kept_default(self) -> str | None:
        """Why the file holds vLLM's default although ``best`` won the re-check (None: the
        file holds ``best``)."""
        if self.best == self.default:
            return None
        return kept_default_reason(self.speedup, self.min_gain)

    @property
    def chosen(self) -> KernelConfig:
        """The config the file holds for this token count."""
        return self.default if self.kept_default else self.best

    def summary(self) -> SizeRow:
        return {"m": self.m, "best": self.best, "best_us": self.best_us,
                "default": self.default, "default_us": self.default_us,
                "speedup": self.speedup, "kept_default": self.kept_default,
                "timed": self.timed, "failed": self.failed,
                "pruned": self.pruned, "seconds": round(self.seconds, 1)}


def replay_seconds(us: float, iters: int) -> float:
    """Seconds one timing of ``iters`` replays runs the kernel at ``us`` per call: the
    worker calls it once (the compile run), then replays its CUDA graph of
    ``GRAPH_CALLS`` calls ``WARMUP_REPLAYS + iters`` times. Set-up is not included."""
    return ((iters + WARMUP_REPLAYS) * GRAPH_CALLS + 1) * us * 1e-6


class TimingCosts:
    """What timings have cost so far, over every token count and GPU (thread-safe): the
    estimates a budget needs before it starts a timing, a re-check or a token count.

    A timing's wall time is its set-up (Triton's compile of a config new to the worker,
    tensors, the graph capture), measured as what is left after its replays, plus its
    replays (:func:`replay_seconds` of the microseconds it read)."""

    def __init__(self, settings: SearchSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._setup: dict[str, list[float]] = {"search": [], "recheck": []}
        self._us: dict[int, float] = {}  # m -> vLLM's default's reading (else the first)

    def add(self, c: Candidate) -> None:
        """Account one finished timing (pruned configs and repeats cost nothing)."""
        if c.seconds is None:
            return
        recheck = c.phase == "recheck"
        iters = self.settings.recheck_iters if recheck else self.settings.search_iters
        replay = replay_seconds(c.us, iters) if c.us is not None else 0.0
        with self._lock:
            self._setup["recheck" if recheck else "search"].append(max(0.0, c.seconds - replay))
            if c.us is not None and (c.phase == "default" or c.m not in self._us):
                self._us[c.m] = c.us

    def us_at(self, m: int) -> float | None:
        """An upper bound of the kernel's microseconds per call at ``m`` tokens from the
        nearest count read: a smaller count's time scaled by the token ratio (the kernel's
        time grows at most linearly in M), else the smallest larger count's."""
        with self._lock:
            if not self._us:
                return None
            if m in self._us:
                return self._us[m]
            below = [k for k in self._us if k < m]
            if below:
                k = max(below)
                return self._us[k] * m / k
            return self._us[min(self._us)]

    def _mean_setup(self, kind: str) -> float | None:
        with self._lock:
            return statistics.fmean(self._setup[kind]) if self._setup[kind] else None

    def recheck_s(self, us: float) -> float:
        """Seconds one re-check timing at ``us`` per call costs (its set-up as measured,
        none before the first re-check: the config is compiled by then)."""
        return (self._mean_setup("recheck") or 0.0) + replay_seconds(
            us, self.settings.recheck_iters)

    def floor_s(self, m: int) -> float | None:
        """The least a token count of ``m`` costs: vLLM's default and one more config
        timed, both re-checked. None before any timing."""
        us, setup = self.us_at(m), self._mean_setup("search")
        if us is None or setup is None:
            return None
        return 2 * (setup + replay_seconds(us, self.settings.search_iters)) + 2 * self.recheck_s(us)


def _time(timer: KernelTimer, config: KernelConfig, m: int, iters: int, phase: str,
          clock: Callable[[], float] = time.monotonic) -> Candidate:
    t0 = clock()
    try:
        us = float(timer(config, m, iters=iters))
    except KernelFailure as exc:
        return Candidate(m, dict(config), phase, reason=exc.reason, message=exc.message,
                         seconds=clock() - t0)
    if not math.isfinite(us) or us <= 0:
        return Candidate(m, dict(config), phase, reason="error",
                         message=f"the timer returned {us!r} us", seconds=clock() - t0)
    return Candidate(m, dict(config), phase, us=us, seconds=clock() - t0)


def _sampler(seed: int) -> TPESampler:
    import optuna

    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=12,
                                      constant_liar=False)


def _key(config: KernelConfig) -> str:
    return repr(sorted(config.items()))


def _recheck(timer: KernelTimer, m: int, leaders: Sequence[KernelConfig],
             default: KernelConfig, s: SearchSettings, record: Callable[[Candidate], None],
             *, read: dict[str, float], costs: TimingCosts, deadline: float | None,
             clock: Callable[[], float]) -> dict[str, float]:
    """Time the default and the leaders again (interleaved); canonical key -> us. Past
    the first leader, a leader whose re-check (at its search reading ``read``) would end
    after the ``deadline`` is left out."""
    times: dict[str, float] = {}
    timed: set[str] = set()
    for config in [default, *leaders]:
        key = _key(config)
        if key in timed:
            continue
        us = read.get(key)
        if (deadline is not None and len(timed) >= 2 and us is not None
                and clock() + costs.recheck_s(us) > deadline):
            logger.info("m=%d: the deadline leaves %d leader(s) out of the re-check", m,
                        len(leaders) + 1 - len(timed))
            break
        timed.add(key)
        c = _time(timer, config, m, s.recheck_iters, "recheck", clock)
        record(c)
        if c.us is not None:
            times[key] = c.us
    return times


def _fits(clock: Callable[[], float], deadline: float, costs: TimingCosts, s: SearchSettings,
          seen: dict[str, Candidate], default_key: str) -> bool:
    """Whether one more search timing and then the re-check end before the deadline."""
    spent = [c.seconds for c in seen.values() if c.seconds is not None]
    next_s = statistics.fmean(spent) if spent else 0.0
    ok = sorted(c.us for c in seen.values() if c.us is not None)
    if not ok:
        return clock() + next_s <= deadline
    base = seen.get(default_key)
    us = max([*ok[: s.recheck], *([base.us] if base is not None and base.us else [])])
    # the default and the leaders after this timing; until a second config has a time,
    # only what the re-check cannot drop (the default and the first leader): a token count
    # is started only when that much fits (TimingCosts.floor_s)
    n = 1 + min(s.recheck, len(ok) + 1) if len(ok) >= 2 else 2
    return clock() + next_s + n * costs.recheck_s(us) <= deadline


def search_size(m: int, shape: MoeShape, timer: KernelTimer, *,
                settings: SearchSettings | None = None, deadline: float | None = None,
                warm: Sequence[KernelConfig] = (),
                on_candidate: Callable[[Candidate], None] | None = None,
                costs: TimingCosts | None = None,
                clock: Callable[[], float] = time.monotonic) -> SizeResult:
    """Search the best config for ``m`` tokens, then re-check the leaders: until
    ``settings.trials`` configs are timed or, with a ``deadline`` (a time of ``clock``),
    until one more timing and the re-check would end after it (vLLM's default is always
    timed). ``costs``: the timings of other token counts (shared by a tuning's GPUs)."""
    import optuna
    from optuna.trial import TrialState

    s = settings or SearchSettings()
    costs = costs or TimingCosts(s)
    t0 = clock()
    default = canonical(default_config(m, shape), m, shape)
    result = SizeResult(m=m, best=default, best_us=None, default=default, default_us=None,
                        min_gain=s.min_gain)
    seen: dict[str, Candidate] = {}

    def record(c: Candidate) -> None:
        result.candidates.append(c)
        costs.add(c)
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
        if (deadline is not None and result.timed > 0
                and not _fits(clock, deadline, costs, s, seen, _key(default))):
            break
        asks += 1
        trial = study.ask(dists)
        config = {k: int(trial.params[k]) for k in KEYS}
        why = prune_reason(config, m, shape, s.smem_limit)
        if why is not None:
            result.pruned += 1
            study.tell(trial, state=TrialState.PRUNED)
            continue
        key = _key(canonical(config, m, shape))
        if key not in seen:
            c = _time(timer, canonical(config, m, shape), m, s.search_iters,
                      "default" if not seen else "search", clock)
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
    read = {k: c.us for k, c in seen.items() if c.us is not None}
    times = (_recheck(timer, m, leaders, default, s, record, read=read, costs=costs,
                      deadline=deadline, clock=clock) if ranked else {})
    result.default_us = times.get(_key(default))
    if times:
        best_key = min(times, key=lambda k: times[k])
        result.best = next(c.config for c in result.candidates
                           if c.phase == "recheck" and _key(c.config) == best_key)
        result.best_us = times[best_key]
    result.seconds = clock() - t0
    logger.info("m=%d: %d timed, %d failed, %d pruned; best %s us (default %s us)%s", m,
                result.timed, result.failed, result.pruned, result.best_us, result.default_us,
                f"; keeps the default: {result.kept_default}" if result.kept_default else "")
    return result
