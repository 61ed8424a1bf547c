"""What a study stores in Optuna, and the rules every reader of a study applies to it.

The bottom of the study layer (Optuna's ``_constrained_optimization.py`` plays this part in
Optuna): :mod:`autotune.study` writes these attributes, :mod:`autotune.registry`,
:mod:`autotune.plots`, the experiments and the tests read them. It imports nothing of
autotune but :mod:`autotune.errors` and the pure :mod:`autotune.stats` (the verdict's
interval), so no reader needs the orchestrator.

How trials are stored:

* a measured trial is ``COMPLETE`` with the objective as its value and constraint values
  (failed, SLO, error-rate and quality violations; > 0 means infeasible) that the sampler
  learns from;
* a trial whose server failed (invalid flags, out of memory, crash, start timeout, ...) or
  whose sample broke a rule of the space is ``PRUNED`` with a constraint violation of 1 and
  the reason in ``user_attrs["autotune.reason"]``: the TPE sampler treats it as an
  infeasible point and learns to avoid the region; it is never scored as throughput 0;
* a trial the pruner stopped as a clear loser (its interval lay wholly below the
  incumbent's) is ``PRUNED`` with its segment rates as intermediate values, constraints
  of 0 and state and reason ``pruned``: TPE ranks pruned trials after every complete one,
  so the sampler learns that the region is worse than what it has, without a made-up
  value;
* a trial that was running when the tuner died is ``FAIL`` with reason ``tuner_died`` (or
  ``interrupted`` after SIGINT/SIGTERM); such a trial says nothing about its config, so it
  does not count toward ``--trials`` and ``--resume`` runs its config again; so is a
  queued config the time budget left unstarted (reason ``budget``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from autotune.errors import StudyError

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

__all__ = [
    "N_CONSTRAINTS",
    "STOPPED",
    "A",
    "FailureReason",
    "Judgement",
    "State",
    "Verdict",
    "baseline_trial",
    "best_trial",
    "config_key",
    "constraints",
    "fail_stopped_trials",
    "failures_by_reason",
    "feasible",
    "interval_keys",
    "is_prior",
    "judge_study",
    "latest_study",
    "mark_failed",
    "mlflow_run",
    "n_finished",
    "objective_label",
    "objective_metric",
    "open_storage",
    "pareto_front",
    "pareto_trials",
    "primary",
    "readings",
    "set_constraints",
    "sqlite_path",
    "study_objective",
    "verdict",
    "verdict_record",
]

logger = logging.getLogger(__name__)


class A(StrEnum):
    """Names of the user attributes autotune sets on Optuna trials and studies."""

    STATE = "autotune.state"  # a State: "ok" | "failed" | "infeasible"
    REASON = "autotune.reason"  # a FailureReason
    MESSAGE = "autotune.message"
    BASELINE = "autotune.baseline"
    ENQUEUED = "autotune.enqueued"  # a config given by the user or a warm start
    RECHECK_OF = "autotune.recheck_of"  # re-measurement of the config of that trial
    RETRY_OF = "autotune.retry_of"  # the config of that trial, stopped by the tuner's end
    PRIOR = "autotune.prior"  # a trial copied from an earlier study (warm start): not ours
    FLAGS = "autotune.flags"
    ENV = "autotune.env"
    METRICS = "autotune.metrics"
    CONSTRAINTS = "autotune.constraints"
    WALL_S = "autotune.wall_s"
    START_S = "autotune.start_s"
    LOG = "autotune.log_path"
    NODE = "autotune.ray_node_id"
    QUALITY = "autotune.quality"  # QualityReport of a probed (lossy) trial
    QUALITY_NOTE = "autotune.quality_note"
    REQUEST_ERRORS = "autotune.request_errors"  # failed requests by kind (stalled, timeout, ...)
    GPUS = "autotune.gpus"
    # --objective capacity: {"recorded_rps", "low", "high", "status", "capacity_rps",
    #   "ci_low_rps", "ci_high_rps", "levels": [{"scale", "offered_rps", "passed", ...}]}
    CAPACITY = "autotune.capacity"
    WARMUP = "autotune.warmup"  # {"seconds", "segments", "converged", "jit_in_last_segment"}
    TIME = "autotune.time"  # {"start_s", "warmup_s", "measure_s", "other_s", "slot"}
    MLFLOW_RUN = "autotune.mlflow_run_id"  # also "<this>.<trial number>" on the study
    # study attributes
    MODEL = "autotune.model"
    SHAPE = "autotune.shape_fingerprint"
    SHAPE_PATH = "autotune.shape_path"
    SPACE = "autotune.space"
    SPACE_PATH = "autotune.space_path"
    ENGINE = "autotune.engine_version"
    GPU = "autotune.gpu_type"
    SETTINGS = "autotune.settings"
    MLFLOW_PARENT = "autotune.mlflow_parent_run_id"
    VERDICT = "autotune.verdict"  # verdict_record(): {"verdict", "ratio_to_defaults", ...}
    GPU_TIME = "autotune.gpu_time"  # {slot: {"start_s", "warmup_s", "measure_s", "idle_s",
    #                                         "other_s"}}


class State(StrEnum):
    """``autotune.state`` of a finished trial."""

    OK = "ok"
    FAILED = "failed"  # no measurement: the config failed, or the tuner stopped it
    INFEASIBLE = "infeasible"  # measured, but missed the SLOs, error rate or quality bound
    PRUNED = "pruned"  # stopped early as a clear loser against the incumbent (the pruner)


class FailureReason(StrEnum):
    """Every ``autotune.reason`` a trial can carry (Optuna, MLflow, trials.csv, plots)."""

    # the server (engine/_vllm.py classifies its log and exit code)
    INVALID_CONFIG = "invalid_config"  # vLLM rejected the flags or their combination
    OOM = "oom"  # out of memory (GPU, CPU or KV cache too large for memory)
    CRASH = "crash"  # the server exited for another reason
    START_TIMEOUT = "start_timeout"  # /health never answered in time
    PORT_IN_USE = "port_in_use"  # the port was taken between choosing and binding it
    DIED = "died"  # the server died while it was being measured
    # the trial (trial.py, parallel.py)
    NO_OUTPUT = "no_output"  # the server answered no request
    INTERNAL_ERROR = "internal_error"  # a bug of autotune while running the trial
    WORKER_DIED = "worker_died"  # the Ray worker running the trial failed
    ABORTED = "aborted"  # stopped early: most requests failed (the message says why)
    # the study's verdict on a measurement
    NO_MEASUREMENT = "no_measurement"  # no finite objective (or Pareto latency) reading
    SLO = "slo"  # measured, but missed the SLOs
    ERRORS = "errors"  # measured, but too many requests failed
    QUALITY = "quality"  # measured, but below the --quality bound (or quality unknown)
    REJECTED = "rejected"  # never started: the search space's rules forbid the sample
    PRUNED = "pruned"  # the pruner stopped it: its interval lay below the incumbent's
    # the tuner stopped while the trial ran: says nothing about the config
    TUNER_DIED = "tuner_died"
    INTERRUPTED = "interrupted"
    BUDGET = "budget"  # queued, never started: the time budget ended the search first


#: Reasons that say nothing about the config: the tuner stopped while the trial ran (or
#: before a queued one started).
STOPPED = frozenset({FailureReason.TUNER_DIED, FailureReason.INTERRUPTED,
                     FailureReason.BUDGET})

N_CONSTRAINTS = 4  # [failed or rejected, SLO, error rate, quality] violations

_METRICS = {"throughput": "output_tokens_per_s", "goodput": "goodput_rps",
            "pareto": "output_tokens_per_s", "capacity": "capacity_rps"}
_LABELS = {"output_tokens_per_s": "out tok/s", "goodput_rps": "goodput req/s",
           "capacity_rps": "req/s capacity"}


def objective_metric(objective: str) -> str:
    """The Measurement.flat() key an objective maximises (Pareto: its first objective)."""
    return _METRICS[objective]


def interval_keys(objective: str) -> tuple[str, str]:
    """The metrics holding a trial's within-run interval of its objective value: output
    tokens/s (throughput, Pareto; goodput shows its throughput's), or a capacity study's
    bracket [highest passing rate, lowest failing rate]."""
    key = "capacity_rps" if objective == "capacity" else "output_tokens_per_s"
    return f"{key}_ci_low", f"{key}_ci_high"


def objective_label(objective: str) -> str:
    """How people read the objective's value: "out tok/s" or "goodput req/s"."""
    return _LABELS[objective_metric(objective)]


# ------------------------------------------------------------------------------------------
# One trial


def constraints(trial: Any) -> list[float]:
    """Constraint values of a finished trial (> 0 = violated)."""
    return [float(v) for v in (getattr(trial, "constraints", None) or {}).values()] or list(
        trial.user_attrs.get(A.CONSTRAINTS, [0.0] * N_CONSTRAINTS)
    )


def set_constraints(trial: Any, *, failed: float, slo: float, errors: float,
                    quality: float = 0.0) -> None:
    """Record constraint values (Optuna's samplers treat any value > 0 as infeasible)."""
    values = {"failed": failed, "slo": slo, "errors": errors, "quality": quality}
    for key, value in values.items():
        trial.set_constraint(key, float(value))
    trial.set_user_attr(A.CONSTRAINTS, list(values.values()))


def mark_failed(trial: Any, reason: str, message: str) -> None:
    """A trial with no measurement: state failed, its reason, and the failed constraint."""
    trial.set_user_attr(A.STATE, State.FAILED)
    trial.set_user_attr(A.REASON, reason)
    trial.set_user_attr(A.MESSAGE, message[:4000])
    set_constraints(trial, failed=1.0, slo=0.0, errors=0.0, quality=0.0)


def is_prior(t: Any) -> bool:
    """A trial copied from an earlier study by a warm start (measured under another shape)."""
    return A.PRIOR in t.user_attrs


def primary(t: Any) -> float:
    """The objective value (the first one for a Pareto study: throughput or goodput)."""
    return float(t.values[0])


def feasible(t: Any) -> bool:
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


def config_key(t: Any) -> str:
    """Trials with the same key ran the same engine config."""
    return json.dumps({"baseline": bool(t.user_attrs.get(A.BASELINE)), "params": t.params},
                      sort_keys=True, default=str)


def mlflow_run(study: Any, t: Any) -> str | None:
    """The MLflow run id of a trial (kept on the study: the trial is final when it is logged)."""
    rid = study.user_attrs.get(f"{A.MLFLOW_RUN}.{t.number}") or t.user_attrs.get(A.MLFLOW_RUN)
    return str(rid) if rid else None


# ------------------------------------------------------------------------------------------
# A study's trials


def n_finished(study: Any) -> int:
    """Trials that count toward ``--trials``: measured or failed by their config (not
    rejected samples, not priors copied from another study, not trials the tuner's own
    death or interruption stopped)."""
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=done)
               if t.user_attrs.get(A.REASON) not in (FailureReason.REJECTED, *STOPPED)
               and not is_prior(t))


