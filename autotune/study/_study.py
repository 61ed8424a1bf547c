"""The study: create or resume it, drive ask/tell over an executor, pick and record the best.

:func:`tune` is three steps: :func:`resolve_inputs` (fail before any server starts),
:class:`StudyLoop` (ask -> suggest -> executor -> tell, then the re-check phase), and
:func:`autotune.results.write_results`. What a study stores in Optuna and how it is read
back (attribute keys, failure reasons, feasibility, the verdict) lives in
:mod:`autotune.store`; MLflow, ``trials.csv`` and progress displays subscribe to the
loop's events (:mod:`autotune.events`).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from autotune.config import TuneSettings
from autotune.credentials import redact
from autotune.engine import preload_scope
from autotune.errors import AutotuneError, StudyError
from autotune.events import (
    EventListener,
    StudyCallback,
    StudyCallbacks,
    StudyContext,
    StudyEvent,
)
from autotune.exec import with_parallel_rules
from autotune.results import (
    TrialsCsvCallback,
    TuneResult,
    write_config,
    write_results,
)
from autotune.space import (
    ROUTING_SIMULATION_ENV,
    SearchSpace,
    dummy_routing_warning,
)
from autotune.store import (
    STOPPED,
    A,
    Heartbeat,
    n_finished,
    readings,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import optuna
    from optuna.samplers import BaseSampler
    from optuna.trial import FrozenTrial

    from autotune.exec import Executor
    from autotune.kernels._study import TrialPlan
    from autotune.quality import ProbeOutputs, ProbeSet
    from autotune.results import Learned, WarmStart
from autotune.study._budget import BudgetPlan, plan_budget, prior_trial_seconds
from autotune.study._failmodel import FailureModel, failure_model
from autotune.study._inputs import StudyInputs, open_study, resolve_inputs
from autotune.study._loop import StudyLoop, TrialTemplate
from autotune.study._objective import ResolvedStudy

logger = logging.getLogger(__name__)


def _quality_probe(inputs: StudyInputs, flags: tuple[str, ...]) -> ProbeSet:
    """The study's probe: :func:`autotune.quality.build_probe` for its model, seed and
    device, within the context ``flags`` (the reference's) give; not the shape's."""
    from autotune.quality import QualitySpec, build_probe
    from autotune.trial import model_max_len, model_vocab_size

    model = inputs.model
    # On the CPU build batching does not change outputs (seen bit-exact): probe 8 at a time.
    conc = 8 if inputs.engine.device == "cpu" else 1
    return build_probe(vocab_size=model_vocab_size(model),
                       text_model=model if inputs.space.facts.real_weights else None,
                       spec=QualitySpec(seed=inputs.settings.seed, concurrency=conc,
                                        n_prompts=32),
                       max_model_len=model_max_len(flags, model))


def _quality_reference(inputs: StudyInputs, note: Callable[[str], None]
                       ) -> tuple[ProbeSet | None, ProbeOutputs | None]:
    """The probe and the reference outputs (cached per model, probe, flags and engine, for
    every shape; computed on one extra server start the first time)."""
    from autotune.engine import VllmServer
    from autotune.quality import ReferenceCache, ensure_reference, reference_params

    settings, model = inputs.settings, inputs.model
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
    probe = _quality_probe(inputs, ref.flags)
    cache = ReferenceCache(inputs.cache_dir / "quality")
    # the probe is the same for every shape: a study of the same model, flags and engine
    # reads the reference from the cache, whatever its shape
    cached = cache.load(cache.key(model=model, probe=probe, flags=ref.flags, env=ref.env))
    note("quality reference: the full-precision config's greedy outputs "
         f"({len(probe.prompts)} prompts of {len(probe.prompts[0])} tokens, the same for "
         "every shape; "
         + ("from the cache)" if cached is not None else
            "computed now on one server start, then cached for studies of this model and "
            "flags, any shape)"))

    def start() -> VllmServer:
        return VllmServer(model=str(model), flags=ref.flags, env=ref.env,
                          log_path=inputs.log_dir / "quality-reference.log",
                          cache_dir=inputs.cache_dir,
                          start_timeout_s=settings.measure.start_timeout_s,
                          cpu_kv_cache_gib=settings.measure.cpu_kv_cache_gib)

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
        engine=inputs.engine, gpu_name=inputs.gpu_type,
        concurrency=settings.measure.concurrency,
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
        from autotune.exec import RayExecutor

        return RayExecutor(address=settings.ray_address, gpus_per_trial=inputs.gpus_per_trial,
                           slots=settings.parallel)
    from autotune.exec import InlineExecutor

    return InlineExecutor()


def _subscribers(inputs: StudyInputs, tracker: Any, on_event: Any,
                 callbacks: Sequence[StudyCallback]) -> StudyCallbacks:
    """MLflow (unless ``tracker`` is False), trials.csv, then the caller's subscribers.

    The MLflow store is checked here, before the study exists: a wrong --tracking-uri must
    not leave behind a study that the corrected command then finds "already exists"."""
    from autotune.results import MlflowCallback, MlflowTracker

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
    settings: TuneSettings | ResolvedStudy,
    *,
    executor: Executor | None = None,
    tracker: Any = None,
    sampler: BaseSampler | None = None,
    on_event: Callable[[StudyEvent], None] | None = None,
    warm_start: WarmStart | None = None,
    callbacks: Sequence[StudyCallback] = (),
    heartbeat: Heartbeat | None = None,
) -> TuneResult:
    """Run (or resume) a study as ``settings`` say and return its result (``settings``
    resolved already, :func:`autotune.study.resolve_study`, keep their shape as read).

    ``executor`` (default: a :class:`~autotune.exec.RayExecutor`, or an
    :class:`~autotune.exec.InlineExecutor` with ``use_ray=False``), ``tracker``
    (default: an :class:`~autotune.results.MlflowTracker`; False: no tracking at all) and
    ``sampler`` (default: :func:`make_sampler`) can be injected. ``on_event`` receives
    every :class:`StudyEvent`; ``callbacks`` subscribe to the study's events.
    ``warm_start`` (a :class:`autotune.results.WarmStart`) adds an earlier study's trials
    as prior knowledge and enqueues its top configs. ``heartbeat``: Optuna heartbeat
    interval and grace period of this tuner's trials (default :class:`Heartbeat`: 10 s,
    120 s; other tuners of the study fail a trial as stale after the grace period without
    one). Raises :class:`AutotuneError`
    subclasses for bad input; failures of trials are recorded, never raised.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t_start = time.monotonic()
    node = executor.gpu_node() if executor is not None else None
    inputs = resolve_inputs(settings, heartbeat=heartbeat,
                            gpus=node.gpus if node is not None else None)
    settings = inputs.settings  # the objective resolved from the shape
    write_config(settings, inputs.out_dir / "config.yaml")
    subs = _subscribers(inputs, tracker, on_event, callbacks)
    learned = _learned(inputs, warm_start)
    study = open_study(inputs, sampler=sampler, warm_start=warm_start, learned=learned)
    ctx = StudyContext(study=study, settings=settings, space=inputs.space, shape=inputs.shape,
                       model=inputs.model, engine=inputs.engine, gpu_type=inputs.gpu_type,
                       out_dir=inputs.out_dir, tracking_uri=inputs.tracking_uri)
    # servers fork from one import of vLLM (the scope opens before Ray: workers inherit it)
    with preload_scope(settings.preload):
        runner = executor or _default_executor(inputs)
        # vLLM's parallelism rules for this model on the executor's nodes (autotune.exec)
        inputs = replace(inputs, space=with_parallel_rules(inputs.space, model=inputs.model,
                                                           executor=runner))
        plan = _budget_plan(inputs)
        failures = _failure_model(inputs)
        loop = StudyLoop(study=study, settings=settings, space=inputs.space, executor=runner,
                         template=TrialTemplate(model=str(inputs.model), shape=inputs.shape,
                                                log_dir=str(inputs.log_dir)),
                         callbacks=subs, thresholds=inputs.thresholds, started=t_start,
                         owner=inputs.owner, heartbeat=inputs.heartbeat, budget_plan=plan,
                         failure_model=failures)
        try:
            subs.on_study_start(loop.event(
                "study_started", message=f"{n_finished(study)} finished trial(s) already"
                + capacity_terms(settings)), ctx)
            for line in (learned.line() if learned else "", plan.line() if plan else "",
                         failures.intro() if failures else ""):
                if line:
                    subs.on_note(loop.event("note", message=line))
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


