"""A study's GPU budget (``--budget 2h``): what fits in it, planned before trial 0 from
what a server start has cost on this engine and hardware, and what the study spent, by
phase. The planner is pure; :func:`prior_trial_seconds` reads the store.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from autotune.store import A

if TYPE_CHECKING:
    from collections.abc import Iterator

    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

    from autotune.trial import TrialOutcome

logger = logging.getLogger(__name__)

#: A trial's GPU-seconds before any was measured on this engine and hardware: a cold start
#: on a GPU takes 2-5 minutes and its warm-up and measurement 1-3 more; a CPU trial on a
#: tiny model about a minute.
FIRST_GUESS_S = {"gpu": 360.0, "cpu": 60.0}

Phase = Literal["starts", "warmup", "measuring", "other", "screened", "pruned", "recheck"]
PHASES: tuple[Phase, ...] = ("starts", "warmup", "measuring", "other", "screened", "pruned",
                             "recheck")


@dataclass(frozen=True)
class TrialCost:
    """What one trial (one server start) costs: its GPU-seconds and where the figure comes
    from (``trials`` earlier trials of the same engine and hardware, or a first guess)."""

    seconds: float
    trials: int = 0
    studies: int = 0

    def source(self) -> str:
        if not self.trials:
            return "a first guess: no trial on this engine and hardware in the store yet"
        return (f"the median of {self.trials} earlier trial(s) of {self.studies} stud"
                f"{'y' if self.studies == 1 else 'ies'} on this engine and hardware")


@dataclass(frozen=True)
class BudgetPlan:
    """What fits in a GPU budget: ``starts`` server starts in all, ``recheck`` of them the
    re-check's, the rest (``trials``) the search's, at ``cost`` a trial."""

    budget_s: float
    cost: TrialCost
    starts: int
    trials: int
    recheck: int
    asked: int  # --trials

    def line(self) -> str:
        """The plan as the study's first lines say it."""
        hours = self.budget_s / 3600
        amount = (f"{hours:.3g} GPU-hour{'s' if hours != 1 else ''}" if hours >= 1
                  else f"{self.budget_s / 60:.3g} GPU-minutes")
        text = (f"budget: about {self.trials} trials and {self.starts} server starts fit in "
                f"{amount} at about {self.cost.seconds:.0f} s a start ({self.cost.source()}")
        text += f"; {self.recheck} of the starts re-check the leaders)" if self.recheck else ")"
        if self.trials < self.asked:
            text += (f"; --trials {self.asked} will not all fit: the search stops when the "
                     "budget would not hold the next trial and the re-check")
        elif self.trials > self.asked:
            text += f"; --trials {self.asked} ends the search first"
        return text


def plan_budget(*, budget_s: float, cost: TrialCost, trials: int, recheck: int,
                recheck_starts: int, gpus_per_trial: int = 1) -> BudgetPlan:
    """The plan for ``budget_s`` GPU-seconds: as many starts as fit at ``cost.seconds`` a
    trial on ``gpus_per_trial`` GPUs (at least 1), the re-check's
    (``(recheck + 1) x recheck_starts``: the leaders and the defaults) first, the search's
    the rest; ``trials`` (``--trials``) is said beside it, not clipped."""
    per = max(1e-9, cost.seconds) * max(1, gpus_per_trial)
    starts = math.floor(budget_s / per + 1e-9)
    re = min(starts, (recheck + 1) * recheck_starts if recheck else 0)
    return BudgetPlan(budget_s=budget_s, cost=cost, starts=starts, trials=starts - re,
                      recheck=re, asked=trials)


def trial_gpu_seconds(outcome: TrialOutcome, server_gpus: int = 1) -> float:
    """The GPU-seconds a finished trial spent: its wall time on each of its GPUs (a CPU
    trial counts as one)."""
    n = len(outcome.gpus) if outcome.gpus else max(1, server_gpus)
    return max(0.0, outcome.wall_s) * n


def same_engine_trials(storage: BaseStorage, *, engine: str, gpu: str,
                       exclude: str | None = None) -> Iterator[list[FrozenTrial]]:
    """The trials of each study in ``storage`` recorded with this engine version and
    hardware (``autotune.engine_version``, ``autotune.gpu_type``), study ``exclude`` left
    out: what a study learns from before its first trial."""
    import optuna

    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        attrs = summary.user_attrs
        if (summary.study_name == exclude or attrs.get(A.ENGINE) != engine
                or attrs.get(A.GPU) != gpu):
            continue
        study_id = storage.get_study_id_from_name(summary.study_name)
        yield storage.get_all_trials(study_id, deepcopy=False)


