"""The study: create or resume it, drive ask/tell over an executor, pick and record the best.

Optuna's storage is the source of truth. How trials are stored:

* a measured trial is ``COMPLETE`` with the objective as its value and constraint values
  (SLO and error-rate violations; > 0 means infeasible) that the sampler learns from;
* a trial whose server failed (invalid flags, out of memory, crash, start timeout, ...) or
  whose sample broke a rule of the space is ``PRUNED`` with a constraint violation of 1 and
  the reason in ``user_attrs["autotune.reason"]``: the TPE sampler treats it as an
  infeasible point and learns to avoid the region; it is never scored as throughput 0;
* a trial that was running when the tuner died is ``FAIL`` with reason ``tuner_died`` (or
  ``interrupted`` after SIGINT/SIGTERM); such a trial says nothing about its config, so it
  does not count toward ``--trials`` and ``--resume`` runs its config again (a new trial
  with ``autotune.retry_of``; re-check trials are re-enqueued by the re-check phase itself).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from autotune.config import DEFAULT_OUT_ROOT, SLO_KEYS, TuneSettings
from autotune.engine import FailureReason, detect_engine, serve_command
from autotune.errors import AutotuneError, ConfigError, SpaceError, StudyError
from autotune.preflight import check_before_trial_0
from autotune.space import ModelFacts, SearchSpace, load_space
from autotune.trial import TrialOutcome, TrialSpec

__all__ = [
    "A",
    "StudyEvent",
    "TuneResult",
    "objective_metric",
    "goodput_slo",
    "open_storage",
    "tune",
    "write_json_atomic",
]

logger = logging.getLogger(__name__)


class A:
    """Names of the user attributes autotune sets on Optuna trials and studies."""

    STATE = "autotune.state"  # "ok" | "failed" | "infeasible"
    REASON = "autotune.reason"
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
    GPUS = "autotune.gpus"
    MLFLOW_RUN = "autotune.mlflow_run_id"
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


_N_CONSTRAINTS = 4  # [failed or rejected, SLO, error rate, quality] violations


def _constraints(trial: Any) -> list[float]:
    """Constraint values of a finished trial (> 0 = violated)."""
    return [float(v) for v in getattr(trial, "constraints", {}).values()] or list(
        trial.user_attrs.get(A.CONSTRAINTS, [0.0] * _N_CONSTRAINTS)
    )


def _set_constraints(trial: Any, *, failed: float, slo: float, errors: float,
                     quality: float = 0.0) -> None:
    """Record constraint values (Optuna's samplers treat any value > 0 as infeasible)."""
    values = {"failed": failed, "slo": slo, "errors": errors, "quality": quality}
    for key, value in values.items():
        trial.set_constraint(key, float(value))
    trial.set_user_attr(A.CONSTRAINTS, list(values.values()))


def objective_metric(objective: str) -> str:
    """The Measurement.flat() key an objective maximises (Pareto: its first objective)."""
    return {"throughput": "output_tokens_per_s", "goodput": "goodput_rps",
            "pareto": "output_tokens_per_s"}[objective]


@dataclass
class StudyEvent:
    """Progress of a study, for displays: ``kind`` in study_started, trial_started,
    trial_finished, study_finished."""

    kind: str
    study_name: str
    done: int
    total: int
    running: int
    best_value: float | None = None
    best_number: int | None = None
    baseline_value: float | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None
    trial_number: int | None = None
    trial_ok: bool | None = None
    trial_value: float | None = None
    trial_reason: str | None = None
    trial_params: dict[str, Any] = field(default_factory=dict)
    message: str = ""


@dataclass
class TuneResult:
    """The outcome of :func:`tune`."""

    study_name: str
    storage: str
    out_dir: Path
    best: dict[str, Any] | None  # the content of best.json (None when no trial succeeded)
    n_trials: int
    n_ok: int
    n_failed: int
    tracking_uri: str
    failures_by_reason: dict[str, int]


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON via a temp file and ``os.replace`` so readers never see half a file."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    _write_atomic(path, lambda tmp: tmp.write_text(text))


def _write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` then ``os.replace(tmp, path)``; OSError becomes a StudyError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise _write_error(path, exc) from exc
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_error(path: Path, exc: OSError) -> StudyError:
    return StudyError(
        f"cannot write {path}: {exc.strerror or exc}; free space or choose another --out, "
        "then continue with --resume (every finished trial is in the Optuna storage)"
    )


def open_storage(url: str) -> Any:
    """An Optuna RDB storage; SQLite files get their folder and a generous lock timeout."""
    import optuna

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
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


def _make_sampler(settings: TuneSettings) -> Any:
    import optuna

    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    import warnings

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


def _default_study_name(space: SearchSpace, shape: Any) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{space.name}-{shape.name}-{stamp}".replace(" ", "_")


def _latest_study(storage: Any) -> str | None:
    import optuna

    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    summaries = [s for s in summaries if s.datetime_start is not None]
    if not summaries:
        return None
    return max(summaries, key=lambda s: s.datetime_start).study_name


def _nvidia_smi(field: str) -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _gpu_type() -> str:
    return _nvidia_smi("name") or "unknown"


def _gpu_arch() -> str:
    cap = _nvidia_smi("compute_cap")  # "9.0" on Hopper
    return "sm" + cap.replace(".", "") if cap else ""


def tune(
    settings: TuneSettings,
    *,
    executor: Any = None,
    tracker: Any = None,
    sampler: Any = None,
    on_event: Callable[[StudyEvent], None] | None = None,
    warm_start: Any = None,
) -> TuneResult:
    """Run (or resume) a study as ``settings`` say and return its result.

    ``executor`` (default: a :class:`~autotune.parallel.RayExecutor`), ``tracker`` (default:
    an :class:`~autotune.tracking.MlflowTracker`) and ``sampler`` (default: TPE with
    constraints) can be injected. ``warm_start`` (a :class:`autotune.registry.WarmStart`)
    adds an earlier study's trials as prior knowledge and enqueues its top configs. Raises :class:`AutotuneError` subclasses for bad input;
    failures of trials are recorded, never raised.
    """
    import optuna

    from autotune.traffic import load_shape

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t_start = time.monotonic()
    emit = on_event or (lambda e: None)

    # -- inputs (fail before any server starts) ---------------------------------------------
    model = settings.model.resolve()
    if not (model / "config.json").exists():
        raise AutotuneError(
            f"--model {settings.model}: no config.json there; point it at a local model "
            "directory (make a tiny one with 'autotune model tiny models/tiny')"
        )
    shape = load_shape(settings.shape)
    info = detect_engine()
    gpu_type = _gpu_type() if info.device == "cuda" else "cpu"
    facts = ModelFacts.from_model_dir(
        model, device=info.device, gpu_arch=_gpu_arch() if info.device == "cuda" else ""
    )
    space = load_space(settings.space, facts=facts)
    enqueued = [_complete_params(space, p, f"--enqueue #{i + 1}")
                for i, p in enumerate(settings.enqueue)]
    gpus_per_trial = settings.gpus_per_trial
    if gpus_per_trial is None:
        gpus_per_trial = 1 if info.device == "cuda" else 0

    storage = open_storage(settings.storage)
    study_name = settings.study_name
    if settings.resume and study_name is None:
        study_name = _latest_study(storage)
        if study_name is None:
            raise StudyError(f"--resume: no study in {settings.storage} to resume")
    if study_name is None:
        study_name = _default_study_name(space, shape)
    existing = {s.study_name for s in optuna.get_all_study_summaries(storage, False)}
    if study_name in existing and not settings.resume:
        raise StudyError(
            f"study {study_name!r} already exists in {settings.storage}; pass --resume to "
            "continue it, or choose another --study-name"
        )
    if settings.resume and study_name not in existing:
        raise StudyError(
            f"--resume: study {study_name!r} is not in {settings.storage}; "
            f"known studies: {', '.join(sorted(existing)) or 'none'}"
        )
    out_dir = (settings.out or DEFAULT_OUT_ROOT / study_name).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    tracking_uri = settings.tracking_uri or _default_tracking(settings)
    cache_dir = (settings.cache_dir or Path.home() / ".cache" / "autotune").expanduser()

    _check_satisfiable(space)
    check_before_trial_0(space=space, shape=shape, model=model, settings=settings)
    # The store is checked before the study exists: a wrong --tracking-uri must not leave
    # behind a study that the corrected command then finds "already exists".
    if tracker is None:
        from autotune.tracking import MlflowTracker

        tracker = MlflowTracker(tracking_uri, experiment=settings.experiment)

    thresholds = None
    if settings.quality:
        from autotune.quality import parse_quality

        thresholds = parse_quality(settings.quality)
    lossy_in_space = any(k.lossy for k in space.knobs.values())
    if thresholds is not None and not lossy_in_space:
        raise ConfigError(
            f"--quality was given but the space {space.name} marks no knob 'lossy: true'; "
            "nothing would be probed"
        )

    sampler = sampler or _make_sampler(settings)
    try:
        directions = (["maximize", "minimize"] if settings.objective == "pareto"
                      else ["maximize"])
        study = optuna.create_study(
            storage=storage, study_name=study_name, directions=directions, sampler=sampler,
            load_if_exists=settings.resume,
        )  # fmt: skip
    except Exception as exc:
        raise StudyError(f"cannot create or load study {study_name!r}: {exc}") from exc

    if settings.resume:
        prev_shape = study.user_attrs.get(A.SHAPE)
        if prev_shape and prev_shape != shape.fingerprint:
            raise StudyError(
                f"--resume: study {study_name!r} was tuned for shape {prev_shape[:12]}, but "
                f"{settings.shape} is {shape.fingerprint[:12]}; use the same shape, or start "
                "a new study (autotune retune compares shapes)"
            )
        _fail_stale(study)
        _retry_stopped(study)
    else:
        for key, value in {
            A.MODEL: str(model), A.SHAPE: shape.fingerprint, A.SHAPE_PATH: str(settings.shape),
            A.SPACE: space.name, A.SPACE_PATH: str(settings.space),
            A.ENGINE: f"{info.package} {info.version}", A.GPU: gpu_type,
            A.SETTINGS: settings.model_dump(mode="json"),
        }.items():  # fmt: skip
            study.set_user_attr(key, value)
        if settings.baseline:
            study.enqueue_trial(space.baseline_params(), user_attrs={A.BASELINE: True})
        for params in enqueued:
            study.enqueue_trial(params, user_attrs={A.ENQUEUED: True})
        if warm_start is not None:
            # Enqueue first: the priors hold the same params and would make them "exist".
            bases = warm_start.enqueue_baseline or [False] * len(warm_start.enqueue)
            for params, was_base in zip(warm_start.enqueue, bases, strict=True):
                if was_base:  # the old defaults won: measure vLLM's defaults (no knob flags)
                    if not settings.baseline:
                        study.enqueue_trial(space.baseline_params(),
                                            user_attrs={A.BASELINE: True, A.ENQUEUED: True})
                    continue
                study.enqueue_trial(_complete_params(space, params, "warm start"),
                                    user_attrs={A.ENQUEUED: True})
            if warm_start.prior_trials:
                study.add_trials(warm_start.prior_trials)

    # -- tracking -----------------------------------------------------------------------------
    from autotune.tracking import TAGS

    base_tags = {
        TAGS["shape"]: shape.fingerprint,
        TAGS["shape_name"]: shape.name,
        TAGS["model"]: str(model),
        TAGS["engine"]: f"{info.package} {info.version}",
        TAGS["gpu"]: gpu_type,
        TAGS["space"]: space.name,
        TAGS["study"]: study_name,
    }
    parent = tracker.start_study(
        study_name=study_name,
        tags=base_tags,
        params={"trials": settings.trials, "objective": settings.objective,
                "sampler": settings.sampler, "seed": settings.seed, "slo": settings.slo,
                "repeats": settings.repeats, "space": str(settings.space),
                "shape": str(settings.shape), "storage": settings.storage},
        resume_run_id=study.user_attrs.get(A.MLFLOW_PARENT) if settings.resume else None,
    )  # fmt: skip
    if parent and not settings.resume:
        study.set_user_attr(A.MLFLOW_PARENT, parent)

    own_executor = executor is None
    if executor is None:
        if settings.use_ray:
            from autotune.parallel import RayExecutor

            executor = RayExecutor(address=settings.ray_address, gpus_per_trial=gpus_per_trial,
                                   slots=settings.parallel)
        else:
            from autotune.parallel import InlineExecutor

            executor = InlineExecutor()

    metric = objective_metric(settings.objective)
    slo_obj = _goodput_slo(settings)
    flights: dict[int, tuple[Any, dict[str, Any], Any, bool]] = {}
    walls: list[float] = []
    finished_before = _n_finished(study)
    rejected_in_a_row = 0

    target = [settings.trials]  # grows by the re-check trials
    phase = ["search"]  # then "recheck": the time budget bounds the search alone

    def progress(kind: str, **kw: Any) -> None:
        best = _best_trial(study)
        base = _baseline_trial(study)
        done = _n_finished(study)
        remaining = max(0, target[0] - done)
        eta = None
        if walls:
            eta = sum(walls) / len(walls) * math.ceil(remaining / max(1, executor.slots))
        emit(StudyEvent(
            kind=kind, study_name=study_name, done=done, total=target[0],
            running=len(flights), best_value=_primary(best) if best else None,
            best_number=best.number if best else None,
            baseline_value=_primary(base) if base else None,
            elapsed_s=time.monotonic() - t_start, eta_s=eta, **kw,
        ))  # fmt: skip

    progress("study_started", message=f"{finished_before} finished trial(s) already")
    probe = reference = None
    if lossy_in_space and (settings.quality_probe or thresholds is not None):
        probe, reference = _quality_reference(space, shape, model, settings, cache_dir, log_dir,
                                              emit_note=lambda m: progress("note", message=m))

    t_loop = time.monotonic()  # the time budget counts from here (Ray and MLflow are up)

    def more() -> bool:
        if (phase[0] == "search" and settings.timeout_s is not None
                and time.monotonic() - t_loop > settings.timeout_s):
            return False  # time budget spent: let running trials finish, start no new one
        return _n_finished(study) + len(flights) < target[0]

    def run_loop() -> None:
        nonlocal rejected_in_a_row
        while more() or flights:
            while len(flights) < executor.slots and more():
                trial = study.ask()
                is_base = bool(trial.user_attrs.get(A.BASELINE))
                params = space.suggest(trial, baseline=is_base)
                problems = space.violations(params)
                if problems and not is_base:
                    rejected_in_a_row += 1
                    if rejected_in_a_row > 200:
                        raise StudyError(
                            f"the space {space.name} rejected 200 samples in a row (last: "
                            f"{problems[0]}); its rules exclude almost everything - fix them"
                        )
                    _mark_failed(trial, FailureReason.REJECTED, "; ".join(problems))
                    _log_trial(tracker, trial.number, params, (), {}, {}, base_tags, False,
                               FailureReason.REJECTED, None, {"violations": problems})
                    _commit_tell(study, trial, None)
                    continue
                rejected_in_a_row = 0
                launch = space.launch_spec(params, baseline=is_base)
                trial.set_user_attr(A.FLAGS, list(launch.flags))
                trial.set_user_attr(A.ENV, dict(launch.env))
                spec = TrialSpec(
                    number=trial.number, model=str(model), flags=launch.flags,
                    env=dict(launch.env), shape=shape, seed=settings.seed,
                    warmup_requests=settings.warmup_requests, repeats=settings.repeats,
                    slo=slo_obj, api=settings.api, num_requests=settings.num_requests,
                    concurrency=settings.concurrency,
                    start_timeout_s=settings.start_timeout_s,
                    request_timeout_s=settings.request_timeout_s, log_dir=str(log_dir),
                    cache_dir=str(cache_dir), cpu_kv_cache_gib=settings.cpu_kv_cache_gib,
                    quality_probe=probe if (not is_base and space.lossy_knobs(params)) else None,
                    quality_reference=reference,
                )  # fmt: skip
                executor.submit(spec)
                flights[trial.number] = (trial, params, launch, is_base)
                progress("trial_started", trial_number=trial.number, trial_params=params)
            for outcome in executor.wait(timeout_s=5.0):
                trial, params, launch, is_base = flights.pop(outcome.number)
                lossy = (not is_base) and bool(space.lossy_knobs(params))
                value, state, reason = _prepare_tell(trial, outcome, metric, settings,
                                                     thresholds=thresholds, lossy=lossy)
                walls.append(outcome.wall_s)
                # Optuna first: a tracking store that hangs must not cost a measured trial.
                _commit_tell(study, trial, value)
                rid = _log_trial(
                    tracker, outcome.number, params, launch.flags, launch.env, outcome.metrics,
                    {**base_tags, TAGS["state"]: state,
                     **({"autotune.baseline": "true"} if is_base else {})},
                    state == "ok", reason, outcome.log_path, outcome.to_dict(),
                )  # fmt: skip
                if rid:
                    study.set_user_attr(f"{A.MLFLOW_RUN}.{trial.number}", rid)
                _write_trials_csv(study, out_dir / "trials.csv")
                progress("trial_finished", trial_number=outcome.number, trial_ok=outcome.ok,
                         trial_value=value[0] if isinstance(value, list) else value,
                         trial_reason=reason, trial_params=params,
                         message=outcome.message.splitlines()[0] if outcome.message else "")

    def run_all() -> None:
        run_loop()
        if settings.recheck:
            phase[0] = "recheck"
            n = _enqueue_rechecks(study, settings.recheck)
            if n:
                target[0] = _n_finished(study) + n
                progress("recheck_started", message=(
                    f"re-measuring the top {settings.recheck} config(s) and the baseline "
                    f"({n} trials) before declaring a winner"))
                run_loop()

    try:
        try:
            run_all()
        except optuna.exceptions.StorageInternalError as exc:
            raise StudyError(
                f"the Optuna storage {settings.storage} failed mid-study ({exc}); every "
                "finished trial is kept there: fix the storage, then continue with --resume"
            ) from exc
    except BaseException:
        cancelled = executor.cancel_all()
        for n in cancelled:
            if n in flights:
                trial = flights.pop(n)[0]
                _mark_failed(trial, _INTERRUPTED, "the tuner was interrupted")
                _commit_tell(study, trial, None, fail=True)
        tracker.end_study(ok=False)
        raise
    finally:
        if own_executor:
            executor.shutdown()

    result = _finish(study, settings, space, shape, model, info, out_dir, tracker, tracking_uri)
    progress("study_finished")
    return result


def _config_key(t: Any) -> str:
    """Trials with the same key ran the same engine config."""
    return json.dumps({"baseline": bool(t.user_attrs.get(A.BASELINE)), "params": t.params},
                      sort_keys=True, default=str)


def _readings(study: Any) -> dict[str, list[Any]]:
    """Feasible measured trials of this study grouped by config (rechecks included)."""
    groups: dict[str, list[Any]] = {}
    for t in study.get_trials(deepcopy=False):
        if _feasible(t):
            groups.setdefault(_config_key(t), []).append(t)
    return groups


def _enqueue_rechecks(study: Any, k: int) -> int:
    """Enqueue one more reading of the top ``k`` configs and of the baseline, interleaved
    (leaders first, baseline last), skipping configs already re-measured. Returns how many."""
    groups = _readings(study)
    ranked = sorted(groups.values(), key=lambda ts: max(_primary(t) for t in ts), reverse=True)
    chosen = ranked[:k]
    base = next((ts for ts in groups.values() if ts[0].user_attrs.get(A.BASELINE)), None)
    if base is not None and all(ts is not base for ts in chosen):
        chosen.append(base)
    n = 0
    for ts in chosen:
        if len(ts) > 1 or any(t.user_attrs.get(A.RECHECK_OF) is not None for t in ts):
            continue  # already has more than one reading
        first = ts[0]
        attrs: dict[str, Any] = {A.RECHECK_OF: first.number}
        if first.user_attrs.get(A.BASELINE):
            attrs[A.BASELINE] = True
        study.enqueue_trial(dict(first.params), user_attrs=attrs)
        n += 1
    return n


def _quality_reference(space: SearchSpace, shape: Any, model: Path, settings: TuneSettings,
                       cache_dir: Path, log_dir: Path, emit_note: Callable[[str], None]
                       ) -> tuple[Any, Any]:
    """The probe and the reference outputs (cached per model, probe and flags; computed on
    one extra server start the first time)."""
    from autotune.engine import VllmServer
    from autotune.quality import (
        QualitySpec, ReferenceCache, build_probe, ensure_reference, reference_params,
    )
    from autotune.trial import model_max_len, model_vocab_size

    ref = space.launch_spec(reference_params(space))
    # On the CPU build batching does not change outputs (seen bit-exact): probe 8 at a time.
    conc = 8 if detect_engine().device == "cpu" else 1
    probe = build_probe(shape, vocab_size=model_vocab_size(model),
                        text_model=model if space.facts.real_weights else None,
                        spec=QualitySpec(seed=settings.seed, concurrency=conc, n_prompts=32),
                        max_model_len=model_max_len(ref.flags, model))
    cache = ReferenceCache(cache_dir / "quality")
    emit_note("quality reference: the full-precision config's greedy outputs "
              f"({len(probe.prompts)} prompts; cached after the first study)")

    def start() -> Any:
        return VllmServer(model=str(model), flags=ref.flags, env=ref.env,
                          log_path=log_dir / "quality-reference.log", cache_dir=cache_dir,
                          start_timeout_s=settings.start_timeout_s,
                          cpu_kv_cache_gib=settings.cpu_kv_cache_gib)

    try:
        reference = ensure_reference(cache, model=model, reference_flags=ref.flags,
                                     reference_env=ref.env, probe=probe, start_server=start)
    except AutotuneError as exc:
        if settings.quality:
            raise StudyError(f"the quality reference could not be computed: {exc}") from exc
        emit_note(f"quality probe off: the reference could not be computed ({exc})")
        return None, None
    return probe, reference


def _mlflow_run(study: Any, t: Any) -> str | None:
    """The MLflow run id of a trial (kept on the study: the trial is final when it is logged)."""
    rid = study.user_attrs.get(f"{A.MLFLOW_RUN}.{t.number}") or t.user_attrs.get(A.MLFLOW_RUN)
    return str(rid) if rid else None


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


def _default_tracking(settings: TuneSettings) -> str:
    from autotune.tracking import default_tracking_uri

    return default_tracking_uri(DEFAULT_OUT_ROOT)


def _goodput_slo(settings: TuneSettings) -> Any:
    return goodput_slo(settings.slo)


def goodput_slo(slo: dict[str, float]) -> Any:
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


# Reasons that say nothing about the config: the tuner stopped while the trial ran.
_TUNER_DIED = "tuner_died"
_INTERRUPTED = "interrupted"
_STOPPED = (_TUNER_DIED, _INTERRUPTED)


def _n_finished(study: Any) -> int:
    """Trials that count toward ``--trials``: measured or failed by their config (not
    rejected samples, not priors copied from another study, not trials the tuner's own
    death or interruption stopped)."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
               and t.user_attrs.get(A.REASON) not in (FailureReason.REJECTED, *_STOPPED)
               and not t.user_attrs.get(A.PRIOR))


def _retry_stopped(study: Any) -> list[int]:
    """On resume: enqueue the config of each trial the tuner's end stopped, once.

    Re-check trials are left to the re-check phase, which enqueues what is still missing.
    Returns the numbers of the trials retried."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(A.RETRY_OF) for t in trials}
    out = []
    for t in trials:
        if (t.state != TrialState.FAIL or t.user_attrs.get(A.REASON) not in _STOPPED
                or t.number in retried or t.user_attrs.get(A.RECHECK_OF) is not None):
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


def _primary(t: Any) -> float:
    """The objective value (the first one for a Pareto study: throughput or goodput)."""
    return float(t.values[0])


def _feasible(t: Any) -> bool:
    from optuna.trial import TrialState

    return (t.state == TrialState.COMPLETE and not t.user_attrs.get(A.PRIOR)
            and all(c <= 0 for c in _constraints(t)))


def _best_trial(study: Any) -> Any:
    trials = [t for t in study.get_trials(deepcopy=False) if _feasible(t)]
    return max(trials, key=_primary) if trials else None


def _baseline_trial(study: Any) -> Any:
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(A.BASELINE) and t.state == TrialState.COMPLETE:
            return t
    return None


def _fail_stale(study: Any) -> None:
    """Trials left RUNNING by a tuner that died: FAIL them with reason ``tuner_died``."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        st = study._storage
        st.set_trial_user_attr(t._trial_id, A.STATE, "failed")
        st.set_trial_user_attr(t._trial_id, A.REASON, _TUNER_DIED)
        st.set_trial_user_attr(t._trial_id, A.MESSAGE,
                               "the tuner stopped while this trial was running")
        st.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        logger.warning("trial %d was running when the tuner died: marked failed", t.number)


def _mark_failed(trial: Any, reason: str, message: str) -> None:
    trial.set_user_attr(A.STATE, "failed")
    trial.set_user_attr(A.REASON, reason)
    trial.set_user_attr(A.MESSAGE, message[:4000])
    _set_constraints(trial, failed=1.0, slo=0.0, errors=0.0, quality=0.0)


def _commit_tell(study: Any, trial: Any, value: Any, *, fail: bool = False) -> None:
    """Finish the trial in the storage: COMPLETE with a value, else PRUNED (infeasible) or FAIL."""
    from optuna.trial import TrialState

    if value is not None:
        study.tell(trial, value)
    else:
        study.tell(trial, state=TrialState.FAIL if fail else TrialState.PRUNED)


def _prepare_tell(trial: Any, outcome: TrialOutcome, metric: str, settings: TuneSettings,
                  *, thresholds: Any = None, lossy: bool = False) -> tuple[Any, str, str | None]:
    """Set the trial's attributes from the outcome; return (value(s), state, reason)."""
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
    value = outcome.metrics.get(metric)
    if not outcome.ok or value is None or not math.isfinite(value):
        msg = outcome.message or "no measurement"
        if outcome.log_tail and outcome.reason not in (None, _INTERRUPTED):
            msg += "\n--- server log tail ---\n" + outcome.log_tail[-1500:]
        reason = outcome.reason or "no_measurement"
        _mark_failed(trial, reason, msg)
        return None, "failed", reason
    slo_violation = max(
        (outcome.metrics.get(SLO_KEYS[k], math.inf) / limit - 1.0
         for k, limit in settings.slo.items()),
        default=-1.0,
    )
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
    _set_constraints(trial, failed=0.0, slo=min(slo_violation, 1e6), errors=err_violation,
                     quality=q_violation)
    values: Any = float(value)
    if settings.objective == "pareto":
        latency = outcome.metrics.get(SLO_KEYS[settings.pareto_latency])
        if latency is None or not math.isfinite(latency):
            _mark_failed(trial, "no_measurement",
                         f"no {settings.pareto_latency} reading for the Pareto objective")
            return None, "failed", "no_measurement"
        values = [float(value), float(latency)]
    if slo_violation <= 0 and err_violation <= 0 and q_violation <= 0:
        trial.set_user_attr(A.STATE, "ok")
        return values, "ok", None
    why = []
    if slo_violation > 0:
        why.append("missed the SLOs: " + ", ".join(
            f"{k}={outcome.metrics.get(SLO_KEYS[k], float('nan')):.3g}s>{limit:g}s"
            for k, limit in settings.slo.items()
            if outcome.metrics.get(SLO_KEYS[k], math.inf) > limit))
    if err_violation > 0:
        why.append(f"error rate {outcome.metrics.get('error_rate', 0):.1%} > "
                   f"{settings.max_error_rate:.1%}")
    if q_violation > 0:
        q = outcome.quality or {}
        why.append(f"quality below --quality {settings.quality}: " + (
            f"agreement {q.get('exact_match_rate', float('nan')):.1%}" if q
            else outcome.quality_note or "no quality figures"))
    reason = (FailureReason.SLO if slo_violation > 0
              else "errors" if err_violation > 0 else "quality")
    trial.set_user_attr(A.STATE, "infeasible")
    trial.set_user_attr(A.REASON, reason)
    trial.set_user_attr(A.MESSAGE, "; ".join(why))
    return values, "infeasible", reason


def _log_trial(tracker: Any, number: int, params: dict[str, Any], flags: Any, env: Any,
               metrics: dict[str, float], tags: dict[str, str], ok: bool, reason: str | None,
               log_path: str | None, outcome: dict[str, Any] | None) -> str | None:
    from autotune.tracking import TAGS

    tags = dict(tags)
    if reason:
        tags[TAGS["reason"]] = reason
    tags.setdefault(TAGS["state"], "ok" if ok else "failed")
    return tracker.log_trial(number=number, params=params, flags=list(flags), env=dict(env),
                             metrics=metrics, tags=tags, ok=ok, log_path=log_path,
                             outcome=outcome)


def _pareto_front(study: Any) -> list[Any]:
    """Feasible trials no other feasible trial beats on both throughput and latency."""
    pts = [t for t in study.get_trials(deepcopy=False) if _feasible(t) and len(t.values) == 2]
    front = [
        t for t in pts
        if not any(o.values[0] >= t.values[0] and o.values[1] <= t.values[1]
                   and (o.values[0] > t.values[0] or o.values[1] < t.values[1]) for o in pts)
    ]
    return sorted(front, key=lambda t: -t.values[0])


def _verdict(study: Any) -> tuple[Any, list[float], Any, list[float]]:
    """The winner: the best median over configs measured more than once when any was
    re-measured (a lucky single reading cannot win), else the best single reading.
    Returns (winner's representative trial, its readings, baseline trial, its readings)."""
    groups = list(_readings(study).values())
    if not groups:
        return None, [], None, []
    multi = [ts for ts in groups if len(ts) > 1]
    pool = multi or groups
    win = max(pool, key=lambda ts: float(np.median([_primary(t) for t in ts])))
    med = float(np.median([_primary(t) for t in win]))
    rep = min(win, key=lambda t: abs(_primary(t) - med))  # the reading closest to the median
    base = next((ts for ts in groups if ts[0].user_attrs.get(A.BASELINE)), None)
    base_rep = min(base, key=lambda t: t.number) if base else None
    return rep, [_primary(t) for t in win], base_rep, [_primary(t) for t in base or []]


def _finish(study: Any, settings: TuneSettings, space: SearchSpace, shape: Any, model: Path,
            info: Any, out_dir: Path, tracker: Any, tracking_uri: str) -> TuneResult:
    from optuna.trial import TrialState

    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(A.PRIOR)]
    reasons: dict[str, int] = {}
    for t in trials:
        if t.user_attrs.get(A.STATE) in ("failed", "infeasible"):
            r = str(t.user_attrs.get(A.REASON, "unknown"))
            reasons[r] = reasons.get(r, 0) + 1
    n_ok = sum(1 for t in trials if _feasible(t))
    best_t, best_vals, base_t, base_vals = _verdict(study)
    metric = objective_metric(settings.objective)
    best: dict[str, Any] | None = None
    if best_t is not None:
        best_value = float(np.median(best_vals))
        base_value = float(np.median(base_vals)) if base_vals else None
        flags = list(best_t.user_attrs.get(A.FLAGS, []))
        env = dict(best_t.user_attrs.get(A.ENV, {}))
        cmd = serve_command(str(model), flags, env)
        metrics = dict(best_t.user_attrs.get(A.METRICS, {}))
        best = {
            "params": dict(best_t.params),
            "serve_command": cmd,
            "metrics": metrics,
            "objective": {"name": settings.objective, "metric": metric, "value": best_value},
            "readings": best_vals,
            "spread": (max(best_vals) - min(best_vals)) / best_value if best_value else None,
            "selection": (f"median of {len(best_vals)} readings (top configs re-measured)"
                          if len(best_vals) > 1 else "single reading"),
            "flags": flags,
            "env": env,
            "trial": best_t.number,
            "is_baseline": bool(best_t.user_attrs.get(A.BASELINE)),
            "baseline": (
                {"trial": base_t.number, "value": base_value, "readings": base_vals,
                 "metrics": base_t.user_attrs.get(A.METRICS, {})} if base_t else None
            ),
            "ratio_to_baseline": (best_value / base_value) if base_value else None,
            "study": study.study_name,
            "storage": settings.storage,
            "shape": {"name": shape.name, "fingerprint": shape.fingerprint,
                      "path": str(settings.shape)},
            "model": str(model),
            "space": {"name": space.name, "path": str(settings.space)},
            "engine": {"package": info.package, "version": info.version, "device": info.device},
            "slo": settings.slo,
            "seed": settings.seed,
            "mlflow_run_id": _mlflow_run(study, best_t),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "autotune_version": _version(),
        }
        if settings.objective == "pareto":
            best["pareto_latency"] = settings.pareto_latency
            best["pareto_front"] = [
                {"trial": t.number, "output_tokens_per_s": t.values[0],
                 settings.pareto_latency + "_s": t.values[1], "params": dict(t.params),
                 "serve_command": serve_command(str(model), t.user_attrs.get(A.FLAGS, []),
                                                t.user_attrs.get(A.ENV, {}))}
                for t in _pareto_front(study)
            ]
        write_json_atomic(out_dir / "best.json", best)
        script = ("#!/bin/sh\n# best config of study %s (trial %d)\n%s\n"
                  % (study.study_name, best_t.number, cmd))
        _write_atomic(out_dir / "serve_command.sh", lambda tmp: tmp.write_text(script))
        if _mlflow_run(study, best_t):
            tracker.mark_best(run_id=_mlflow_run(study, best_t),
                              shape_fingerprint=shape.fingerprint, best=best, serve_command=cmd)
        tracker.log_study_metrics({f"best_{k}": v for k, v in metrics.items()})
    _write_trials_csv(study, out_dir / "trials.csv")
    plots = _write_plots(study, out_dir / "plots")
    tracker.log_study_artifacts({**{f"plots/{p.name}": str(p) for p in plots.values()},
                                 "trials.csv": str(out_dir / "trials.csv")})
    summary = {
        "study": study.study_name, "storage": settings.storage, "tracking_uri": tracking_uri,
        "trials": len(trials), "ok": n_ok,
        "failed": sum(1 for t in trials if t.state in (TrialState.PRUNED, TrialState.FAIL)),
        "failures_by_reason": reasons,
        "best_trial": best_t.number if best_t else None,
        "best_value": best["objective"]["value"] if best else None,
        "baseline_value": best["baseline"]["value"] if best and best["baseline"] else None,
    }
    write_json_atomic(out_dir / "study.json", summary)
    tracker.set_study_tags({"autotune.n_ok": str(n_ok), "autotune.n_trials": str(len(trials))})
    tracker.end_study(ok=True)
    return TuneResult(
        study_name=study.study_name, storage=settings.storage, out_dir=out_dir, best=best,
        n_trials=len(trials), n_ok=n_ok, n_failed=summary["failed"], tracking_uri=tracking_uri,
        failures_by_reason=reasons,
    )  # fmt: skip


def _write_plots(study: Any, out: Path) -> dict[str, Path]:
    """Optimization history, parameter importances and the Pareto front as PNGs."""
    from autotune.plots import write_study_plots

    try:
        return write_study_plots(study, out)
    except AutotuneError as exc:  # plots are a convenience: never fail a finished study
        logger.warning("could not write the study plots: %s", exc)
        return {}


def _write_trials_csv(study: Any, path: Path) -> None:
    import pandas as pd

    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(A.PRIOR):
            continue  # copied from an earlier study by a warm start: not measured here
        row: dict[str, Any] = {
            "number": t.number, "state": t.user_attrs.get(A.STATE, t.state.name.lower()),
            "reason": t.user_attrs.get(A.REASON, ""), "value": _primary(t) if t.values else None,
            "baseline": bool(t.user_attrs.get(A.BASELINE)),
            "wall_s": t.user_attrs.get(A.WALL_S), "start_s": t.user_attrs.get(A.START_S),
        }  # fmt: skip
        row.update({f"param.{k}": v for k, v in t.params.items()})
        row.update({f"metric.{k}": v for k, v in t.user_attrs.get(A.METRICS, {}).items()})
        row["flags"] = " ".join(t.user_attrs.get(A.FLAGS, []))
        rows.append(row)
    _write_atomic(path, lambda tmp: pd.DataFrame(rows).to_csv(tmp, index=False))


def _version() -> str:
    from autotune import __version__

    return __version__
