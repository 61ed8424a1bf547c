"""Judging a trial's outcome: its objective values, constraints, pruning and the
re-checks of the leaders, told to Optuna.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from autotune.config import SLO_KEYS, TuneSettings
from autotune.store import (
    STOPPED,
    A,
    FailureReason,
    State,
    best_trial,
    interval_keys,
    mark_failed,
    objective_metric,
    primary,
    readings,
    server_gpus_of,
    set_constraints,
)
from autotune.trial import TrialOutcome

if TYPE_CHECKING:

    import optuna
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

    from autotune.quality import QualityThresholds
from autotune.study._gputime import trial_time

logger = logging.getLogger(__name__)


def _metric(t: optuna.Trial | FrozenTrial | None, key: str) -> float | None:
    """A trial's measured metric, None when the trial or the figure is missing."""
    value = (t.user_attrs.get(A.METRICS) or {}).get(key) if t is not None else None
    return float(value) if isinstance(value, (int, float)) else None


def _per_gpu_metric(t: optuna.Trial | FrozenTrial | None, key: str) -> float | None:
    value = _metric(t, key)
    return None if value is None else value / server_gpus_of(t)


def _slo_violation(metrics: dict[str, float], settings: TuneSettings) -> float:
    return max((metrics.get(SLO_KEYS[k], math.inf) / limit - 1.0
                for k, limit in settings.measure.slo.items()), default=-1.0)


def _why_infeasible(outcome: TrialOutcome, settings: TuneSettings, slo: float, err: float,
                    quality: float) -> str:
    m = outcome.metrics
    why = []
    if slo > 0:
        why.append("missed the SLOs: " + ", ".join(
            f"{k}={m.get(SLO_KEYS[k], float('nan')):.3g}s>{limit:g}s"
            for k, limit in settings.measure.slo.items() if m.get(SLO_KEYS[k], math.inf) > limit))
    if err > 0:
        rm = outcome.measurement
        errors = dict((rm.get("errors") if rm is not None else None) or {})
        total = sum(errors.values()) or 1
        kinds = ", ".join(f"{k} {n / total:.0%}"
                          for k, n in sorted(errors.items(), key=lambda kv: -kv[1]))
        bar = settings.measure.max_error_rate
        why.append(f"error rate {m.get('error_rate', 0):.1%} > {bar:.1%}"
                   + (f" (failed requests: {kinds})" if kinds else ""))
    if quality > 0:
        q = outcome.quality
        why.append(f"quality below --quality {settings.quality}: " + (
            f"agreement {q.get('exact_match_rate', float('nan')):.1%}" if q
            else outcome.quality_note or "no quality figures"))
    return "; ".join(why)


def _record_outcome(trial: optuna.Trial, outcome: TrialOutcome) -> None:
    trial.set_user_attr(A.WALL_S, round(outcome.wall_s, 2))
    if outcome.node_id:
        trial.set_user_attr(A.NODE, outcome.node_id)
    if outcome.gpus:
        trial.set_user_attr(A.GPUS, list(outcome.gpus))
    if outcome.start_s is not None:
        trial.set_user_attr(A.START_S, round(outcome.start_s, 2))
    if outcome.log_path:
        trial.set_user_attr(A.LOG, outcome.log_path)
    if outcome.metrics:
        trial.set_user_attr(A.METRICS, outcome.metrics)
    errors = outcome.measurement.get("errors") if outcome.measurement is not None else None
    if errors:
        trial.set_user_attr(A.REQUEST_ERRORS, dict(errors))
    if outcome.warmup is not None:
        trial.set_user_attr(A.WARMUP, outcome.warmup)
    if outcome.capacity is not None:
        trial.set_user_attr(A.CAPACITY, outcome.capacity)
    if outcome.coarse is not None:  # screen, then refine: rung 0 stopped, 1 promoted
        trial.set_user_attr(A.SCREEN, dict(outcome.coarse))
        trial.set_user_attr(A.RUNG, 0 if outcome.screened else 1)
    trial.set_user_attr(A.TIME, trial_time(outcome))