def failures_by_reason(trials: Iterable[Any]) -> dict[str, int]:
    """Reason -> count over the failed and infeasible trials."""
    reasons: dict[str, int] = {}
    for t in trials:
        if t.user_attrs.get(A.STATE) in (State.FAILED, State.INFEASIBLE, State.PRUNED):
            r = str(t.user_attrs.get(A.REASON, "unknown"))
            reasons[r] = reasons.get(r, 0) + 1
    return reasons


def best_trial(study: Any) -> FrozenTrial | None:
    """The feasible trial with the best single reading (for progress displays)."""
    trials = [t for t in study.get_trials(deepcopy=False) if feasible(t)]
    return max(trials, key=primary) if trials else None


def baseline_trial(study: Any) -> FrozenTrial | None:
    """The first measured trial of vLLM's defaults."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(A.BASELINE) and t.state == TrialState.COMPLETE:
            return t
    return None


def readings(study: Any) -> dict[str, list[Any]]:
    """Feasible measured trials of this study grouped by config (rechecks included)."""
    groups: dict[str, list[Any]] = {}
    for t in study.get_trials(deepcopy=False):
        if feasible(t):
            groups.setdefault(config_key(t), []).append(t)
    return groups


class Verdict(NamedTuple):
    """The config a study declares (the winner, or vLLM's defaults when no config is shown
    to beat them) and the defaults, each with the readings the verdict used."""

    winner: Any  # FrozenTrial | None: the reading closest to the declared config's median
    readings: list[float]
    baseline: Any  # FrozenTrial | None: the first reading of vLLM's defaults
    baseline_readings: list[float]


@dataclass(frozen=True)
class Judgement:
    """The study's verdict and the readings (trials) behind it."""

    verdict: str  # "winner" | "defaults_best" | "unverified" (no defaults measured)
    reason: str
    ratio: Any  # autotune.stats.RatioInterval | None
    declared: list[Any]  # readings of the config best.json names
    candidate: list[Any]  # readings of the best config other than the defaults
    defaults: list[Any]  # readings of the defaults


