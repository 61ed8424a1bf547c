"""What a study stores: the attribute keys (``A``), trial states, failure reasons and
the objective's metric names. Written once here, read by every reader of a study.
"""

from __future__ import annotations

import logging
from enum import StrEnum

from autotune.errors import ConfigError

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
    # the start-to-start spread a study with repeated starts measured (SpreadRecord:
    # {"log_sd", "df", "host"}), read back by later studies of one start each
    START_SPREAD = "autotune.start_spread"
    COST = "autotune.cost"  # best.json's "cost" (autotune.cost), with a --gpu-hour-price
    # GPU-seconds by phase (autotune.study.PhaseAccount): {"starts", "warmup", "measuring",
    #   "other", "screened", "pruned", "recheck", "total", "pruned_saved", "budget_s"}
    GPU_PHASES = "autotune.gpu_phases"
    # the failure model: a started trial's prediction {"fail", "p_fail", "reason",
    # "neighbours"}; on the study, its counts {"earlier_trials", "studies", "steered",
    # "predicted_ran", "predicted_failed", "missed"}
    PREDICTED_FAILURE = "autotune.predicted_failure"
    # screen, then refine (autotune.study): 0 = stopped at the coarse fidelity (screened),
    # 1 = promoted and measured to full resolution; absent on trials that were not screened
    RUNG = "autotune.rung"
    SCREEN = "autotune.screen"  # the coarse reading: {"value", "ci_low", "ci_high", ...}
    FAILURE_MODEL = "autotune.failure_model"
    GPU_TIME = "autotune.gpu_time"  # {slot: {"start_s", "warmup_s", "measure_s", "idle_s",


class State(StrEnum):
    """``autotune.state`` of a finished trial."""

    OK = "ok"
    FAILED = "failed"  # no measurement: the config failed, or the tuner stopped it
    INFEASIBLE = "infeasible"  # measured, but missed the SLOs, error rate or quality bound
    PRUNED = "pruned"  # stopped early as a clear loser against the incumbent (the pruner)
    # stopped at the coarse fidelity: its coarse reading was no leader (screen, then refine)
    SCREENED = "screened"


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
    # never started: the failure model predicted it would not start (autotune.study)
    PREDICTED = "predicted_failure"
    PRUNED = "pruned"  # the pruner stopped it: its interval lay below the incumbent's
    SCREENED = "screened"  # stopped at the coarse fidelity: not among the rung-0 leaders
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
    """The Measurement.flat() key an objective maximises (Pareto: its first objective).
    A :class:`~autotune.errors.ConfigError` for ``auto`` (resolved from the shape first)
    or an objective that does not exist."""
    try:
        return _METRICS[objective]
    except KeyError:
        fix = ("resolve it from the traffic shape first (autotune.study.resolve_objective "
               "or resolve_study)" if objective == "auto"
               else f"use one of {', '.join(_METRICS)}")
        raise ConfigError(f"objective {objective!r} names no metric; {fix}") from None


def interval_keys(objective: str) -> tuple[str, str]:
    """The metrics holding a trial's within-run interval of its objective value: output
    tokens/s (throughput, Pareto; goodput shows its throughput's), or a capacity study's
    bracket [highest passing rate, lowest failing rate]."""
    key = "capacity_rps" if objective == "capacity" else "output_tokens_per_s"
    return f"{key}_ci_low", f"{key}_ci_high"


def objective_label(objective: str) -> str:
    """How people read the objective's value: "out tok/s" or "goodput req/s"."""
    return _LABELS[objective_metric(objective)]