def _report_segments(trial: optuna.Trial, outcome: TrialOutcome, settings: TuneSettings) -> None:
    """Segment rates as Optuna intermediate values (single-objective studies only)."""
    if settings.objective == "pareto":
        return
    for step, rate in enumerate(outcome.segments):
        if math.isfinite(rate):
            trial.report(float(rate) / server_gpus_of(trial), step)


def _mark_pruned(trial: optuna.Trial, outcome: TrialOutcome) -> None:
    """A clear loser the pruner stopped: feasible constraints, state and reason pruned (a
    capacity trial's message gives its bound and the incumbent's, from the trial)."""
    lo = outcome.metrics.get("output_tokens_per_s_ci_low", math.nan)
    hi = outcome.metrics.get("output_tokens_per_s_ci_high", math.nan)
    trial.set_user_attr(A.STATE, State.PRUNED)
    trial.set_user_attr(A.REASON, FailureReason.PRUNED)
    trial.set_user_attr(A.MESSAGE, outcome.message if outcome.capacity is not None else (
        f"stopped after {len(outcome.segments)} segments: its 95 % interval "
        f"[{lo:,.1f}, {hi:,.1f}] out tok/s lay below the incumbent's"))
    set_constraints(trial, failed=0.0, slo=0.0, errors=0.0, quality=0.0)


def _mark_screened(trial: optuna.Trial, outcome: TrialOutcome) -> None:
    """A trial stopped at its coarse reading (rung 0): feasible constraints, state and
    reason screened; its coarse reading is ``autotune.screen``, never a verdict's."""
    c = outcome.coarse
    trial.set_user_attr(A.STATE, State.SCREENED)
    trial.set_user_attr(A.REASON, FailureReason.SCREENED)
    trial.set_user_attr(A.MESSAGE, outcome.message if outcome.capacity is not None else (
        f"screened after {len(outcome.segments)} segments: its coarse reading "
        f"{c['value']:,.1f} [{c['ci_low']:,.1f}, {c['ci_high']:,.1f}] out tok/s was not "
        f"among the leaders (bar {c['bar']:,.1f})" if c is not None else "screened"))
    set_constraints(trial, failed=0.0, slo=0.0, errors=0.0, quality=0.0)


def _per_gpu(trial: optuna.Trial, outcome: TrialOutcome, key: str) -> float | None:
    """The objective per GPU (the server's figure / its GPUs, ``autotune.server_gpus``), so
    that configs of different GPU counts compare on what they cost; kept beside the
    server's figures as ``server_gpus`` and ``<metric>_per_gpu``."""
    value = outcome.metrics.get(key)
    if value is None:
        return None
    n = server_gpus_of(trial)
    outcome.metrics["server_gpus"] = float(n)
    outcome.metrics[f"{key}_per_gpu"] = value / n
    return value / n


def _no_capacity(trial: optuna.Trial, outcome: TrialOutcome
                 ) -> tuple[float, str, str | None]:
    """A capacity trial whose every load level missed the SLOs: infeasible (reason slo),
    told with the upper bound of its capacity (the lowest rate tried) as its value."""
    high = outcome.metrics.get("capacity_rps_ci_high", 0.0) / server_gpus_of(trial)
    set_constraints(trial, failed=0.0, slo=1.0, errors=0.0, quality=0.0)
    trial.set_user_attr(A.STATE, State.INFEASIBLE)
    trial.set_user_attr(A.REASON, FailureReason.SLO)
    trial.set_user_attr(A.MESSAGE, outcome.message or "no load level met the SLOs")
    return float(high), State.INFEASIBLE, FailureReason.SLO