def _fresh(ts: list[Any]) -> list[Any]:
    return [t for t in ts if t.user_attrs.get(A.RECHECK_OF) is not None]


def study_objective(study: Any) -> str:
    """The objective a study maximises (its stored settings; throughput when unknown)."""
    settings = study.user_attrs.get(A.SETTINGS) or {}
    objective = settings.get("objective") if isinstance(settings, dict) else None
    return str(objective) if objective in _METRICS else "throughput"


def _within(ts: list[Any], objective: str = "throughput") -> Any:
    """The within-run interval of a config's first reading (autotune.stats.Interval):
    output tokens/s, or a capacity study's bracket [highest pass, lowest fail]."""
    from autotune.stats import Interval

    m = ts[0].user_attrs.get(A.METRICS) or {}
    lo_key, hi_key = interval_keys(objective)
    lo, hi = m.get(lo_key), m.get(hi_key)
    if objective == "capacity" and hi is None:
        hi = lo  # capped at the search's top scale: the capacity is at least its low end
    return Interval(primary(ts[0]), lo, hi) if lo is not None and hi is not None else None


def judge_study(study: Any) -> Judgement | None:
    """The verdict (docs/measurement.md): the best re-checked config against the defaults.

    When the re-check ran, only its fresh-server readings count (a search reading was
    picked for being high); the candidate is the config with the best mean log reading.
    A winner is declared only if the 95 % interval of its ratio to the defaults lies
    above 1; otherwise the defaults remain best and best.json names them. None: no
    feasible trial."""
    from autotune.stats import decide_verdict, ratio_to_defaults

    groups = list(readings(study).values())
    if not groups:
        return None
    objective = study_objective(study)
    base = next((ts for ts in groups if ts[0].user_attrs.get(A.BASELINE)), None)
    others = [ts for ts in groups if ts is not base]
    pool = [_fresh(ts) for ts in others if _fresh(ts)] or others
    base_use = (_fresh(base) or base) if base else []
    cand = max(pool, key=lambda ts: statistics.fmean(
        math.log(max(primary(t), 1e-300)) for t in ts)) if pool else []
    if not base_use:
        return Judgement("unverified", "the defaults were not measured (--no-baseline): "
                         "nothing to compare with", None, cand, cand, [])
    if not cand:
        return Judgement("defaults_best", "no other config was measured feasible", None,
                         base_use, [], base_use)
    ratio = ratio_to_defaults([primary(t) for t in cand], [primary(t) for t in base_use],
                              others=[[primary(t) for t in ts] for ts in pool if ts is not cand],
                              within={"config": _within(cand, objective),
                                      "defaults": _within(base_use, objective)})
    v = decide_verdict(ratio)
    return Judgement(v.verdict, v.reason, ratio, cand if v.verdict == "winner" else base_use,
                     cand, base_use)


