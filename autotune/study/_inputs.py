"""A study's inputs: settings, shape, space and storage resolved before any server
starts; the sampler; opening, resuming or warm-starting the Optuna study.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from autotune.config import DEFAULT_OUT_ROOT, TuneSettings, store_where
from autotune.credentials import redact_settings, warn_if_password
from autotune.engine import EngineInfo, detect_engine
from autotune.errors import AutotuneError, ConfigError, SpaceError, StudyError
from autotune.hardware import gpu_arch, gpu_names, gpu_type
from autotune.space import (
    ModelFacts,
    SearchSpace,
    load_space,
)
from autotune.store import (
    STOPPED,
    A,
    Heartbeat,
    Owner,
    fail_stale_trials,
    latest_study,
    open_storage,
)
from autotune.study._objective import ResolvedStudy, replayed_shape, resolve_study
from autotune.study._preflight import check_before_trial_0, check_vocab_size

if TYPE_CHECKING:

    import optuna
    from optuna.samplers import BaseSampler
    from optuna.storages import BaseStorage

    from autotune.quality import QualityThresholds
    from autotune.results import Learned, WarmStart
    from autotune.traffic import TrafficShape

logger = logging.getLogger(__name__)


def make_sampler(settings: TuneSettings) -> BaseSampler:
    """The sampler ``--sampler`` names: TPE with constraints (Bayesian; observations
    copied from earlier studies weighted, :class:`WeightedTPESampler`) or random."""
    import warnings

    import optuna

    from autotune.study._sampler import WeightedTPESampler

    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    n_startup = max(3, min(10, settings.trials // 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Constraints come from trial.set_constraint(); TPE ranks infeasible trials last.
        return WeightedTPESampler(
            seed=settings.seed,
            n_startup_trials=n_startup,
            multivariate=True,
            group=True,  # conditional knobs (e.g. stochastic rounding only with float16)
            constant_liar=True,  # parallel trials do not all sample the same point
        )


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
            raise StudyError(
                f"--resume: no study in {store_where(settings.storage)} to resume; a study "
                "keeps its stores in its --out folder: give the same --out (or its "
                "--storage)")
    if name is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        name = f"{space.name}-{shape.name}-{stamp}".replace(" ", "_")
    existing = {s.study_name for s in optuna.get_all_study_summaries(storage, False)}
    if name in existing and not settings.resume:
        raise StudyError(
            f"study {name!r} already exists in {store_where(settings.storage)}; pass --resume to "
            "continue it, or choose another --study-name"
        )
    if settings.resume and name not in existing:
        raise StudyError(
            f"--resume: study {name!r} is not in {store_where(settings.storage)}; "
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


def _traffic_streams(shape: TrafficShape, concurrency: int | None) -> int:
    """Concurrent streams of the shape's replay (the space fact ``streams``), as the
    kernel tuner counts them; 0 when the shape says neither concurrency nor rate."""
    from autotune.kernels import streams_of

    try:
        return streams_of(shape, concurrency)[0]
    except ConfigError:
        return 0


def resolve_inputs(settings: TuneSettings | ResolvedStudy, *,
                   heartbeat: Heartbeat | None = None, gpus: int | None = None) -> StudyInputs:
    """Read and check everything a study needs (model, shape, space, storage, names);
    ``settings`` resolved already (:func:`resolve_study`) keep their shape and objective.

    ``heartbeat``: how often this tuner's running trials get Optuna heartbeats and after
    how long without one another tuner fails them (default :class:`Heartbeat`). ``gpus``:
    the GPUs of the largest node the trials run on (the space's fact ``gpus``; default:
    this machine's)."""
    from autotune.load import model_vocab_size
    from autotune.results import default_tracking_uri
    given = settings.settings if isinstance(settings, ResolvedStudy) else settings
    model = given.model.resolve()
    if not (model / "config.json").exists():
        raise AutotuneError(
            f"--model {given.model}: no config.json there; point it at a local model "
            "directory (make a tiny one with 'autotune model tiny models/tiny')"
        )
    check_vocab_size(given.model)  # the prompts need it, named as the user gave it
    model_vocab_size(model)  # checked before any store is opened
    resolved = resolve_study(settings)  # --objective auto, or refused here
    settings, shape = resolved.settings, resolved.shape
    if settings.objective != "capacity":  # an open loop with --concurrency N: closed loop
        shape = replayed_shape(shape, settings.measure.concurrency)
    info = detect_engine()
    cuda = info.device == "cuda"
    if gpus is None:
        gpus = len(gpu_names()) if cuda else 0
    facts = ModelFacts.from_model_dir(model, device=info.device,
                                      gpu_arch=gpu_arch() if cuda else "", gpus=gpus).with_traffic(
        streams=_traffic_streams(shape, settings.measure.concurrency),
        prompt_p90=shape.input_tokens.p90)
    space = load_space(settings.space, facts=facts)
    enqueued = [_complete_params(space, p, f"--enqueue #{i + 1}")
                for i, p in enumerate(settings.enqueue)]
    # flags against the installed vLLM's parser, the shape against the context: before the
    # storage, the folders or any server (issue 18)
    check_before_trial_0(space=space, shape=shape, model=model, settings=settings)
    if settings.objective == "capacity":
        from autotune.trial import recorded_rate

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
        cache_dir=settings.measure.cache_path(),
        thresholds=_quality_thresholds(settings, space),
        lossy_in_space=any(k.lossy for k in space.knobs.values()), heartbeat=heartbeat,
    )  # fmt: skip


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
        attrs: dict[str, object] = {A.RETRY_OF: t.number}
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
               warm_start: WarmStart | None = None,
               learned: Learned | None = None) -> optuna.Study:
    """Create the study (its attributes, baseline, enqueued configs, warm start and the
    ``learned`` priors of earlier studies) or, on
    ``--resume``, load it, fail the trials that tuners now gone left running
    (:func:`autotune.schema.fail_stale_trials`) and retry them."""
    import optuna

    settings = inputs.settings
    try:
        directions: list[Literal["maximize", "minimize"]] = (
            ["maximize", "minimize"] if settings.objective == "pareto" else ["maximize"])
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
        if learned is not None and learned.prior_trials:  # after the queued configs
            study.add_trials(learned.prior_trials)
    return study