def judge(trial: optuna.Trial, outcome: TrialOutcome, settings: TuneSettings, *,
          thresholds: QualityThresholds | None = None,
          lossy: bool = False) -> tuple[float | list[float] | None, str, str | None]:
    """Set the trial's attributes and constraints from the outcome; return (value(s) to
    tell, state, reason). Value None: the trial failed or the pruner stopped it (told
    PRUNED)."""
    value = _per_gpu(trial, outcome, objective_metric(settings.objective))
    _record_outcome(trial, outcome)
    _report_segments(trial, outcome, settings)
    if outcome.ok and outcome.pruned:
        _mark_pruned(trial, outcome)
        return None, State.PRUNED, FailureReason.PRUNED
    if outcome.ok and outcome.screened:
        _mark_screened(trial, outcome)
        return None, State.SCREENED, FailureReason.SCREENED
    if outcome.ok and outcome.capacity is not None and value is None:
        return _no_capacity(trial, outcome)
    if not outcome.ok or value is None or not math.isfinite(value):
        msg = outcome.message or "no measurement"
        if outcome.log_tail and outcome.reason not in (None, FailureReason.INTERRUPTED):
            msg += "\n--- server log tail ---\n" + outcome.log_tail[-1500:]
        reason = outcome.reason or FailureReason.NO_MEASUREMENT
        mark_failed(trial, reason, msg)
        return None, State.FAILED, reason
    # capacity: the SLOs are the objective's own bar (every passing level met them)
    slo_violation = (-1.0 if settings.objective == "capacity"
                     else _slo_violation(outcome.metrics, settings))
    err_violation = outcome.metrics.get("error_rate", 0.0) - settings.measure.max_error_rate
    q_violation = 0.0
    if outcome.quality is not None:
        trial.set_user_attr(A.QUALITY, outcome.quality)
    elif lossy and outcome.quality_note:
        trial.set_user_attr(A.QUALITY_NOTE, outcome.quality_note)
    if thresholds is not None and lossy:
        from autotune.quality import QualityReport, quality_violation

        q_violation = (quality_violation(QualityReport.model_validate(outcome.quality), thresholds)
                       if outcome.quality is not None else 1.0)  # unknown quality: not accepted
    set_constraints(trial, failed=0.0, slo=min(slo_violation, 1e6), errors=err_violation,
                    quality=q_violation)
    values: float | list[float] = float(value)
    if settings.objective == "pareto":
        latency = outcome.metrics.get(SLO_KEYS[settings.pareto_latency])
        if latency is None or not math.isfinite(latency):
            mark_failed(trial, FailureReason.NO_MEASUREMENT,
                        f"no {settings.pareto_latency} reading for the Pareto objective")
            return None, State.FAILED, FailureReason.NO_MEASUREMENT
        values = [float(value), float(latency)]
    if slo_violation <= 0 and err_violation <= 0 and q_violation <= 0:
        trial.set_user_attr(A.STATE, State.OK)
        return values, State.OK, None
    reason = (FailureReason.SLO if slo_violation > 0
              else FailureReason.ERRORS if err_violation > 0 else FailureReason.QUALITY)
    trial.set_user_attr(A.STATE, State.INFEASIBLE)
    trial.set_user_attr(A.REASON, reason)
    trial.set_user_attr(A.MESSAGE, _why_infeasible(outcome, settings, slo_violation,
                                                   err_violation, q_violation))
    return values, State.INFEASIBLE, reason


def _commit_tell(study: optuna.Study, trial: optuna.Trial, value: float | list[float] | None,
                 *, fail: bool = False) -> None:
    """Finish the trial in the storage: COMPLETE with a value, else PRUNED (infeasible) or FAIL."""
    from optuna.trial import TrialState

    if value is not None:
        study.tell(trial, value)
    else:
        study.tell(trial, state=TrialState.FAIL if fail else TrialState.PRUNED)


