"""What a study stores in Optuna, and the rules every reader of a study applies to it.

The bottom of the study layer (Optuna's ``_constrained_optimization.py`` plays this part in
Optuna): :mod:`autotune.study` writes these attributes, :mod:`autotune.registry`,
:mod:`autotune.plots`, the experiments and the tests read them. It imports nothing of
autotune but :mod:`autotune.errors`, the pure :mod:`autotune.stats` (the verdict's
interval) and the leaf :mod:`autotune.hardware` (is a tuner's process still running), so
no reader needs the orchestrator.

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
  ``interrupted`` after SIGINT/SIGTERM, ``stale`` when its tuner on another host, or a hung
  one, stopped sending heartbeats); such a trial says nothing about its config, so it
  does not count toward ``--trials`` and ``--resume`` runs its config again; so is a
  queued config the time budget left unstarted (reason ``budget``).

Several tuners may work on one study (one storage: PostgreSQL, or one SQLite file): each
running trial carries its tuner (``autotune.owner``: host, pid, process start, session
token) and gets Optuna heartbeats from :class:`Heartbeats`; :func:`fail_stale_trials`
fails only the trials whose tuner is gone (see there).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from autotune.credentials import redact
from autotune.errors import StudyError

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

__all__ = [
    "N_CONSTRAINTS",
    "STOPPED",
    "A",
    "FailureReason",
    "Heartbeat",
    "Heartbeats",
    "Judgement",
    "Owner",
    "State",
    "Verdict",
    "baseline_trial",
    "best_trial",
    "config_key",
    "constraints",
    "fail_stale_trials",
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
    "schema_race",
    "server_gpus_of",
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
    # GPUs one server of the trial's config uses (TP x PP x DP of its flags): the objective
    # value told to Optuna is per GPU (the measured figure / this), metrics stay per server
    SERVER_GPUS = "autotune.server_gpus"
    # --objective capacity: {"recorded_rps", "low", "high", "status", "capacity_rps",
    #   "ci_low_rps", "ci_high_rps", "levels": [{"scale", "offered_rps", "passed", ...}]}
    CAPACITY = "autotune.capacity"
    WARMUP = "autotune.warmup"  # {"seconds", "segments", "converged", "jit_in_last_segment",
    #                             "jit_events", "jit_segments_measuring", "rates": [tok/s]}
    TIME = "autotune.time"  # {"start_s", "compile_s", "warmup_s", "measure_s", "other_s", "slot",
    #                         "start_phases": {phase: s} (autotune.trial.start_phases)}
    MLFLOW_RUN = "autotune.mlflow_run_id"  # also "<this>.<trial number>" on the study
    OWNER = "autotune.owner"  # the tuner running it: Owner.record() (host, pid, started, token)
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
    COST = "autotune.cost"  # best.json's "cost" (autotune.cost), with a --gpu-hour-price
    GPU_TIME = "autotune.gpu_time"  # {slot: {"start_s", "warmup_s", "measure_s", "idle_s",
    #                                         "other_s", "compile_s" (part of start_s)}}


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
    STALE = "stale"  # no heartbeat from its tuner (another host, or hung) for the grace period
    BUDGET = "budget"  # queued, never started: the time budget ended the search first


#: Reasons that say nothing about the config: the tuner stopped while the trial ran (or
#: before a queued one started).
STOPPED = frozenset({FailureReason.TUNER_DIED, FailureReason.INTERRUPTED,
                     FailureReason.STALE, FailureReason.BUDGET})

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


def server_gpus_of(t: Any) -> int:
    """GPUs one server of a trial's config uses (1 for trials stored before autotune
    counted them). Every per-GPU figure of a study divides a server's figure by this."""
    try:
        return max(1, int(t.user_attrs.get(A.SERVER_GPUS) or 1))
    except (TypeError, ValueError):
        return 1


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
               if t.user_attrs.get(A.REASON) != FailureReason.REJECTED
               and not (t.state == TrialState.FAIL and t.user_attrs.get(A.REASON) in STOPPED)
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
    # when no other config was measured feasible: the best one the pruner stopped (its
    # within-run figures give the ratio; it has no objective value of its own)
    pruned: Any = None
    # defaults_best with a ratio above 1 that the starts could not show: how many starts
    # of each config would, at the measured start-to-start spread (autotune.stats.
    # starts_needed), and the --recheck-starts that gives them
    starts_needed: int | None = None
    recheck_starts_needed: int | None = None


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
        # no failing level (the search stopped at its time cap or its top scale): the
        # capacity is at least its low end, and nothing bounds it above
        hi = math.inf
    if lo is None or hi is None:
        return None
    n = server_gpus_of(ts[0])  # the value is per GPU; the metrics are the server's
    return Interval(primary(ts[0]), lo / n, hi / n)


