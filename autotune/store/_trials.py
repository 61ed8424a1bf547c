"""Reading trials back: constraints, feasibility, the primary value, the baseline and
the best trial, how many trials count toward ``--trials``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optuna.study import Study
    from optuna.trial import BaseTrial, FrozenTrial
from autotune.store._keys import N_CONSTRAINTS, STOPPED, A, FailureReason, State

logger = logging.getLogger(__name__)


def constraints(trial: BaseTrial) -> list[float]:
    """Constraint values of a finished trial (> 0 = violated)."""
    return [float(v) for v in (getattr(trial, "constraints", None) or {}).values()] or list(
        trial.user_attrs.get(A.CONSTRAINTS, [0.0] * N_CONSTRAINTS)
    )


def set_constraints(trial: BaseTrial, *, failed: float, slo: float, errors: float,
                    quality: float = 0.0) -> None:
    """Record constraint values (Optuna's samplers treat any value > 0 as infeasible)."""
    values = {"failed": failed, "slo": slo, "errors": errors, "quality": quality}
    for key, value in values.items():
        trial.set_constraint(key, float(value))
    trial.set_user_attr(A.CONSTRAINTS, list(values.values()))


def mark_failed(trial: BaseTrial, reason: str, message: str) -> None:
    """A trial with no measurement: state failed, its reason, and the failed constraint."""
    trial.set_user_attr(A.STATE, State.FAILED)
    trial.set_user_attr(A.REASON, reason)
    trial.set_user_attr(A.MESSAGE, message[:4000])
    set_constraints(trial, failed=1.0, slo=0.0, errors=0.0, quality=0.0)


def is_prior(t: BaseTrial) -> bool:
    """A trial copied from an earlier study by a warm start (measured under another shape)."""
    return A.PRIOR in t.user_attrs


def server_gpus_of(t: BaseTrial | None) -> int:
    """GPUs one server of a trial's config uses (1 for trials stored before autotune
    counted them, and for no trial). Every per-GPU figure of a study divides a server's
    figure by this."""
    if t is None:
        return 1
    try:
        return max(1, int(t.user_attrs.get(A.SERVER_GPUS) or 1))
    except (TypeError, ValueError):
        return 1


def primary(t: FrozenTrial) -> float:
    """The objective value (the first one for a Pareto study: throughput or goodput)."""
    return float(t.values[0])


def feasible(t: FrozenTrial) -> bool:
    """A measured trial of this study that met every constraint.

    COMPLETE, not a prior, a finite value, and state ``ok`` (trials written before
    autotune recorded a state: every constraint <= 0)."""
    from optuna.trial import TrialState

    if t.state != TrialState.COMPLETE or is_prior(t) or not t.values:
        return False
    if not math.isfinite(t.values[0]):
        return False
    state = t.user_attrs.get(A.STATE)
    if state is not None:
        return bool(state == State.OK)
    return all(c <= 0 for c in constraints(t))


def config_key(t: FrozenTrial) -> str:
    """Trials with the same key ran the same engine config."""
    return json.dumps({"baseline": bool(t.user_attrs.get(A.BASELINE)), "params": t.params},
                      sort_keys=True, default=str)


def mlflow_run(study: Study, t: FrozenTrial) -> str | None:
    """The MLflow run id of a trial (kept on the study: the trial is final when it is logged)."""
    rid = study.user_attrs.get(f"{A.MLFLOW_RUN}.{t.number}") or t.user_attrs.get(A.MLFLOW_RUN)
    return str(rid) if rid else None


def n_finished(study: Study) -> int:
    """Trials that count toward ``--trials``: measured or failed by their config (not
    rejected samples or samples steered away as predicted failures, not priors copied
    from another study, not trials the tuner's own death or interruption stopped)."""
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=done)
               if t.user_attrs.get(A.REASON) not in (FailureReason.REJECTED,
                                                     FailureReason.PREDICTED)
               and not (t.state == TrialState.FAIL and t.user_attrs.get(A.REASON) in STOPPED)
               and not is_prior(t))


def rung_counts(trials: Iterable[FrozenTrial]) -> dict[str, int]:
    """Screen, then refine (autotune.study): ``{"screened": trials stopped at rung 0,
    "refined": trials promoted to full resolution}`` over a study's own trials that had a
    coarse reading; empty when none had (``--no-screen``, an objective never screened)."""
    counts = {"screened": 0, "refined": 0}
    for t in trials:
        rung = t.user_attrs.get(A.RUNG)
        if rung is not None and not is_prior(t):
            counts["screened" if rung == 0 else "refined"] += 1
    return counts if any(counts.values()) else {}


def failures_by_reason(trials: Iterable[FrozenTrial]) -> dict[str, int]:
    """Reason -> count over the failed and infeasible trials."""
    reasons: dict[str, int] = {}
    for t in trials:
        if t.user_attrs.get(A.STATE) in (State.FAILED, State.INFEASIBLE, State.PRUNED):
            r = str(t.user_attrs.get(A.REASON, "unknown"))
            reasons[r] = reasons.get(r, 0) + 1
    return reasons


def best_trial(study: Study) -> FrozenTrial | None:
    """The feasible trial with the best single reading (for progress displays)."""
    trials = [t for t in study.get_trials(deepcopy=False) if feasible(t)]
    return max(trials, key=primary) if trials else None


def baseline_trial(study: Study) -> FrozenTrial | None:
    """The first measured trial of vLLM's defaults."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(A.BASELINE) and t.state == TrialState.COMPLETE:
            return t
    return None


def readings(study: Study) -> dict[str, list[FrozenTrial]]:
    """Feasible measured trials of this study grouped by config (rechecks included)."""
    groups: dict[str, list[FrozenTrial]] = {}
    for t in study.get_trials(deepcopy=False):
        if feasible(t):
            groups.setdefault(config_key(t), []).append(t)
    return groups