def _budget_plan(inputs: StudyInputs) -> BudgetPlan | None:
    """``--budget 2h``: what fits, at what a trial has cost on this engine and hardware in
    the study's store (None without a GPU budget)."""
    settings = inputs.settings
    if settings.gpu_budget_s is None:
        return None
    cost = prior_trial_seconds(
        inputs.storage, engine=f"{inputs.engine.package} {inputs.engine.version}",
        gpu=inputs.gpu_type, device=inputs.engine.device)
    return plan_budget(budget_s=settings.gpu_budget_s, cost=cost, trials=settings.trials,
                       recheck=settings.recheck, recheck_starts=settings.recheck_starts,
                       gpus_per_trial=max(1, inputs.gpus_per_trial))


def _learned(inputs: StudyInputs, warm_start: WarmStart | None) -> Learned | None:
    """A new study's priors from the earlier studies in its store on this model and
    hardware (None on ``--resume`` or with ``--no-learn``; a warm start's own study is
    left out: its trials come with it)."""
    from autotune.results import learn_from_store

    settings = inputs.settings
    if not settings.learn or settings.resume:
        return None
    exclude = {inputs.study_name} | ({warm_start.source_study} if warm_start else set())
    return learn_from_store(inputs.storage, shape=inputs.shape, model=str(inputs.model),
                            gpu=inputs.gpu_type, space=inputs.space,
                            objective=settings.objective, exclude=exclude)


def _failure_model(inputs: StudyInputs) -> FailureModel | None:
    """The model of start failures over the store's trials on this engine and hardware
    (a resumed study's own included; None with ``--no-failure-model``)."""
    settings = inputs.settings
    if not settings.failure_model:
        return None
    return failure_model(
        inputs.space, inputs.storage, engine=f"{inputs.engine.package} {inputs.engine.version}",
        gpu=inputs.gpu_type, exclude=None if settings.resume else inputs.study_name)


def capacity_terms(settings: TuneSettings) -> str:
    """What a capacity study judges, for its first line ("" for another objective): the
    SLOs (and whether they are the defaults), the goodput bar and the bracket's width."""
    from autotune.config import CAPACITY_DEFAULT_SLO

    if settings.objective != "capacity":
        return ""
    slo = settings.measure.slo or {}
    terms = ", ".join(f"{k}={v:g}s" for k, v in slo.items())
    default = (" (the defaults; --slo sets yours)" if slo == CAPACITY_DEFAULT_SLO else "")
    m = settings.measure
    return (f"; capacity: a load level passes when {m.capacity_goodput:.0%} of its "
            f"requests meet {terms}{default}; each trial searches until its bracket is "
            f"within {1 + m.capacity_tolerance:.3g}x")


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

    def ran(t: FrozenTrial) -> bool:
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
