"""The study: create or resume it, drive ask/tell over an executor, pick and record the best.

:func:`tune` is three steps: :func:`resolve_inputs` (fail before any server starts),
:class:`StudyLoop` (ask -> suggest -> executor -> tell, then the re-check phase), and
:func:`autotune.outputs.write_results`. What a study stores in Optuna and how it is read
back (attribute keys, failure reasons, feasibility, the verdict) lives in
:mod:`autotune.schema`; MLflow, ``trials.csv`` and progress displays subscribe to the
loop's events (:mod:`autotune.events`).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config import DEFAULT_OUT_ROOT, SLO_KEYS, TuneSettings
from autotune.credentials import redact, redact_settings, warn_if_password
from autotune.engine import EngineInfo, detect_engine, preload_scope
from autotune.errors import AutotuneError, ConfigError, SpaceError, StudyError
from autotune.events import (
    EventListener,
    StudyCallback,
    StudyCallbacks,
    StudyContext,
    StudyEvent,
    TrialRecord,
)
from autotune.hardware import gpu_arch, gpu_names, gpu_type
from autotune.outputs import (
    TrialsCsvCallback,
    TuneResult,
    write_config,
    write_json_atomic,
    write_results,
)
from autotune.parallelism import server_gpus
from autotune.placement import can_ask, fits, never_fits, node_of, with_parallel_rules
from autotune.preflight import check_before_trial_0
from autotune.report import one_line_message
from autotune.schema import (
    STOPPED,
    A,
    FailureReason,
    Heartbeat,
    Heartbeats,
    Owner,
    State,
    baseline_trial,
    best_trial,
    fail_stale_trials,
    interval_keys,
    judge_study,
    latest_study,
    mark_failed,
    n_finished,
    objective_metric,
    open_storage,
    primary,
    readings,
    server_gpus_of,
    set_constraints,
    verdict_record,
)
from autotune.space import (
    ROUTING_SIMULATION_ENV,
    LaunchSpec,
    ModelFacts,
    SearchSpace,
    dummy_routing_warning,
    load_space,
)
from autotune.trial import TrialOutcome, TrialSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    import optuna
    from optuna.samplers import BaseSampler
    from optuna.storages import BaseStorage

    from autotune.kernels._study import TrialPlan
    from autotune.measure import Slo
    from autotune.parallel import Executor
    from autotune.quality import ProbeOutputs, ProbeSet, QualityThresholds
    from autotune.registry import WarmStart
    from autotune.traffic import TrafficShape

__all__ = [
    "A",
    "StudyEvent",
    "StudyInputs",
    "StudyLoop",
    "TrialTemplate",
    "TuneResult",
    "goodput_slo",
    "make_sampler",
    "objective_metric",
    "open_storage",
    "resolve_inputs",
    "tune",
    "write_json_atomic",
]

logger = logging.getLogger(__name__)

_MAX_REJECTED_IN_A_ROW = 200


def make_sampler(settings: TuneSettings) -> BaseSampler:
    """The sampler ``--sampler`` names: TPE with constraints (Bayesian) or random."""
    import warnings

    import optuna

    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    n_startup = max(3, min(10, settings.trials // 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Constraints come from trial.set_constraint(); TPE ranks infeasible trials last.
        return optuna.samplers.TPESampler(
            seed=settings.seed,
            n_startup_trials=n_startup,
            multivariate=True,
            group=True,  # conditional knobs (e.g. stochastic rounding only with float16)
            constant_liar=True,  # parallel trials do not all sample the same point
        )


def goodput_slo(slo: dict[str, float]) -> Slo | None:
    """Per-request goodput thresholds from ``--slo`` limits (ttft/tpot/e2e)."""
    from autotune.measure import Slo

    if not slo:
        return None
    pick: dict[str, float | None] = {"ttft_s": None, "tpot_s": None, "e2e_s": None}
    for key, limit in slo.items():
        kind = key.split("_")[0]
        if f"{kind}_s" in pick:
            pick[f"{kind}_s"] = limit
    return Slo(**pick)


# ------------------------------------------------------------------------------------------
# Inputs: everything is checked before any server starts


@dataclass(frozen=True)
class StudyInputs:
    """The study's inputs, resolved and checked (:func:`resolve_inputs`)."""

    settings: TuneSettings
    model: Path
    shape: TrafficShape
    engine: EngineInfo
    gpu_type: str
    space: SearchSpace
    enqueued: list[dict[str, Any]]
    gpus_per_trial: int
    storage: BaseStorage
    study_name: str
    out_dir: Path
    log_dir: Path
    tracking_uri: str
    cache_dir: Path
    thresholds: QualityThresholds | None
    lossy_in_space: bool
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    owner: Owner = field(default_factory=Owner.this_process)  # this tuner, on its trials


def _study_name(settings: TuneSettings, storage: BaseStorage, space: SearchSpace,
                shape: TrafficShape) -> str:
    """The study to create (``--study-name`` or SPACE-SHAPE-TIMESTAMP) or to resume."""
    import optuna

    name = settings.study_name
    if settings.resume and name is None:
        name = latest_study(storage)
        if name is None:
            raise StudyError(f"--resume: no study in {redact(settings.storage)} to resume")
    if name is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        name = f"{space.name}-{shape.name}-{stamp}".replace(" ", "_")
    existing = {s.study_name for s in optuna.get_all_study_summaries(storage, False)}
    if name in existing and not settings.resume:
        raise StudyError(
            f"study {name!r} already exists in {redact(settings.storage)}; pass --resume to "
            "continue it, or choose another --study-name"
        )
    if settings.resume and name not in existing:
        raise StudyError(
            f"--resume: study {name!r} is not in {redact(settings.storage)}; "
            f"known studies: {', '.join(sorted(existing)) or 'none'}"
        )
    return name


def _check_satisfiable(space: SearchSpace, samples: int = 500) -> None:
    """Refuse a space whose rules reject every sample, before any server starts."""
    import optuna

    probe = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    last: list[str] = []
    for _ in range(samples):
        trial = probe.ask()
        params = space.suggest(trial)
        last = space.violations(params)
        probe.tell(trial, 0.0)
        if not last:
            return
    raise SpaceError(
        f"the rules of search space {space.source or space.name} reject all {samples} random "
        f"samples (e.g. {last[0] if last else '?'}); loosen the rules or the knob ranges"
    )


def _complete_params(space: SearchSpace, params: dict[str, Any], where: str) -> dict[str, Any]:
    """An enqueued config: given knobs, the rest at vLLM's defaults; checked against the space."""
    unknown = sorted(set(params) - set(space.knobs))
    if unknown:
        raise ConfigError(
            f"{where}: unknown knob(s) {', '.join(unknown)} for space {space.name}; "
            f"knobs: {', '.join(space.knobs)}"
        )
    full: dict[str, Any] = {}
    for name, knob in space.knobs.items():
        if not space.is_active(name, {**full, **params}):
            continue
        if name in params:
            full[name] = params[name]
        elif knob.default is not None:
            full[name] = knob.default
    problems = space.violations(full)
    if problems:
        raise ConfigError(f"{where}: {'; '.join(problems)}")
    return full


