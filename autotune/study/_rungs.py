"""Screen, then refine: the rungs of a study (successive halving over fidelity).

Rung 0 is a coarse reading of each search trial on its own server (a throughput interval
within 3 x ``--precision``, a capacity bracket within 2x: :mod:`autotune.measure._screen`);
rung 1 is the full-resolution measurement, which only the leaders reach: a coarse reading
in the top 1/eta of the rung-0 readings so far, or whose interval still reaches the
incumbent. The others stop at rung 0 ("screened", told to Optuna as PRUNED with their
segments as intermediate values). The verdict and the re-check never see a screened
trial: they read feasible COMPLETE trials only.

Every rung's state is in the storage (``autotune.screen``, ``autotune.rung`` on each
trial), so a resumed study ranks its next trials against every coarse reading it has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from autotune.measure import ETA, Screen
from autotune.store import A, best_trial, is_prior, primary, server_gpus_of

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

    from autotune.config import TuneSettings

#: objectives a trial can be screened on: a throughput interval or a capacity bracket
SCREENED_OBJECTIVES = ("throughput", "capacity")


def rung0_readings(trials: Iterable[FrozenTrial]) -> list[float]:
    """The coarse readings (per GPU) of a study's own trials, screened or promoted."""
    out = []
    for t in trials:
        coarse = t.user_attrs.get(A.SCREEN)
        if not isinstance(coarse, dict) or is_prior(t):
            continue
        value = coarse.get("value")
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append(float(value) / server_gpus_of(t))
    return out


def promotion_bar(readings: list[float], eta: int = ETA) -> float:
    """The value a coarse reading must reach to be in the top 1/eta of ``readings``
    (-inf while there are fewer than ``eta``: the first trials are all promoted, and
    their coarse readings fill the rung)."""
    if len(readings) < eta:
        return -math.inf
    k = math.ceil(len(readings) / eta)
    return sorted(readings, reverse=True)[k - 1]


def screen_for(study: optuna.Study, settings: TuneSettings, trial: optuna.Trial, *,
               server_gpus: int = 1, phase: str = "search") -> Screen | None:
    """The screen of a new trial: the rung-0 bar and the incumbent, in this trial's
    server's units (``server_gpus`` x per GPU). None (measured to full resolution at once)
    with ``--no-screen``, for objectives other than throughput and capacity, for vLLM's
    defaults, re-check trials and outside the search phase."""
    if (not settings.screen or settings.objective not in SCREENED_OBJECTIVES
            or phase != "search" or trial.user_attrs.get(A.BASELINE)
            or trial.user_attrs.get(A.RECHECK_OF) is not None):
        return None
    bar = promotion_bar(rung0_readings(study.get_trials(deepcopy=False)))
    best = best_trial(study)
    incumbent = primary(best) * server_gpus if best is not None else None
    return Screen(bar=bar * server_gpus if math.isfinite(bar) else bar, incumbent=incumbent)


def rungs_line(counts: dict[str, int]) -> str:
    """``rungs: 12 screened at rung 0, 4 refined to full resolution`` ("" when no trial
    was screened)."""
    if not counts.get("screened") and not counts.get("refined"):
        return ""
    return (f"rungs: {counts.get('screened', 0)} screened at rung 0, "
            f"{counts.get('refined', 0)} refined to full resolution")