def prior_trial_seconds(storage: BaseStorage, *, engine: str, gpu: str,
                        device: str) -> TrialCost:
    """A trial's seconds (per GPU) on this engine and hardware: the median of the trials
    of the store's studies recorded with the same engine and hardware
    (:func:`same_engine_trials`; their ``autotune.time``), else :data:`FIRST_GUESS_S`."""
    seconds: list[float] = []
    studies = 0
    for trials in same_engine_trials(storage, engine=engine, gpu=gpu):
        got = 0
        for t in trials:
            time_rec = t.user_attrs.get(A.TIME)
            if not isinstance(time_rec, dict) or t.user_attrs.get(A.PRIOR):
                continue
            total = sum(float(time_rec.get(k) or 0.0)
                        for k in ("start_s", "warmup_s", "measure_s", "other_s"))
            if total > 0:
                seconds.append(total)
                got += 1
        studies += got > 0
    if not seconds:
        return TrialCost(FIRST_GUESS_S["gpu" if device == "cuda" else "cpu"])
    return TrialCost(statistics.median(seconds), trials=len(seconds), studies=studies)


class PhaseAccount:
    """GPU-seconds a study spent, by phase: a search trial measured to its end splits into
    ``starts`` (failed starts too), ``warmup``, ``measuring`` and ``other`` (stop, quality
    probe); a trial stopped at a coarse fidelity is ``screened``, one the pruner stopped
    ``pruned`` (and ``pruned_saved``: what its full measurement would have cost, at the
    search's mean), a re-check trial ``recheck``, each whole."""

    def __init__(self, budget_s: float | None = None) -> None:
        self.budget_s = budget_s
        self.spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.pruned_saved = 0.0
        self._full: list[float] = []  # GPU-seconds of search trials measured to the end
        self._n = 0

    @property
    def total(self) -> float:
        return sum(self.spent.values())

    def mean_trial(self) -> float | None:
        """The mean GPU-seconds of the trials so far (None before the first)."""
        return self.total / self._n if self._n else None

    def add(self, outcome: TrialOutcome, *, kind: Literal["search", "screened", "pruned",
                                                          "recheck"],
            server_gpus: int = 1) -> None:
        g = trial_gpu_seconds(outcome, server_gpus)
        self._n += 1
        if kind != "search":
            self.spent[kind] += g
            if kind == "pruned" and self._full:
                self.pruned_saved += max(0.0, statistics.mean(self._full) - g)
            return
        n = g / outcome.wall_s if outcome.wall_s > 0 else 1.0
        start = float(outcome.start_s or 0.0)
        other = max(0.0, outcome.wall_s - start - outcome.warmup_s - outcome.measure_s)
        self.spent["starts"] += start * n
        self.spent["warmup"] += outcome.warmup_s * n
        self.spent["measuring"] += outcome.measure_s * n
        self.spent["other"] += other * n
        if outcome.ok:
            self._full.append(g)

    def record(self) -> dict[str, float]:
        """``autotune.gpu_phases``: seconds by phase, the total and the pruned trials'
        saving."""
        out = {k: round(v, 1) for k, v in self.spent.items()}
        out["total"] = round(self.total, 1)
        out["pruned_saved"] = round(self.pruned_saved, 1)
        if self.budget_s is not None:
            out["budget_s"] = round(self.budget_s, 1)
        return out


def merge_phases(earlier: dict[str, float] | None, now: dict[str, float]) -> dict[str, float]:
    """A resumed study's account: what earlier sessions recorded plus this one's (the
    budget is this session's)."""
    out = dict(earlier or {})
    for k, v in now.items():
        out[k] = v if k == "budget_s" else round(float(out.get(k, 0.0)) + v, 1)
    return out


def phases_line(phases: dict[str, float], budget_s: float | None = None) -> str:
    """``GPU-seconds by phase: starts 1,200, warm-up 300, ...`` for the study's summary."""
    names = {"starts": "starts", "warmup": "warm-up", "measuring": "measuring",
             "other": "other", "screened": "screened", "pruned": "pruned",
             "recheck": "re-check"}
    parts = ", ".join(f"{label} {phases.get(k, 0.0):,.0f}" for k, label in names.items())
    total = phases.get("total", sum(phases.get(k, 0.0) for k in names))
    text = f"GPU-seconds by phase: {parts} (total {total:,.0f} = {total / 3600:.2f} GPU-hours"
    budget_s = budget_s if budget_s is not None else phases.get("budget_s")
    if budget_s:
        text += f" of a {budget_s / 3600:.3g} GPU-hour budget"
    text += ")"
    if phases.get("pruned_saved"):
        text += (f"; pruned trials saved about {phases['pruned_saved']:,.0f} GPU-seconds "
                 "against measuring them to the end")
    return text