def verdict(study: Any) -> Verdict:
    """The config best.json names (:func:`judge_study`): its reading nearest its median, its
    readings, and the defaults' first reading and readings."""
    j = judge_study(study)
    if j is None or not j.declared:
        return Verdict(None, [], None, [])
    vals = [primary(t) for t in j.declared]
    med = statistics.median(vals)
    rep = min(j.declared, key=lambda t: abs(primary(t) - med))
    base_rep = min(j.defaults, key=lambda t: t.number) if j.defaults else None
    return Verdict(rep, vals, base_rep, [primary(t) for t in j.defaults])


def verdict_record(j: Judgement | None) -> dict[str, Any]:
    """``autotune.verdict`` (study attribute, study.json, best.json's ``verdict``,
    ``ratio_to_defaults`` and ``verdict_detail``)."""
    if j is None:
        return {"verdict": "none", "ratio_to_defaults": None,
                "winner_number": None, "baseline_number": None,
                "reason": "no feasible trial"}
    cand_rep = min(j.candidate, key=lambda t: t.number) if j.candidate else None
    base_rep = min(j.defaults, key=lambda t: t.number) if j.defaults else None
    first = cand_rep.user_attrs.get(A.RECHECK_OF, cand_rep.number) if cand_rep else None
    return {
        "verdict": j.verdict,
        "ratio_to_defaults": j.ratio.as_dict() if j.ratio is not None else None,
        "winner_number": first if j.verdict != "defaults_best" else None,
        "baseline_number": (base_rep.user_attrs.get(A.RECHECK_OF, base_rep.number)
                            if base_rep else None),
        "candidate_number": first,
        "candidate_params": dict(cand_rep.params) if cand_rep else None,
        "readings": {"candidate": [primary(t) for t in j.candidate],
                     "defaults": [primary(t) for t in j.defaults]},
        "method": j.ratio.method if j.ratio is not None else None,
        "reason": j.reason,
    }


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated when maximizing ``x`` and minimizing ``y``."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 >= x and y2 <= y) and (x2 > x or y2 < y) for j, (x2, y2) in enumerate(points)
            if j != i
        )  # fmt: skip
        if not dominated:
            front.append(i)
    return front