def _finished_elsewhere(study: optuna.Study, trial: optuna.Trial) -> str | None:
    """The reason recorded on a trial another tuner finished meanwhile (failed it as stale:
    this tuner's heartbeats lapsed); None while it is still this tuner's to tell."""
    stored = study._storage.get_trial(trial._trial_id)
    if not stored.state.is_finished():
        return None
    return str(stored.user_attrs.get(A.REASON) or FailureReason.STALE)


def _enqueue_rechecks(study: optuna.Study, k: int, starts: int = 2) -> int:
    """Enqueue ``starts`` fresh-server readings of the top ``k`` configs and of the
    defaults, interleaved (round by round: leaders first, defaults last), less those a
    resumed study already has. Returns how many were enqueued: none when no config but the
    defaults was measured feasible (the verdict is then the defaults' whatever fresh starts
    of them read, so they would spend GPU time on nothing)."""
    from optuna.trial import TrialState

    groups = readings(study)
    base = next((ts for ts in groups.values() if ts[0].user_attrs.get(A.BASELINE)), None)
    ranked = sorted((ts for ts in groups.values() if ts is not base),
                    key=lambda ts: max(primary(t) for t in ts), reverse=True)
    if not ranked:
        return 0
    chosen = ranked[:k] + ([base] if base is not None else [])
    have: dict[int, int] = {}
    for t in study.get_trials(deepcopy=False):
        of = t.user_attrs.get(A.RECHECK_OF)
        if of is not None and not (t.state == TrialState.FAIL
                                   and t.user_attrs.get(A.REASON) in STOPPED):
            have[int(of)] = have.get(int(of), 0) + 1
    n = 0
    for round_ in range(starts):
        for ts in chosen:
            first = min(ts, key=lambda t: t.number)
            if have.get(first.number, 0) > round_:
                continue
            attrs: dict[str, object] = {A.RECHECK_OF: first.number}
            if first.user_attrs.get(A.BASELINE):
                attrs[A.BASELINE] = True
            study.enqueue_trial(dict(first.params), user_attrs=attrs)
            n += 1
    return n


def _skip_waiting(study: optuna.Study, storage: BaseStorage) -> list[int]:
    """Queued (WAITING) search configs left when the search ended: FAIL them with reason
    ``budget`` so the re-check phase, which asks for the next queued trial, runs only its
    own; like a stopped trial they do not count, and ``--resume`` runs them again."""
    from optuna.trial import TrialState

    study_id = storage.get_study_id_from_name(study.study_name)
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if t.user_attrs.get(A.RECHECK_OF) is not None:
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        if not storage.set_trial_state_values(trial_id, state=TrialState.RUNNING):
            continue  # taken meanwhile
        storage.set_trial_user_attr(trial_id, A.STATE, State.FAILED)
        storage.set_trial_user_attr(trial_id, A.REASON, FailureReason.BUDGET)
        storage.set_trial_user_attr(trial_id, A.MESSAGE,
                                    "the time budget ended the search first")
        storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
        out.append(t.number)
    return out


def _incumbent_low(study: optuna.Study, settings: TuneSettings, trial: optuna.Trial
                   ) -> float | None:
    """The pruner's bar for a new trial: the low end of the incumbent's interval (output
    tokens/s), or of its capacity bracket (req/s: a capacity trial stops once a level
    fails below it).

    Passed in with the trial (it runs in a Ray worker; no storage round-trip mid-trial).
    None (never pruned) for the defaults, re-check trials, studies that maximise neither
    throughput nor capacity, and ``--pruner none``."""
    if (settings.pruner == "none" or settings.objective not in ("throughput", "capacity")
            or trial.user_attrs.get(A.BASELINE) or trial.user_attrs.get(A.RECHECK_OF) is not None):
        return None
    best = best_trial(study)
    low = _metric(best, interval_keys(settings.objective)[0])
    # per GPU: the bar of a trial on n GPUs is n x the incumbent's low end per GPU
    return None if low is None else low / server_gpus_of(best) * server_gpus_of(trial)