def _lower_bound_only(t: Any, objective: str) -> bool:
    """A capacity reading whose search found no failing level: a lower bound."""
    if objective != "capacity":
        return False
    hi = (t.user_attrs.get(A.METRICS) or {}).get(interval_keys(objective)[1])
    return not (isinstance(hi, (int, float)) and math.isfinite(hi))


def judge_study(study: Any) -> Judgement | None:
    """The verdict (docs/measurement.md): the best re-checked config against the defaults.

    When the re-check ran, only its fresh-server readings count (a search reading was
    picked for being high), unless every measured config was re-checked: then nothing was
    picked and the search readings count too (one more start per config). Otherwise the
    start-to-start spread is pooled over every config's starts, search readings included:
    with one fresh start each (``--recheck-starts 1``) it is the only measure of that
    spread (a capacity bracket is no noise estimate), with more it adds degrees of freedom.
    The candidate is the config with the best mean log reading.
    A winner is declared only if the 95 % interval of its ratio to the defaults lies
    above 1; otherwise the defaults remain best and best.json names them. None: no
    feasible trial."""
    from autotune.stats import (
        MAX_STARTS_NEEDED,
        decide_verdict,
        ratio_to_defaults,
        starts_needed,
    )

    groups = list(readings(study).values())
    if not groups:
        return None
    objective = study_objective(study)
    base = next((ts for ts in groups if ts[0].user_attrs.get(A.BASELINE)), None)
    others = [ts for ts in groups if ts is not base]
    search_counts = all(_fresh(ts) for ts in groups)
    spread = None  # the groups the between-start variance is pooled over (None: the ones used)
    if search_counts:  # no selection: every reading is unbiased
        pool, base_use = others, (base or [])
    else:
        pool = [_fresh(ts) for ts in others if _fresh(ts)] or others
        base_use = (_fresh(base) or base) if base else []
        # the estimate stays fresh-only; the start-to-start spread is pooled over every
        # config's starts, search readings included (more degrees of freedom; a search
        # reading picked for being high only widens its config's spread)
        spread = [[primary(t) for t in ts] for ts in groups]
    cand = max(pool, key=lambda ts: statistics.fmean(
        math.log(max(primary(t), 1e-300)) for t in ts)) if pool else []
    if not base_use:
        return Judgement("unverified", "the defaults were not measured (--no-baseline): "
                         "nothing to compare with", None, cand, cand, [])
    if not cand:
        return _judge_pruned(study, base_use)
    lower = [t.number for t in (*cand, *base_use) if _lower_bound_only(t, objective)]
    if lower:
        return Judgement("defaults_best", (
            "no ratio to the defaults: the capacity search of trial(s) "
            f"{', '.join(map(str, sorted(lower)))} ended before a failing level bracketed it "
            "(its time cap or top scale), so those capacities are lower bounds only, and "
            "lower bounds rank nothing however many starts: raise --capacity-max-s (or "
            "lower --capacity-level-s): vLLM's defaults remain best"),
            None, base_use, cand, base_use)
    ratio = ratio_to_defaults([primary(t) for t in cand], [primary(t) for t in base_use],
                              others=[[primary(t) for t in ts] for ts in pool if ts is not cand],
                              within={"config": _within(cand, objective),
                                      "defaults": _within(base_use, objective)},
                              spread=spread)
    v = decide_verdict(ratio)
    n = starts_needed(ratio) if v.verdict == "defaults_best" else None
    reason, recheck = v.reason, None
    if ratio is None and objective == "capacity":
        reason = ("no ratio to the defaults: a capacity search ended before a failing level "
                  "bracketed it (its time cap or top scale), so that capacity is only a lower "
                  "bound and one start of each shows nothing: raise --capacity-max-s, or add "
                  "fresh starts (--recheck 1): vLLM's defaults remain best")
    if (v.verdict == "defaults_best" and ratio is not None and ratio.median > 1
            and ratio.log_sd is not None):
        at = f"; at the measured start-to-start SD ({math.expm1(ratio.log_sd) * 100:.1f} %)"
        if n is not None:
            # each config's re-check adds --recheck-starts fresh starts; its search reading
            # counts as one more start only when every config was re-checked
            recheck = n - 1 if search_counts else n
            reason += (f"{at} showing {ratio.median:.3f}x would take about {n} starts of "
                       f"each config (rerun with --resume --recheck-starts {recheck})")
        else:
            reason += (f"{at} more than {MAX_STARTS_NEEDED} starts of each config would not "
                       f"show {ratio.median:.3f}x")
    return Judgement(v.verdict, reason, ratio, cand if v.verdict == "winner" else base_use,
                     cand, base_use, starts_needed=n, recheck_starts_needed=recheck)