def _quality_thresholds(settings: TuneSettings,
                        space: SearchSpace) -> QualityThresholds | None:
    thresholds = None
    if settings.quality:
        from autotune.quality import parse_quality

        thresholds = parse_quality(settings.quality)
    if thresholds is not None and not any(k.lossy for k in space.knobs.values()):
        raise ConfigError(
            f"--quality was given but the space {space.name} marks no knob 'lossy: true'; "
            "nothing would be probed"
        )
    return thresholds


def _traffic_streams(shape: Any, concurrency: int | None) -> int:
    """Concurrent streams of the shape's replay (the space fact ``streams``), as the
    kernel tuner counts them; 0 when the shape says neither concurrency nor rate."""
    from autotune.kernels import streams_of

    try:
        return streams_of(shape, concurrency)[0]
    except ConfigError:
        return 0


def resolve_inputs(settings: TuneSettings, *, heartbeat: Heartbeat | None = None,
                   gpus: int | None = None) -> StudyInputs:
    """Read and check everything a study needs (model, shape, space, storage, names).

    ``heartbeat``: how often this tuner's running trials get Optuna heartbeats and after
    how long without one another tuner fails them (default :class:`Heartbeat`). ``gpus``:
    the GPUs of the largest node the trials run on (the space's fact ``gpus``; default:
    this machine's)."""
    from autotune.objective import replayed_shape, resolve_objective
    from autotune.prompts import model_vocab_size
    from autotune.tracking import default_tracking_uri
    from autotune.traffic import load_shape

    model = settings.model.resolve()
    if not (model / "config.json").exists():
        raise AutotuneError(
            f"--model {settings.model}: no config.json there; point it at a local model "
            "directory (make a tiny one with 'autotune model tiny models/tiny')"
        )
    model_vocab_size(model)  # the prompts need it: checked before any store is opened
    shape = load_shape(settings.shape)
    settings = resolve_objective(settings, shape)  # --objective auto, or refused here
    if settings.objective != "capacity":  # an open loop with --concurrency N: closed loop
        shape = replayed_shape(shape, settings.concurrency)
    info = detect_engine()
    cuda = info.device == "cuda"
    if gpus is None:
        gpus = len(gpu_names()) if cuda else 0
    facts = ModelFacts.from_model_dir(model, device=info.device,
                                      gpu_arch=gpu_arch() if cuda else "", gpus=gpus).with_traffic(
        streams=_traffic_streams(shape, settings.concurrency),
        prompt_p90=shape.input_tokens.p90)
    space = load_space(settings.space, facts=facts)
    enqueued = [_complete_params(space, p, f"--enqueue #{i + 1}")
                for i, p in enumerate(settings.enqueue)]
    # flags against the installed vLLM's parser, the shape against the context: before the
    # storage, the folders or any server (issue 18)
    check_before_trial_0(space=space, shape=shape, model=model, settings=settings)
    if settings.objective == "capacity":
        from autotune.levels import recorded_rate

        recorded_rate(shape)  # a closed-loop shape has no rate to scale: stop here
    heartbeat = heartbeat or Heartbeat()
    warn_if_password("--storage", settings.storage, env="PGPASSWORD or a ~/.pgpass file")
    storage = open_storage(settings.storage, heartbeat=heartbeat)
    study_name = _study_name(settings, storage, space, shape)
    out_dir = (settings.out or DEFAULT_OUT_ROOT / study_name).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    _check_satisfiable(space)
    return StudyInputs(
        settings=settings, model=model, shape=shape, engine=info,
        gpu_type=gpu_type() if cuda else "cpu", space=space, enqueued=enqueued,
        gpus_per_trial=(settings.gpus_per_trial if settings.gpus_per_trial is not None
                        else 1 if cuda else 0),
        storage=storage, study_name=study_name, out_dir=out_dir, log_dir=out_dir / "logs",
        tracking_uri=settings.tracking_uri or default_tracking_uri(DEFAULT_OUT_ROOT),
        cache_dir=(settings.cache_dir or Path.home() / ".cache" / "autotune").expanduser(),
        thresholds=_quality_thresholds(settings, space),
        lossy_in_space=any(k.lossy for k in space.knobs.values()), heartbeat=heartbeat,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# Create or resume the study in the storage


def _retry_stopped(study: optuna.Study, only: Collection[int] | None = None) -> list[int]:
    """On resume: enqueue the config of each trial the tuner's end stopped, once.

    Re-check trials are left to the re-check phase, which enqueues what is still missing.
    ``only``: just these trial numbers. Returns the numbers of the trials retried."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(A.RETRY_OF) for t in trials}
    out = []
    for t in trials:
        if (t.state != TrialState.FAIL or t.user_attrs.get(A.REASON) not in STOPPED
                or t.number in retried or t.user_attrs.get(A.RECHECK_OF) is not None
                or (only is not None and t.number not in only)):
            continue
        attrs: dict[str, Any] = {A.RETRY_OF: t.number}
        for key in (A.BASELINE, A.ENQUEUED):
            if t.user_attrs.get(key):
                attrs[key] = True
        study.enqueue_trial(dict(t.params), user_attrs=attrs)
        logger.warning("trial %d was stopped by the tuner's end: its config runs again",
                       t.number)
        out.append(t.number)
    return out


def _resume(study: optuna.Study, inputs: StudyInputs) -> None:
    prev_shape = study.user_attrs.get(A.SHAPE)
    if prev_shape and prev_shape != inputs.shape.fingerprint:
        raise StudyError(
            f"--resume: study {inputs.study_name!r} was tuned for shape {prev_shape[:12]}, but "
            f"{inputs.settings.shape} is {inputs.shape.fingerprint[:12]}; use the same shape, "
            "or start a new study (autotune retune compares shapes)"
        )
    # Only the trials of tuners that are gone: several tuners may share the study.
    fail_stale_trials(study, me=inputs.owner, heartbeat=inputs.heartbeat)
    _retry_stopped(study)


def _warm_start(study: optuna.Study, inputs: StudyInputs, warm_start: WarmStart) -> None:
    """Enqueue a warm start's configs, then add its priors (they hold the same params and
    would otherwise make the enqueued ones "exist")."""
    space = inputs.space
    bases = warm_start.enqueue_baseline or [False] * len(warm_start.enqueue)
    for params, was_base in zip(warm_start.enqueue, bases, strict=True):
        if was_base:  # the old defaults won: measure vLLM's defaults (no knob flags)
            if not inputs.settings.baseline:
                study.enqueue_trial(space.baseline_params(),
                                    user_attrs={A.BASELINE: True, A.ENQUEUED: True})
            continue
        study.enqueue_trial(_complete_params(space, params, "warm start"),
                            user_attrs={A.ENQUEUED: True})
    if warm_start.prior_trials:
        study.add_trials(warm_start.prior_trials)


def _start_new(study: optuna.Study, inputs: StudyInputs,
               warm_start: WarmStart | None) -> None:
    settings, space = inputs.settings, inputs.space
    for key, value in {
        A.MODEL: str(inputs.model), A.SHAPE: inputs.shape.fingerprint,
        A.SHAPE_PATH: str(settings.shape), A.SPACE: space.name,
        A.SPACE_PATH: str(settings.space),
        A.ENGINE: f"{inputs.engine.package} {inputs.engine.version}", A.GPU: inputs.gpu_type,
        A.SETTINGS: redact_settings(settings.model_dump(mode="json")),
    }.items():  # fmt: skip
        study.set_user_attr(key, value)
    if settings.baseline:
        study.enqueue_trial(space.baseline_params(), user_attrs={A.BASELINE: True})
    for params in inputs.enqueued:
        study.enqueue_trial(params, user_attrs={A.ENQUEUED: True})
    if warm_start is not None:
        _warm_start(study, inputs, warm_start)


def open_study(inputs: StudyInputs, *, sampler: BaseSampler | None = None,
               warm_start: WarmStart | None = None) -> optuna.Study:
    """Create the study (its attributes, baseline, enqueued configs and warm start) or, on
    ``--resume``, load it, fail the trials that tuners now gone left running
    (:func:`autotune.schema.fail_stale_trials`) and retry them."""
    import optuna

    settings = inputs.settings
    try:
        directions: list[Any] = (["maximize", "minimize"] if settings.objective == "pareto"
                                 else ["maximize"])
        study = optuna.create_study(
            storage=inputs.storage, study_name=inputs.study_name, directions=directions,
            sampler=sampler or make_sampler(settings), load_if_exists=settings.resume,
        )  # fmt: skip
    except Exception as exc:
        raise StudyError(f"cannot create or load study {inputs.study_name!r}: {exc}") from exc
    if settings.resume:
        _resume(study, inputs)
    else:
        _start_new(study, inputs, warm_start)
    return study


# ------------------------------------------------------------------------------------------
# Judging one outcome


def _metric(t: Any, key: str) -> float | None:
    """A trial's measured metric, None when the trial or the figure is missing."""
    value = (t.user_attrs.get(A.METRICS) or {}).get(key) if t is not None else None
    return float(value) if isinstance(value, (int, float)) else None