def pareto_trials(study: Any) -> list[Any]:
    """Feasible trials no other feasible trial beats on both objectives, best first."""
    pts = [t for t in study.get_trials(deepcopy=False) if feasible(t) and len(t.values) == 2]
    front = [pts[i] for i in pareto_front([(t.values[0], t.values[1]) for t in pts])]
    return sorted(front, key=lambda t: -t.values[0])


def fail_stopped_trials(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[int]:
    """On resume: trials left RUNNING by a tuner that died become FAIL, reason ``tuner_died``.

    Optuna's heartbeat (``RDBStorage(heartbeat_interval=...)`` with
    ``optuna.storages.fail_stale_trials``) does not fit here: it fails a trial only once its
    heartbeat is older than the grace period, so a study resumed right after a kill would
    wait or leave the trial RUNNING, and it sets the state before its callback runs, when
    the reason can no longer be recorded. ``--resume`` owns the study (one tuner per study),
    so every RUNNING trial belongs to a tuner that is gone: the storage's public API marks
    them, reason first (``storage``: the one ``study`` was opened on). Returns the trial
    numbers marked."""
    from optuna.trial import TrialState

    study_id = storage.get_study_id_from_name(study.study_name)
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, A.STATE, State.FAILED)
        storage.set_trial_user_attr(trial_id, A.REASON, FailureReason.TUNER_DIED)
        storage.set_trial_user_attr(trial_id, A.MESSAGE,
                                    "the tuner stopped while this trial was running")
        storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
        logger.warning("trial %d was running when the tuner died: marked failed", t.number)
        out.append(t.number)
    return out


# ------------------------------------------------------------------------------------------
# Storage


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URL; None for other databases and in-memory SQLite."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):]
    return None if path in ("", ":memory:") else Path(path)


def open_storage(url: str, *, create: bool = True) -> Any:
    """An Optuna RDB storage; SQLite files get their folder and a generous lock timeout.

    ``create=False``: a SQLite file that does not exist is not created and None is returned
    (looking something up must not leave files behind)."""
    import optuna

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        path = sqlite_path(url)
        if path is not None:
            if not create and not path.exists():
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    try:
        return optuna.storages.RDBStorage(url, **kwargs)
    except Exception as exc:
        raise StudyError(
            f"cannot open the Optuna storage {url!r}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; use sqlite:///PATH or a "
            "reachable database URL"
        ) from exc


def latest_study(storage: Any) -> str | None:
    """The name of the study started last in ``storage`` (None when it holds none)."""
    import optuna

    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    started = [(s.datetime_start, s.study_name) for s in summaries
               if s.datetime_start is not None]
    return max(started)[1] if started else None