def _pruned_value(t: Any) -> float | None:
    """A pruned trial's output tokens/s per GPU (it has no objective value of its own)."""
    m = t.user_attrs.get(A.METRICS) or {}
    v = m.get("output_tokens_per_s")
    return (float(v) / server_gpus_of(t) if isinstance(v, (int, float)) and math.isfinite(v)
            and v > 0 else None)


def _judge_pruned(study: Any, base_use: list[Any]) -> Judgement:
    """Defaults remain best when no other config was measured feasible; if the pruner
    stopped some, the best of them gives "the best ratio found" from its own segments."""
    from optuna.trial import TrialState

    from autotune.stats import Interval, ratio_to_defaults

    pruned = [t for t in study.get_trials(deepcopy=False)
              if t.state == TrialState.PRUNED and t.user_attrs.get(A.STATE) == State.PRUNED
              and _pruned_value(t) is not None]
    reason = "no other config was measured feasible"
    if not pruned:
        return Judgement("defaults_best", reason, None, base_use, [], base_use)
    best = max(pruned, key=lambda t: _pruned_value(t) or 0.0)
    value = _pruned_value(best) or 0.0
    m = best.user_attrs.get(A.METRICS) or {}
    lo, hi = m.get("output_tokens_per_s_ci_low"), m.get("output_tokens_per_s_ci_high")
    n = server_gpus_of(best)
    iv = Interval(value, lo / n, hi / n) if lo is not None and hi is not None else None
    ratio = ratio_to_defaults([value], [primary(t) for t in base_use],
                              within={"config": iv, "defaults": _within(base_use)})
    return Judgement("defaults_best", reason + (
        f"; the pruner stopped the best other one (trial {best.number}) as a clear loser"),
        ratio, base_use, [], base_use, pruned=best)


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
    cand_rep = (min(j.candidate, key=lambda t: t.number) if j.candidate else j.pruned)
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
        # GPUs one server of the candidate uses (the readings are per GPU)
        "candidate_gpus": server_gpus_of(cand_rep) if cand_rep else None,
        "candidate_pruned": j.pruned is not None,
        "readings": {"candidate": ([primary(t) for t in j.candidate] if j.candidate else
                                   [_pruned_value(j.pruned)] if j.pruned is not None else []),
                     "defaults": [primary(t) for t in j.defaults]},
        "method": j.ratio.method if j.ratio is not None else None,
        "start_spread": (math.expm1(j.ratio.log_sd)
                         if j.ratio is not None and j.ratio.log_sd is not None else None),
        "starts_needed": ({"per_config": j.starts_needed,
                           "recheck_starts": j.recheck_starts_needed}
                          if j.starts_needed is not None else None),
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


# ------------------------------------------------------------------------------------------
# Tuners that share a study: owners, heartbeats, stale trials


@dataclass(frozen=True)
class Heartbeat:
    """Optuna's heartbeat settings (``RDBStorage(heartbeat_interval=, grace_period=)``):
    a tuner records a heartbeat for each trial it runs every ``interval_s``; a RUNNING trial
    without one for ``grace_s`` is stale, and any tuner of the study fails it."""

    interval_s: int = 10
    grace_s: int = 120


@dataclass(frozen=True)
class Owner:
    """The tuner running a trial (``autotune.owner``). ``started`` (the process's start in
    clock ticks) tells a reused pid from the tuner; ``token`` tells two tuners of one
    process apart."""

    host: str
    pid: int
    started: int | None
    token: str

    @classmethod
    def this_process(cls) -> Owner:
        """A new tuner session of this process."""
        from autotune.hardware import process_start_ticks

        pid = os.getpid()
        return cls(socket.gethostname(), pid, process_start_ticks(pid), uuid.uuid4().hex[:12])

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, t: Any) -> Owner | None:
        """The owner a trial records; None for trials written before owners were."""
        raw = t.user_attrs.get(A.OWNER)
        try:
            return cls(str(raw["host"]), int(raw["pid"]),
                       None if raw.get("started") is None else int(raw["started"]),
                       str(raw.get("token", "")))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def gone(self, *, host: str) -> bool:
        """Known to be gone: it ran on ``host`` (this machine) and its process is no more
        (or its pid now belongs to another process). A tuner on another host: False."""
        from autotune.hardware import process_start_ticks

        if self.host != host:
            return False
        now = process_start_ticks(self.pid)
        return now is None or (self.started is not None and now != self.started)

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"