def _per_gpu_metric(t: Any, key: str) -> float | None:
    value = _metric(t, key)
    return None if value is None else value / server_gpus_of(t)


def _slo_violation(metrics: dict[str, float], settings: TuneSettings) -> float:
    return max((metrics.get(SLO_KEYS[k], math.inf) / limit - 1.0
                for k, limit in settings.slo.items()), default=-1.0)


def _why_infeasible(outcome: TrialOutcome, settings: TuneSettings, slo: float, err: float,
                    quality: float) -> str:
    m = outcome.metrics
    why = []
    if slo > 0:
        why.append("missed the SLOs: " + ", ".join(
            f"{k}={m.get(SLO_KEYS[k], float('nan')):.3g}s>{limit:g}s"
            for k, limit in settings.slo.items() if m.get(SLO_KEYS[k], math.inf) > limit))
    if err > 0:
        errors = dict((outcome.measurement or {}).get("errors") or {})
        total = sum(errors.values()) or 1
        kinds = ", ".join(f"{k} {n / total:.0%}"
                          for k, n in sorted(errors.items(), key=lambda kv: -kv[1]))
        why.append(f"error rate {m.get('error_rate', 0):.1%} > {settings.max_error_rate:.1%}"
                   + (f" (failed requests: {kinds})" if kinds else ""))
    if quality > 0:
        q = outcome.quality or {}
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
    errors = (outcome.measurement or {}).get("errors")
    if errors:
        trial.set_user_attr(A.REQUEST_ERRORS, dict(errors))
    if outcome.warmup is not None:
        trial.set_user_attr(A.WARMUP, outcome.warmup)
    if outcome.capacity is not None:
        trial.set_user_attr(A.CAPACITY, outcome.capacity)
    trial.set_user_attr(A.TIME, trial_time(outcome))


def _report_segments(trial: optuna.Trial, outcome: TrialOutcome, settings: TuneSettings) -> None:
    """Segment rates as Optuna intermediate values (single-objective studies only)."""
    if settings.objective == "pareto":
        return
    for step, rate in enumerate(outcome.segments):
        if math.isfinite(rate):
            trial.report(float(rate) / server_gpus_of(trial), step)


def _mark_pruned(trial: optuna.Trial, outcome: TrialOutcome) -> None:
    """A clear loser the pruner stopped: feasible constraints, state and reason pruned."""
    lo = outcome.metrics.get("output_tokens_per_s_ci_low", math.nan)
    hi = outcome.metrics.get("output_tokens_per_s_ci_high", math.nan)
    trial.set_user_attr(A.STATE, State.PRUNED)
    trial.set_user_attr(A.REASON, FailureReason.PRUNED)
    trial.set_user_attr(A.MESSAGE, (
        f"stopped after {len(outcome.segments)} segments: its 95 % interval "
        f"[{lo:,.1f}, {hi:,.1f}] out tok/s lay below the incumbent's"))
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
    err_violation = outcome.metrics.get("error_rate", 0.0) - settings.max_error_rate
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
            attrs: dict[str, Any] = {A.RECHECK_OF: first.number}
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


# ------------------------------------------------------------------------------------------
# The GPU-time account (issue 14)


def _slot_label(outcome: TrialOutcome) -> str:
    if outcome.gpus:  # "gpu0", "gpu2-3" (a trial on two GPUs); names MLflow accepts as keys
        return "gpu" + "-".join(str(g) for g in outcome.gpus)
    return f"cpu:{outcome.hostname}" if outcome.hostname else "cpu"


def trial_time(outcome: TrialOutcome) -> dict[str, Any]:
    """Where a trial's wall time went (seconds) and on which slot (``autotune.time``)."""
    start = float(outcome.start_s or 0.0)
    other = max(0.0, outcome.wall_s - start - outcome.warmup_s - outcome.measure_s)
    return {"start_s": round(start, 2), "compile_s": round(float(outcome.compile_s or 0.0), 2),
            "warmup_s": round(outcome.warmup_s, 2),
            "measure_s": round(outcome.measure_s, 2), "other_s": round(other, 2),
            "slot": _slot_label(outcome), "start_phases": dict(outcome.start_phases)}