def _heartbeat_interval(storage: Any) -> int | None:
    """The storage's heartbeat interval; None where heartbeats are off or not supported."""
    get = getattr(storage, "get_heartbeat_interval", None)
    return get() if callable(get) else None


class Heartbeats:
    """Records Optuna heartbeats for the trials this tuner runs: at once on :meth:`add`,
    then every interval from a daemon thread (Optuna starts its own heartbeat thread only
    inside ``Study.optimize``; an ask/tell loop needs this one). Does nothing on a storage
    without heartbeats. Use :meth:`start` and :meth:`stop` (in a ``finally``)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.interval_s = _heartbeat_interval(storage)
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def add(self, trial_id: int) -> None:
        with self._lock:
            self._ids.add(trial_id)
        self._beat(trial_id)

    def discard(self, trial_id: int) -> None:
        with self._lock:
            self._ids.discard(trial_id)

    def start(self) -> None:
        if self.interval_s is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="autotune-heartbeats",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        assert self.interval_s is not None
        while not self._stop.wait(self.interval_s):
            with self._lock:
                ids = sorted(self._ids)
            for trial_id in ids:
                self._beat(trial_id)

    def _beat(self, trial_id: int) -> None:
        if self.interval_s is None:
            return
        try:
            self.storage.record_heartbeat(trial_id)
        except Exception as exc:  # noqa: BLE001 - the loop meets a broken storage itself
            if not self._failing:  # and stops with its error; this thread must not die
                logger.warning("cannot record the heartbeat of trial id %d (%s: %s); other "
                               "tuners of the study fail it as stale if this lasts",
                               trial_id, type(exc).__name__, str(exc)[:200])
            self._failing = True
        else:
            self._failing = False


def _fail_running(storage: Any, trial_id: int, reason: str, message: str) -> bool:
    """Reason first, then FAIL (a finished trial's attributes can no longer be written).
    False when the trial finished meanwhile (its tuner told it, or another tuner failed it)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    try:
        storage.set_trial_user_attr(trial_id, A.STATE, State.FAILED)
        storage.set_trial_user_attr(trial_id, A.REASON, reason)
        storage.set_trial_user_attr(trial_id, A.MESSAGE, message)
        return bool(storage.set_trial_state_values(trial_id, state=TrialState.FAIL))
    except UpdateFinishedTrialError:
        return False


def _gone_at_once(t: Any, me: Owner, grace_s: float) -> str | None:
    """Why a RUNNING trial's tuner is known to be gone now (None: not known)."""
    owner = Owner.of(t)
    if owner is None:  # written before owners were recorded, or asked a moment ago
        age = (datetime.now() - t.datetime_start).total_seconds() if t.datetime_start else 0
        return "the tuner stopped while this trial was running" if age > grace_s else None
    if owner.token != me.token and owner.gone(host=me.host):
        return f"the tuner running this trial ({owner}) is gone"
    return None


def fail_stale_trials(study: optuna.Study, *, me: Owner, heartbeat: Heartbeat) -> dict[int, str]:
    """RUNNING trials whose tuner is gone become FAIL, with the reason recorded first.

    * At once, reason ``tuner_died``: the trial's owner ran on this host and its process is
      gone (so a study resumed right after a kill retries the trial at once), or the trial
      records no owner (written by an older autotune) and started over
      ``heartbeat.grace_s`` ago.
    * After the grace period, reason ``stale``: no heartbeat for ``heartbeat.grace_s``
      (the storage's ``heartbeat_interval``/``grace_period``) - a tuner on another host,
      or a hung one. The stale ids come from the storage's heartbeat contract, as in
      ``optuna.storages.fail_stale_trials``; that function sets FAIL before its
      ``heartbeat_stale_trial_callback`` runs, when the trial's reason can no longer be
      written, so the reason is set here first and the storage's callback (if any) runs
      after, as Optuna does.

    This tuner's own trials (``me``) and those of live tuners with fresh heartbeats are
    left alone. Returns {trial number: reason} of the trials this call failed."""
    import copy

    from optuna.trial import TrialState

    storage: Any = study._storage  # the heartbeat contract is not on BaseStorage
    running = {t._trial_id: t for t in study.get_trials(deepcopy=False,
                                                          states=(TrialState.RUNNING,))}
    out: dict[int, str] = {}
    for trial_id, t in running.items():
        why = _gone_at_once(t, me, heartbeat.grace_s)
        if why is not None and _fail_running(storage, trial_id, FailureReason.TUNER_DIED, why):
            out[t.number] = FailureReason.TUNER_DIED
            logger.warning("trial %d: %s; marked failed", t.number, why)
    stale: list[int] = []
    if _heartbeat_interval(storage) is not None:
        stale = storage._get_stale_trial_ids(study._study_id)
    for trial_id in stale:
        if trial_id not in running:  # started after the list above: its tuner is alive
            continue
        t = running[trial_id]
        owner = Owner.of(t)
        if t.number in out or (owner is not None and owner.token == me.token):
            continue
        why = (f"no heartbeat from the tuner running this trial ({owner or 'unknown'}) for "
               f"over {heartbeat.grace_s} s: it died or hangs")
        if _fail_running(storage, trial_id, FailureReason.STALE, why):
            out[t.number] = FailureReason.STALE
            logger.warning("trial %d: %s; marked failed", t.number, why)
            callback = getattr(storage, "get_heartbeat_stale_trial_callback", lambda: None)()
            if callback is not None:
                callback(study, copy.deepcopy(storage.get_trial(trial_id)))
    return out


# ------------------------------------------------------------------------------------------
# Storage


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URL; None for other databases and in-memory SQLite."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):]
    return None if path in ("", ":memory:") else Path(path)


def open_storage(url: str, *, create: bool = True, heartbeat: Heartbeat | None = None) -> Any:
    """An Optuna RDB storage; SQLite files get their folder and a generous lock timeout.

    ``create=False``: a SQLite file that does not exist is not created and None is returned
    (looking something up must not leave files behind). ``heartbeat``: the storage a tuner
    runs trials on records Optuna heartbeats (:class:`Heartbeats`, :func:`fail_stale_trials`)."""
    kwargs: dict[str, Any] = {}
    if heartbeat is not None:
        kwargs.update(heartbeat_interval=heartbeat.interval_s, grace_period=heartbeat.grace_s)
    if url.startswith("sqlite:///"):
        path = sqlite_path(url)
        if path is not None:
            if not create and not path.exists():
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    else:
        # A database server restarted mid-study leaves every pooled connection dead: each
        # is tested when taken, and replaced, so the study goes on (docs/faults.md).
        kwargs["engine_kwargs"] = {"pool_pre_ping": True}
    try:
        return _rdb_storage(url, kwargs)
    except Exception as exc:
        raise StudyError(
            f"cannot open the Optuna storage {redact(url)!r}: {type(exc).__name__}: "
            f"{redact(str(exc).splitlines()[0]) if str(exc) else ''}; use sqlite:///PATH or a "
            "reachable database URL"
        ) from exc


def _rdb_storage(url: str, kwargs: dict[str, Any], attempts: int = 5) -> Any:
    """Optuna's RDB storage, opened again when another process created its schema at the
    same moment. Two processes opening a fresh storage at once (two tuners joining one
    study, a status next to a starting tune) both create the tables and one fails ("table
    studies already exists", alembic's version row); the schema is whole by then."""
    import warnings

    import optuna

    def open_it() -> Any:
        with warnings.catch_warnings():  # the heartbeat arguments are "experimental"
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, **kwargs)

    for attempt in range(1, attempts):
        try:
            return open_it()
        except Exception as exc:
            if not schema_race(exc):
                raise
            time.sleep(0.2 * attempt)
    return open_it()


def schema_race(exc: BaseException) -> bool:
    """Whether opening a storage failed because another process created its schema at the
    same moment (SQLite and server databases word it alike)."""
    text = str(exc).lower()
    return "already exist" in text or (
        "alembic_version" in text and ("unique" in text or "duplicate" in text))


def latest_study(storage: Any) -> str | None:
    """The name of the study started last in ``storage`` (None when it holds none)."""
    import optuna

    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    started = [(s.datetime_start, s.study_name) for s in summaries
               if s.datetime_start is not None]
    return max(started)[1] if started else None