class GpuTime:
    """Seconds per GPU (or CPU slot) spent starting servers, warming up, measuring, in the
    rest of a trial (stop, quality probe) and idle (the study's span less all of those).
    ``compile_s`` is the part of ``start_s`` that vLLM logged compiling (not added again).
    GPU-seconds: a trial on four GPUs adds its times to each of the four."""

    def __init__(self, slots: int, gpus: Sequence[int] = ()) -> None:
        self.slots = slots
        self.per: dict[str, dict[str, float]] = {}
        for g in gpus:  # every GPU of the executor, so one never used shows as idle
            self._slot(f"gpu{g}")

    def add(self, outcome: TrialOutcome) -> None:
        t = trial_time(outcome)
        for label in ([f"gpu{g}" for g in outcome.gpus] if outcome.gpus else [str(t["slot"])]):
            acc = self._slot(label)
            for k in ("start_s", "compile_s", "warmup_s", "measure_s", "other_s"):
                acc[k] = acc.get(k, 0.0) + float(t[k])

    def add_kernels(self, seconds: float, gpus: Sequence[int]) -> None:
        """Kernel tuning before trial 0 (``kernels_s``) on each GPU it timed on."""
        for g in gpus:
            acc = self._slot(f"gpu{g}")
            acc["kernels_s"] = acc.get("kernels_s", 0.0) + seconds

    def _slot(self, label: str) -> dict[str, float]:
        return self.per.setdefault(label, {"start_s": 0.0, "warmup_s": 0.0, "measure_s": 0.0,
                                           "idle_s": 0.0, "other_s": 0.0, "compile_s": 0.0})

    def close(self, span_s: float) -> None:
        """Idle = the loop's span (times the slots a CPU label stands for) less busy time."""
        for label, acc in self.per.items():
            n = 1 if label.startswith("gpu") else self.slots
            busy = sum(v for k, v in acc.items() if k not in ("idle_s", "compile_s"))
            acc["idle_s"] = max(0.0, n * span_s - busy)
            for k in acc:
                acc[k] = round(acc[k], 1)

    def save(self, study: optuna.Study) -> None:
        """Add this session's account to what earlier sessions of the study recorded."""
        total = {k: dict(v) for k, v in (study.user_attrs.get(A.GPU_TIME) or {}).items()}
        for label, acc in self.per.items():
            cur = total.setdefault(label, {})
            for k, v in acc.items():
                cur[k] = round(float(cur.get(k, 0.0)) + v, 1)
        study.set_user_attr(A.GPU_TIME, total)


def _incumbent_low(study: optuna.Study, settings: TuneSettings, trial: optuna.Trial
                   ) -> float | None:
    """The pruner's bar for a new trial: the low end of the incumbent's interval.

    Passed in with the trial (it runs in a Ray worker; no storage round-trip mid-trial).
    None (never pruned) for the defaults, re-check trials, studies that do not maximise
    throughput, and ``--pruner none``."""
    if (settings.pruner == "none" or settings.objective != "throughput"
            or trial.user_attrs.get(A.BASELINE) or trial.user_attrs.get(A.RECHECK_OF) is not None):
        return None
    best = best_trial(study)
    low = _metric(best, "output_tokens_per_s_ci_low")
    # per GPU: the bar of a trial on n GPUs is n x the incumbent's low end per GPU
    return None if low is None else low / server_gpus_of(best) * server_gpus_of(trial)


# ------------------------------------------------------------------------------------------
# The loop


def _capacity_spec(settings: TuneSettings) -> dict[str, Any]:
    """The TrialSpec fields of a capacity study (none for the other objectives)."""
    if settings.objective != "capacity":
        return {}
    from autotune.levels import capacity_spec

    return capacity_spec(goodput=settings.capacity_goodput,
                         max_error_rate=settings.max_error_rate, start=settings.capacity_start,
                         tolerance=settings.capacity_tolerance,
                         level_s=settings.capacity_level_s, max_s=settings.capacity_max_s,
                         max_levels=settings.capacity_max_levels, seed=settings.seed)


@dataclass(frozen=True)
class TrialTemplate:
    """What every trial of a study shares: the model, the shape, folders, quality probe."""

    model: str
    shape: TrafficShape | None
    log_dir: str | None = None
    cache_dir: str | None = None
    quality_probe: ProbeSet | None = None
    quality_reference: ProbeOutputs | None = None

    def spec(self, number: int, launch: LaunchSpec, settings: TuneSettings, *,
             probe: bool, incumbent_low: float | None = None,
             server_gpus: int = 1) -> TrialSpec:
        """The :class:`TrialSpec` of one trial (``probe``: run the quality probe;
        ``incumbent_low``: the pruner's bar)."""
        from autotune.stats import SegmentRule

        rule = SegmentRule(precision=settings.precision,
                           min_segments=settings.min_segments,
                           warmup_tolerance=settings.warmup_tolerance,
                           warmup_max_s=settings.warmup_max_s,
                           measure_max_s=settings.measure_max_s)
        return TrialSpec(
            number=number, model=self.model, flags=launch.flags, env=dict(launch.env),
            shape=self.shape, seed=settings.seed, warmup_requests=settings.warmup_requests,
            repeats=settings.repeats, slo=goodput_slo(settings.slo), api=settings.api,
            num_requests=settings.num_requests, concurrency=settings.concurrency,
            start_timeout_s=settings.start_timeout_s,
            request_timeout_s=settings.request_timeout_s, log_dir=self.log_dir,
            cache_dir=self.cache_dir, cpu_kv_cache_gib=settings.cpu_kv_cache_gib,
            quality_probe=self.quality_probe if probe else None,
            quality_reference=self.quality_reference,
            rule=rule, segment_requests=settings.segment_requests, incumbent_low=incumbent_low,
            output_jitter=settings.output_jitter, server_gpus=server_gpus,
            **_capacity_spec(settings),
        )  # fmt: skip


@dataclass
class _Flight:
    trial: optuna.Trial
    params: dict[str, Any]
    launch: LaunchSpec
    baseline: bool
    spec: TrialSpec | None = None


@dataclass
class StudyLoop:
    """Drives one study: ask -> suggest -> executor -> judge -> tell, until the study has
    ``settings.trials`` finished trials (or the time budget is spent), then re-measures the
    leaders (``settings.recheck``). Failures of trials are recorded, never raised."""

    study: optuna.Study
    settings: TuneSettings
    space: SearchSpace
    executor: Executor
    template: TrialTemplate
    callbacks: StudyCallback = field(default_factory=StudyCallbacks)
    thresholds: QualityThresholds | None = None
    started: float = field(default_factory=time.monotonic)
    owner: Owner = field(default_factory=Owner.this_process)  # recorded on each trial it runs
    heartbeat: Heartbeat = field(default_factory=Heartbeat)  # the grace for owner-less trials

    def __post_init__(self) -> None:
        self.target = self.settings.trials  # grows by the re-check trials
        self.phase = "search"  # then "recheck": the time budget bounds the search alone
        self.flights: dict[int, _Flight] = {}  # asked and not told (the waiting one too)
        self.waiting: int | None = None  # asked, but its GPUs are not free yet (placement)
        self.walls: list[float] = []
        self.recheck_walls: list[float] = []  # walls less compile seconds (the budget rule)
        self.rejected_in_a_row = 0
        self.t_loop = time.monotonic()
        self._last: StudyEvent | None = None
        pool = getattr(self.executor, "pool", None)
        self.gpu_time = GpuTime(slots=self.executor.slots, gpus=(
            pool.nodes[next(iter(pool.nodes))] if pool is not None and len(pool.nodes) == 1
            else ()))
        self.beats = Heartbeats(self.study._storage)  # a no-op without storage heartbeats

    # -- progress ---------------------------------------------------------------------------
    def event(self, kind: str, **kw: Any) -> StudyEvent:
        """A progress snapshot of the study now."""
        best = best_trial(self.study)
        base = baseline_trial(self.study)
        done = n_finished(self.study)
        eta = None
        if self.walls:
            remaining = max(0, self.target - done)
            eta = (sum(self.walls) / len(self.walls)
                   * math.ceil(remaining / max(1, self.executor.slots)))
        self._last = StudyEvent(
            kind=kind, study_name=self.study.study_name, done=done, total=self.target,
            running=len(self.flights), best_value=primary(best) if best else None,
            best_number=best.number if best else None,
            best_ci_low=_per_gpu_metric(best, interval_keys(self.settings.objective)[0]),
            best_ci_high=_per_gpu_metric(best, interval_keys(self.settings.objective)[1]),
            baseline_value=primary(base) if base else None,
            elapsed_s=time.monotonic() - self.started, eta_s=eta, **kw,
        )  # fmt: skip
        return self._last

    def stopped_event(self) -> StudyEvent:
        """The study stopped: the last snapshot, without reading the storage (it may be the
        reason the study stopped)."""
        last = self._last or StudyEvent(kind="", study_name=self.study.study_name, done=0,
                                        total=self.target, running=0)
        return replace(last, kind="study_stopped", running=len(self.flights),
                       elapsed_s=time.monotonic() - self.started, trial_number=None,
                       trial_ok=None, trial_value=None, trial_reason=None, trial_params={},
                       message="")

    def _phase(self, number: int, phase: str, elapsed_s: float, detail: str) -> None:
        self.callbacks.on_trial_phase(number, phase, elapsed_s, detail)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """The search, then the re-check phase."""
        import optuna

        self.t_loop = time.monotonic()  # the time budget counts from here
        self.beats.start()
        try:
            self._run_until_done()
            skipped = _skip_waiting(self.study, self.study._storage)
            if skipped:  # the re-check must not run left-over search configs
                self.callbacks.on_note(self.event("note", message=(
                    f"time budget: {len(skipped)} queued config(s) not started (--resume with "
                    "more --timeout runs them)")))
            if self.settings.recheck:
                self._recheck()
            self.close()
        except optuna.exceptions.StorageInternalError as exc:
            raise StudyError(
                f"the Optuna storage {redact(self.settings.storage)} failed mid-study "
                f"({redact(str(exc))}); every finished trial is kept there: fix the storage, "
                "then continue with --resume"
            ) from exc
        finally:
            self.beats.stop()

    def close(self) -> None:
        """Record the GPU-time account and the verdict on the study (``autotune.gpu_time``,
        ``autotune.verdict``) for the result files, MLflow and the report."""
        self.gpu_time.close(time.monotonic() - self.t_loop)
        self.gpu_time.save(self.study)
        record = verdict_record(judge_study(self.study))
        record["quality"] = self._winner_quality(record)
        self.study.set_user_attr(A.VERDICT, record)

    def _winner_quality(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The verdict's word on a winner that sets lossy knobs: judged, or why not."""
        from autotune.quality import quality_caveat

        number, params = record.get("winner_number"), record.get("candidate_params") or {}
        if record.get("verdict") != "winner" or number is None:
            return None
        attrs = self.study.trials[number].user_attrs
        return quality_caveat(
            self.space.lossy_knobs(params), params, probe=self.settings.quality_probe,
            gated=self.thresholds is not None, real_weights=self.space.facts.real_weights,
            figures=attrs.get(A.QUALITY), note=str(attrs.get(A.QUALITY_NOTE) or ""))

    def _more(self) -> bool:
        if self.phase == "search" and self.settings.timeout_s is not None:
            # The budget holds the re-check too: stop searching when what is left would
            # not fit the re-check at the trials' mean wall time so far.
            # A re-check starts configs already compiled: their starts load the compile
            # cache, so the compile seconds of first starts are left out of the estimate.
            reserve = 0.0
            if self.settings.recheck and self.walls:
                n_re = (self.settings.recheck + 1) * self.settings.recheck_starts
                reserve = (sum(self.recheck_walls) / len(self.recheck_walls)
                           * math.ceil(n_re / max(1, self.executor.slots)))
            if time.monotonic() - self.t_loop + reserve > self.settings.timeout_s:
                return False  # budget spent: let running trials finish, start no new one
        return n_finished(self.study) + len(self.flights) < self.target

    def _run_until_done(self) -> None:
        while self._more() or self.flights:
            self._fill_slots()
            told = [self._tell(outcome) for outcome in self.executor.wait(timeout_s=5.0)]
            if told:
                self._fill_slots()  # free slots get their next trial before the bookkeeping
            for event, record in told:
                self.callbacks.on_trial_end(event, record)

    def _fill_slots(self) -> None:
        """Start the waiting trial once it fits; ask for more only while none waits and
        some GPU (or slot) is free (autotune.placement)."""
        if self.waiting is not None and fits(self.executor, self.flights[self.waiting].spec):
            self._submit(self.flights[self.waiting])
        while (self.waiting is None and len(self.flights) < self.executor.slots
               and can_ask(self.executor) and self._more()):
            self._launch_next()

    def _recheck(self) -> None:
        self.phase = "recheck"
        n = _enqueue_rechecks(self.study, self.settings.recheck, self.settings.recheck_starts)
        if not n:
            groups = readings(self.study).values()
            if not any(not ts[0].user_attrs.get(A.BASELINE) for ts in groups):
                self.callbacks.on_note(self.event("note", message=(
                    "no re-check: no config but vLLM's defaults was measured feasible, so "
                    "fresh starts could not change the verdict")))
            return
        self.target = n_finished(self.study) + n
        self.callbacks.on_note(self.event("recheck_started", message=(
            f"re-measuring the top {self.settings.recheck} config(s) and the baseline on "
            f"fresh servers ({self.settings.recheck_starts} starts each, {n} trials) "
            "before the verdict")))
        self._run_until_done()

    def _ask(self) -> optuna.Trial:
        """The next trial, owned by this tuner (its owner and first heartbeat recorded at
        once). Before it, as ``Study.optimize`` does, trials of tuners that are gone are
        failed; during the search their configs run again."""
        import warnings

        failed = fail_stale_trials(self.study, me=self.owner, heartbeat=self.heartbeat)
        if failed and self.phase == "search":
            _retry_stopped(self.study, only=failed)
        with warnings.catch_warnings():  # heartbeats are recorded here, not by optimize()
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = self.study.ask()
        trial.set_user_attr(A.OWNER, self.owner.record())
        self.beats.add(trial._trial_id)
        return trial

    def _launch_next(self) -> None:
        trial = self._ask()
        try:
            self._launch(trial)
        except BaseException as exc:
            if trial.number not in self.flights:  # asked, never started: not left RUNNING
                try:
                    mark_failed(trial, FailureReason.INTERRUPTED,
                                f"the tuner stopped before this trial started: {exc!r}"[:500])
                    _commit_tell(self.study, trial, None, fail=True)
                except Exception as tell_exc:  # noqa: BLE001 - the first error is raised
                    logger.warning("trial %d could not be failed (%s); the next --resume "
                                   "fails it", trial.number, redact(str(tell_exc)))
            raise

    def _launch(self, trial: optuna.Trial) -> None:
        is_base = bool(trial.user_attrs.get(A.BASELINE))
        params = self.space.suggest(trial, baseline=is_base)
        problems = self.space.violations(params)
        if problems and not is_base:
            self._reject(trial, params, problems)
            return
        launch = self.space.launch_spec(params, baseline=is_base)
        gpus = server_gpus(launch.flags)
        trial.set_user_attr(A.SERVER_GPUS, gpus)
        probe = not is_base and bool(self.space.lossy_knobs(params))
        spec = self.template.spec(trial.number, launch, self.settings, probe=probe,
                                  incumbent_low=_incumbent_low(self.study, self.settings, trial),
                                  server_gpus=gpus)
        why = never_fits(self.executor, spec)
        if why is not None:
            self._reject(trial, params, [why])
            return
        self.rejected_in_a_row = 0
        trial.set_user_attr(A.FLAGS, list(launch.flags))
        trial.set_user_attr(A.ENV, dict(launch.env))
        flight = self.flights[trial.number] = _Flight(trial, params, launch, is_base, spec)
        if fits(self.executor, spec):
            self._submit(flight)
        else:  # its GPUs are busy: it waits, and nothing more is asked until it starts
            self.waiting = trial.number
            self._phase(trial.number, "waiting", 0.0,
                        f"waits for {gpus} free GPU(s) of one node")

    def _submit(self, f: _Flight) -> None:
        assert f.spec is not None
        number = f.trial.number
        if self.waiting == number:
            self.waiting = None
        self.executor.submit(f.spec, on_phase=self._phase)
        self.callbacks.on_trial_start(self.event("trial_started", trial_number=number,
                                                 trial_params=f.params))
        recheck_of = f.trial.user_attrs.get(A.RECHECK_OF)
        if recheck_of is not None:
            self._phase(number, "recheck", 0.0, f"re-measuring the config of trial {recheck_of}")

    def _reject(self, trial: optuna.Trial, params: dict[str, Any], problems: list[str]) -> None:
        """A sample the space's rules forbid: PRUNED, never launched, not counted."""
        self.rejected_in_a_row += 1
        if self.rejected_in_a_row > _MAX_REJECTED_IN_A_ROW:
            raise StudyError(
                f"the space {self.space.name} rejected {_MAX_REJECTED_IN_A_ROW} samples in a "
                f"row (last: {problems[0]}); its rules exclude almost everything - fix them"
            )
        mark_failed(trial, FailureReason.REJECTED, "; ".join(problems))
        _commit_tell(self.study, trial, None)
        self.beats.discard(trial._trial_id)
        record = TrialRecord(number=trial.number, params=params, flags=(), env={},
                             state=State.FAILED, reason=FailureReason.REJECTED, value=None,
                             baseline=False, outcome=None, violations=tuple(problems))
        self.callbacks.on_trial_end(self.event("trial_rejected", trial_number=trial.number,
                                               trial_ok=False, trial_params=params,
                                               trial_reason=FailureReason.REJECTED),
                                    record)

    def _tell(self, outcome: TrialOutcome) -> tuple[StudyEvent, TrialRecord]:
        """Judge and tell a finished trial; returns what its subscribers are told."""
        import optuna

        f = self.flights.pop(outcome.number)
        lossy = (not f.baseline) and bool(self.space.lossy_knobs(f.params))
        self.walls.append(outcome.wall_s)
        self.recheck_walls.append(max(0.0, outcome.wall_s - (outcome.compile_s or 0.0)))
        self.gpu_time.add(outcome)
        try:
            value, state, reason = judge(f.trial, outcome, self.settings,
                                         thresholds=self.thresholds, lossy=lossy)
            # Optuna first: a tracking store that hangs must not cost a measured trial.
            _commit_tell(self.study, f.trial, value)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            elsewhere = _finished_elsewhere(self.study, f.trial)
            if elsewhere is None:
                raise
            # This tuner's heartbeats lapsed past the grace period (hung, or a storage that
            # stalled) and another tuner failed the trial as stale: its result is dropped.
            logger.warning("trial %d was failed by another tuner of the study meanwhile "
                           "(reason %s: no heartbeat within the grace period); its result "
                           "is dropped", outcome.number, elsewhere)
            value, state, reason = None, State.FAILED, elsewhere
        finally:
            self.beats.discard(f.trial._trial_id)
        record = TrialRecord(number=outcome.number, params=f.params, flags=f.launch.flags,
                             env=dict(f.launch.env), state=state, reason=reason, value=value,
                             baseline=f.baseline, outcome=outcome)
        event = self.event(
            "trial_finished", trial_number=outcome.number, trial_ok=outcome.ok,
            trial_value=value[0] if isinstance(value, list) else value, trial_reason=reason,
            trial_params=f.params,
            message=one_line_message(str(f.trial.user_attrs.get(A.MESSAGE) or outcome.message),
                                     reason, 500),
        )  # fmt: skip
        return event, record

    def interrupt(self) -> None:
        """Stop the trials in flight; each becomes FAIL with reason ``interrupted``."""
        import optuna

        waiting = [self.waiting] if self.waiting is not None else []
        self.waiting = None
        cancelled = [*self.executor.cancel_all(), *waiting]
        # and any flight the executor never took (its submit raised): none is left RUNNING
        for n in dict.fromkeys([*cancelled, *self.flights]):
            f = self.flights.pop(n, None)
            if f is None:
                continue
            self.beats.discard(f.trial._trial_id)
            try:
                mark_failed(f.trial, FailureReason.INTERRUPTED, "the tuner was interrupted")
                _commit_tell(self.study, f.trial, None, fail=True)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
                if _finished_elsewhere(self.study, f.trial) is None:
                    raise


# ------------------------------------------------------------------------------------------
# tune(): resolve inputs -> run -> write outputs


def _quality_reference(inputs: StudyInputs, note: Callable[[str], None]
                       ) -> tuple[ProbeSet | None, ProbeOutputs | None]:
    """The probe and the reference outputs (cached per model, probe and flags; computed on
    one extra server start the first time)."""
    from autotune.engine import VllmServer
    from autotune.quality import (
        QualitySpec,
        ReferenceCache,
        build_probe,
        ensure_reference,
        reference_params,
    )
    from autotune.trial import model_max_len, model_vocab_size

    settings, model = inputs.settings, inputs.model
    real = inputs.space.facts.real_weights  # a real checkpoint: probe with real text
    ref = inputs.space.launch_spec(reference_params(inputs.space))
    routing = ref.env.get(ROUTING_SIMULATION_ENV, "")
    if routing:  # a stand-in's simulated routing: no server's tokens are the model's
        why = (f"the stand-in's MoE routing is simulated ({ROUTING_SIMULATION_ENV}={routing}), "
               "so no config's tokens are the model's to compare")
        if settings.quality:
            raise StudyError(f"--quality cannot be checked: {why}; drop --quality, or set "
                             f"{ROUTING_SIMULATION_ENV} to \"\" in the space's stand_in part")
        note(f"quality probe off: {why}")
        return None, None
    # On the CPU build batching does not change outputs (seen bit-exact): probe 8 at a time.
    conc = 8 if inputs.engine.device == "cpu" else 1
    probe = build_probe(inputs.shape, vocab_size=model_vocab_size(model),
                        text_model=model if real else None,
                        spec=QualitySpec(seed=settings.seed, concurrency=conc, n_prompts=32),
                        max_model_len=model_max_len(ref.flags, model))
    cache = ReferenceCache(inputs.cache_dir / "quality")
    note("quality reference: the full-precision config's greedy outputs "
         f"({len(probe.prompts)} prompts; cached after the first study)")

    def start() -> Any:
        return VllmServer(model=str(model), flags=ref.flags, env=ref.env,
                          log_path=inputs.log_dir / "quality-reference.log",
                          cache_dir=inputs.cache_dir, start_timeout_s=settings.start_timeout_s,
                          cpu_kv_cache_gib=settings.cpu_kv_cache_gib)

    try:
        reference = ensure_reference(cache, model=model, reference_flags=ref.flags,
                                     reference_env=ref.env, probe=probe, start_server=start)
    except AutotuneError as exc:
        if settings.quality:
            raise StudyError(f"the quality reference could not be computed: {exc}") from exc
        note(f"quality probe off: the reference could not be computed ({exc})")
        return None, None
    return probe, reference


def _trial_plan(study: optuna.Study, settings: TuneSettings) -> TrialPlan:
    """The trials this run of the study can start: the sampler's (``--trials`` less the
    finished and the queued ones), the queued configs (the baseline, ``--enqueue``, a warm
    start's, a resumed study's retries), the running ones (a stale one runs again) and,
    when a re-check follows, the measured configs it may run again."""
    from optuna.trial import TrialState

    from autotune.kernels._study import TrialPlan

    trials = study.get_trials(deepcopy=False)
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    done = n_finished(study)
    fixed = [dict(t.system_attrs.get("fixed_params") or t.params) for t in waiting]
    fixed += [dict(t.params) for t in trials if t.state == TrialState.RUNNING]
    if settings.recheck:
        fixed += [dict(ts[0].params) for ts in readings(study).values()]
    labels: dict[str, int] = {}
    for t in waiting:
        label = ("re-check" if t.user_attrs.get(A.RECHECK_OF) is not None
                 else "baseline" if t.user_attrs.get(A.BASELINE)
                 else "retried config" if t.user_attrs.get(A.RETRY_OF) is not None
                 else "enqueued config")
        labels[label] = labels.get(label, 0) + 1
    items = [f"{done} finished"] if done else []
    items += ["the baseline" if label == "baseline" and n == 1 else f"{n} {label}(s)"
              for label, n in labels.items()]
    return TrialPlan(sampled=max(0, settings.trials - done - len(waiting)), fixed=tuple(fixed),
                     summary=f"--trials {settings.trials}, filled by "
                             f"{' + '.join(items) or 'nothing'}")


def _bind_kernels(inputs: StudyInputs, *, note: Callable[[str], None],
                  study: optuna.Study | None = None,
                  on_tuned: Callable[[Any], None] | None = None) -> SearchSpace:
    """Tune (or find cached) the kernels the space's ``tuned`` knobs point at, for the
    streams the trials replay (``--concurrency`` or the shape's). Their time counts toward
    ``--timeout``: at most a quarter of it goes to kernels. With the ``study`` opened, not
    when no trial it can run picks ``tuned`` (:func:`_trial_plan`)."""
    from autotune.kernels._study import bind_tuned_kernels

    settings = inputs.settings
    budget = settings.kernel_budget_s
    if settings.timeout_s is not None:
        budget = min(budget or math.inf, settings.timeout_s / 4)
    space = bind_tuned_kernels(
        inputs.space, model=inputs.model, shape_path=settings.shape,
        shape_fingerprint=inputs.shape.fingerprint, cache_dir=inputs.cache_dir,
        engine=inputs.engine, gpu_name=inputs.gpu_type, concurrency=settings.concurrency,
        budget_s=budget, trials=settings.kernel_trials,
        plan=_trial_plan(study, settings) if study is not None else None, note=note,
        on_tuned=on_tuned)
    for kind, folder in space.tuned_dirs.items():  # the study's results carry what it served
        shutil.copytree(folder, inputs.out_dir / "kernels" / kind, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("logs", ".*"))
    return space


def _default_executor(inputs: StudyInputs) -> Executor:
    settings = inputs.settings
    if settings.use_ray:
        from autotune.parallel import RayExecutor

        return RayExecutor(address=settings.ray_address, gpus_per_trial=inputs.gpus_per_trial,
                           slots=settings.parallel)
    from autotune.parallel import InlineExecutor

    return InlineExecutor()


def _subscribers(inputs: StudyInputs, tracker: Any, on_event: Any,
                 callbacks: Sequence[StudyCallback]) -> StudyCallbacks:
    """MLflow (unless ``tracker`` is False), trials.csv, then the caller's subscribers.

    The MLflow store is checked here, before the study exists: a wrong --tracking-uri must
    not leave behind a study that the corrected command then finds "already exists"."""
    from autotune.tracking import MlflowCallback, MlflowTracker

    subs: list[StudyCallback] = []
    if tracker is not False:
        if tracker is None:
            tracker = MlflowTracker(inputs.tracking_uri, experiment=inputs.settings.experiment)
        subs.append(MlflowCallback(tracker))
    subs.append(TrialsCsvCallback(inputs.out_dir / "trials.csv"))
    if on_event is not None:
        subs.append(EventListener(on_event))
    return StudyCallbacks([*subs, *callbacks])


def tune(
    settings: TuneSettings,
    *,
    executor: Executor | None = None,
    tracker: Any = None,
    sampler: BaseSampler | None = None,
    on_event: Callable[[StudyEvent], None] | None = None,
    warm_start: WarmStart | None = None,
    callbacks: Sequence[StudyCallback] = (),
    heartbeat: Heartbeat | None = None,
) -> TuneResult:
    """Run (or resume) a study as ``settings`` say and return its result.

    ``executor`` (default: a :class:`~autotune.parallel.RayExecutor`, or an
    :class:`~autotune.parallel.InlineExecutor` with ``use_ray=False``), ``tracker``
    (default: an :class:`~autotune.tracking.MlflowTracker`; False: no tracking at all) and
    ``sampler`` (default: :func:`make_sampler`) can be injected. ``on_event`` receives
    every :class:`StudyEvent`; ``callbacks`` subscribe to the study's events.
    ``warm_start`` (a :class:`autotune.registry.WarmStart`) adds an earlier study's trials
    as prior knowledge and enqueues its top configs. ``heartbeat``: Optuna heartbeat
    interval and grace period of this tuner's trials (default :class:`Heartbeat`: 10 s,
    120 s; other tuners of the study fail a trial as stale after the grace period without
    one). Raises :class:`AutotuneError`
    subclasses for bad input; failures of trials are recorded, never raised.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t_start = time.monotonic()
    node = node_of(executor) if executor is not None else None
    inputs = resolve_inputs(settings, heartbeat=heartbeat,
                            gpus=node.gpus if node is not None else None)
    settings = inputs.settings  # the objective resolved from the shape
    write_config(settings, inputs.out_dir / "config.yaml")
    subs = _subscribers(inputs, tracker, on_event, callbacks)
    study = open_study(inputs, sampler=sampler, warm_start=warm_start)
    ctx = StudyContext(study=study, settings=settings, space=inputs.space, shape=inputs.shape,
                       model=inputs.model, engine=inputs.engine, gpu_type=inputs.gpu_type,
                       out_dir=inputs.out_dir, tracking_uri=inputs.tracking_uri)
    # servers fork from one import of vLLM (the scope opens before Ray: workers inherit it)
    with preload_scope(settings.preload):
        runner = executor or _default_executor(inputs)
        # vLLM's parallelism rules for this model on the executor's nodes (autotune.placement)
        inputs = replace(inputs, space=with_parallel_rules(inputs.space, model=inputs.model,
                                                           executor=runner))
        loop = StudyLoop(study=study, settings=settings, space=inputs.space, executor=runner,
                         template=TrialTemplate(model=str(inputs.model), shape=inputs.shape,
                                                log_dir=str(inputs.log_dir),
                                                cache_dir=str(inputs.cache_dir)),
                         callbacks=subs, thresholds=inputs.thresholds, started=t_start,
                         owner=inputs.owner, heartbeat=inputs.heartbeat)
        try:
            subs.on_study_start(loop.event(
                "study_started", message=f"{n_finished(study)} finished trial(s) already"), ctx)
            _run(loop, inputs, subs)
        except Exception:
            _drop_if_empty(study, inputs)
            raise
        finally:
            if executor is None:
                runner.shutdown()
    result = write_results(ctx)
    subs.on_study_end(loop.event("study_finished"), result)
    return result


def _run(loop: StudyLoop, inputs: StudyInputs, subs: StudyCallbacks) -> None:
    """The quality reference (when lossy trials are probed), then the loop; an error or an
    interrupt stops the trials in flight and tells the subscribers."""
    try:
        _prepare(loop, inputs, subs)
        loop.run()
    except BaseException as exc:
        try:
            loop.interrupt()
        except Exception as stop_exc:  # noqa: BLE001 - the error that stopped it comes first
            logger.warning("the trials in flight could not be marked stopped (%s); the next "
                           "--resume fails them", redact(str(stop_exc)))
        why = ("interrupted" if isinstance(exc, KeyboardInterrupt)
               else f"error: {redact(str(exc)) or type(exc).__name__}")
        subs.on_study_end(replace(loop.stopped_event(), message=why), None)
        raise


def _drop_if_empty(study: optuna.Study, inputs: StudyInputs) -> None:
    """A new study that an error stopped before any trial ran (queued, or stopped by the
    error itself) is deleted: the corrected command must not find it "already exists", nor
    a dashboard list it empty. An interrupted one stays for --resume."""
    import optuna
    from optuna.trial import TrialState

    def ran(t: Any) -> bool:
        return t.state != TrialState.WAITING and not (
            t.state == TrialState.FAIL and t.user_attrs.get(A.REASON) in STOPPED)

    if inputs.settings.resume:
        return
    try:
        if any(ran(t) for t in study.get_trials(deepcopy=False)):
            return
        optuna.delete_study(study_name=study.study_name, storage=inputs.storage)
        logger.info("study %s removed: it stopped before any trial ran", study.study_name)
    except Exception as exc:  # noqa: BLE001 - the error that stopped the study comes first
        logger.info("study %s: whether any trial ran could not be checked (%s); kept",
                    study.study_name, redact(str(exc)))


def _prepare(loop: StudyLoop, inputs: StudyInputs, subs: StudyCallbacks) -> None:
    """What runs before the first trial: the routing note, the tuned kernels, the quality
    reference (when lossy trials are probed)."""
    settings = inputs.settings
    base = inputs.space.launch_spec(inputs.space.baseline_params(), baseline=True)
    routing = dummy_routing_warning(
        inputs.model, base.flags, base.env,
        fix=f"set {ROUTING_SIMULATION_ENV}: uniform_random in the space's stand_in.fixed_env")
    if routing:  # a space of the user's own for a MoE stand-in, without the simulator
        subs.on_note(loop.event("note", message=routing))
    if inputs.space.tuned_kinds():
        loop.space = _bind_kernels(
            inputs, note=lambda m: subs.on_note(loop.event("note", message=m)), study=loop.study,
            on_tuned=lambda r: loop.gpu_time.add_kernels(r.seconds, r.gpus))
    if inputs.lossy_in_space and (settings.quality_probe or inputs.thresholds is not None):
        probe, reference = _quality_reference(
            inputs, note=lambda m: subs.on_note(loop.event("note", message=m)))
        loop.template = replace(loop.template, quality_probe=probe, quality_reference=reference)
