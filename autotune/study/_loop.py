"""The ask/tell loop: ask, suggest, submit to the executor, judge, tell; then the
re-check phase of the leaders.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config import MeasureSettings, TuneSettings
from autotune.credentials import redact
from autotune.errors import StudyError
from autotune.events import (
    ParamValue,
    StudyCallback,
    StudyCallbacks,
    StudyEvent,
    TrialRecord,
)
from autotune.exec import never_fits
from autotune.parallelism import server_gpus
from autotune.report import one_line_message
from autotune.space import (
    LaunchSpec,
    SearchSpace,
)
from autotune.store import (
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
    keep_spread,
    mark_failed,
    n_finished,
    primary,
    prior_spread_of,
    readings,
    rung_counts,
    verdict_record,
)
from autotune.trial import TrialOutcome, TrialSpec

if TYPE_CHECKING:

    import optuna

    from autotune.exec import Executor
    from autotune.measure import Screen
    from autotune.quality import ProbeOutputs, ProbeSet, QualityThresholds
    from autotune.store import VerdictRecord
    from autotune.traffic import TrafficShape
from autotune.study._budget import BudgetPlan, PhaseAccount, merge_phases
from autotune.study._failmodel import START_FAILURES, FailureModel
from autotune.study._gputime import GpuTime
from autotune.study._inputs import _retry_stopped
from autotune.study._judge import (
    _commit_tell,
    _enqueue_rechecks,
    _finished_elsewhere,
    _incumbent_low,
    _per_gpu_metric,
    _skip_waiting,
    judge,
)
from autotune.study._rungs import rungs_line, screen_for

logger = logging.getLogger(__name__)
_MAX_REJECTED_IN_A_ROW = 200


def trial_spec(*, number: int, model: str, flags: Sequence[str], env: Mapping[str, str],
               shape: TrafficShape | None, measure: MeasureSettings, seed: int = 0,
               capacity: bool = False, log_dir: str | None = None,
               log_path: str | None = None, quality_probe: ProbeSet | None = None,
               quality_reference: ProbeOutputs | None = None,
               incumbent_low: float | None = None, server_gpus: int = 1,
               stagger: bool = True, shape_path: str | Path | None = None,
               screen: Screen | None = None) -> TrialSpec:
    """The :class:`TrialSpec` of one trial, a study's (:class:`TrialTemplate`) or
    ``autotune bench``'s: ``measure`` as the settings give it, its cache folder resolved
    (``--cache-dir`` or :data:`autotune.config.DEFAULT_CACHE_DIR`); ``capacity``: a
    capacity search over the arrival rate (its bracket from ``measure``); ``shape_path``:
    the shape's file, named in the fix commands a failed replay suggests; ``screen``: the
    bar of the trial's coarse reading (screen, then refine)."""
    from autotune.trial import capacity_spec

    cap = capacity_spec(
        goodput=measure.capacity_goodput, max_error_rate=measure.max_error_rate,
        start=measure.capacity_start, tolerance=measure.capacity_tolerance,
        level_s=measure.capacity_level_s, max_s=measure.capacity_max_s,
        max_levels=measure.capacity_max_levels, seed=seed) if capacity else {}
    return TrialSpec(
        number=number, model=model, flags=tuple(flags), env=dict(env), shape=shape, seed=seed,
        measure=measure.model_copy(update={"cache_dir": measure.cache_path()}),
        log_dir=log_dir, log_path=log_path, quality_probe=quality_probe,
        quality_reference=quality_reference, incumbent_low=incumbent_low, screen=screen,
        server_gpus=server_gpus, stagger=stagger,
        shape_path=str(shape_path) if shape_path is not None else None, **cap)


@dataclass(frozen=True)
class TrialTemplate:
    """What every trial of a study shares: the model, the shape, folders, quality probe."""

    model: str
    shape: TrafficShape | None
    log_dir: str | None = None
    quality_probe: ProbeSet | None = None
    quality_reference: ProbeOutputs | None = None

    def spec(self, number: int, launch: LaunchSpec, settings: TuneSettings, *,
             probe: bool, incumbent_low: float | None = None,
             server_gpus: int = 1, screen: Screen | None = None) -> TrialSpec:
        """The :class:`TrialSpec` of one trial (``probe``: run the quality probe;
        ``incumbent_low``: the pruner's bar; ``screen``: the coarse reading's bar)."""
        return trial_spec(
            number=number, model=self.model, flags=launch.flags, env=launch.env,
            shape=self.shape, measure=settings.measure, seed=settings.seed,
            capacity=settings.objective == "capacity", log_dir=self.log_dir,
            quality_probe=self.quality_probe if probe else None,
            quality_reference=self.quality_reference, incumbent_low=incumbent_low,
            server_gpus=server_gpus, shape_path=settings.shape, screen=screen)


@dataclass
class _Flight:
    trial: optuna.Trial
    params: dict[str, ParamValue]
    launch: LaunchSpec
    baseline: bool
    spec: TrialSpec | None = None
    predicted_fail: bool | None = None  # the failure model's word (None: not asked)


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
    budget_plan: BudgetPlan | None = None  # --budget 2h: a trial's cost before one is measured
    failure_model: FailureModel | None = None  # steers samples away from predicted failures

    def __post_init__(self) -> None:
        if self.settings.objective == "auto":
            raise StudyError(
                "StudyLoop got --objective auto, which only the traffic shape resolves: pass "
                "the settings through autotune.study.resolve_objective(settings, shape) (or "
                "resolve_study) first, or set the objective (throughput, goodput, pareto, "
                "capacity)")
        self.target = self.settings.trials  # grows by the re-check trials
        self.phase = "search"  # then "recheck": the time budget bounds the search alone
        self.flights: dict[int, _Flight] = {}  # asked and not told (the waiting one too)
        self.waiting: int | None = None  # asked, but its GPUs are not free yet (placement)
        self.walls: list[float] = []
        self.recheck_walls: list[float] = []  # walls less compile seconds (the budget rule)
        self.rejected_in_a_row = 0
        self.t_loop = time.monotonic()
        self._last: StudyEvent | None = None
        pool = self.executor.pool
        self.gpu_time = GpuTime(slots=self.executor.slots, gpus=(
            pool.nodes[next(iter(pool.nodes))] if pool is not None and len(pool.nodes) == 1
            else ()))
        self.beats = Heartbeats(self.study._storage)  # a no-op without storage heartbeats
        self.phases = PhaseAccount(self.settings.gpu_budget_s)  # GPU-seconds by phase

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
                       trial_ok=None, trial_value=None, trial_ci_low=None, trial_ci_high=None,
                       trial_reason=None, trial_params={},
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
        self.study.set_user_attr(A.GPU_PHASES, merge_phases(
            self.study.user_attrs.get(A.GPU_PHASES), self.phases.record()))
        if self.failure_model is not None:
            self.study.set_user_attr(A.FAILURE_MODEL, self.failure_model.record())
            self.callbacks.on_note(self.event("note", message=self.failure_model.summary()))
        rungs = rungs_line(rung_counts(self.study.get_trials(deepcopy=False)))
        if rungs:
            self.callbacks.on_note(self.event("note", message=rungs))
        judgement = judge_study(self.study, prior=prior_spread_of(self.study))
        if judgement is not None and judgement.ratio is not None:  # repeated starts: kept
            keep_spread(self.study, judgement.ratio.log_sd, judgement.ratio.df)
        record = verdict_record(judgement)
        record["quality"] = self._candidate_quality(record)
        self.study.set_user_attr(A.VERDICT, record)

    def _candidate_quality(self, record: VerdictRecord) -> dict[str, Any] | None:
        """The verdict's word on its candidate (the winner, or the best other config when
        vLLM's defaults remain best) when it sets lossy knobs: its probe's figures and
        whether they were judged, or why not."""
        from autotune.quality import quality_caveat

        number, params = record.get("candidate_number"), record.get("candidate_params") or {}
        if record.get("verdict") in (None, "none") or number is None:
            return None
        attrs = self.study.trials[number].user_attrs
        subject = ("the winner" if record.get("verdict") == "winner" else
                   f"the best other config (trial {number})")
        return quality_caveat(
            self.space.lossy_knobs(params), params, probe=self.settings.quality_probe,
            gated=self.thresholds is not None, real_weights=self.space.facts.real_weights,
            figures=attrs.get(A.QUALITY), note=str(attrs.get(A.QUALITY_NOTE) or ""),
            subject=subject, result=("throughput" if self.settings.objective == "pareto"
                                     else self.settings.objective))

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
        if self.phase == "search" and not self._gpu_budget_holds_one_more():
            return False
        return n_finished(self.study) + len(self.flights) < self.target

    def _gpu_budget_holds_one_more(self) -> bool:
        """``--budget 2h``: whether the GPU-seconds spent, the trials in flight, one more
        and the re-check fit, each trial at the mean so far (before the first: the plan's
        cost)."""
        budget = self.settings.gpu_budget_s
        if budget is None:
            return True
        per = self.phases.mean_trial()
        if per is None:
            cost = self.budget_plan.cost.seconds if self.budget_plan is not None else 0.0
            per = cost * max(1, self.settings.gpus_per_trial or 1)
        s = self.settings
        n_re = (s.recheck + 1) * s.recheck_starts if s.recheck else 0
        return self.phases.total + per * (len(self.flights) + 1 + n_re) <= budget

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
        waiting = self.flights[self.waiting] if self.waiting is not None else None
        if waiting is not None and waiting.spec is not None and self.executor.fits(waiting.spec):
            self._submit(waiting)
        while (self.waiting is None and len(self.flights) < self.executor.slots
               and self.executor.has_room() and self._more()):
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
        steered, predicted = self._predict(trial, params, is_base)
        if steered:
            return
        launch = self.space.launch_spec(params, baseline=is_base)
        gpus = server_gpus(launch.flags)
        trial.set_user_attr(A.SERVER_GPUS, gpus)
        probe = not is_base and bool(self.space.lossy_knobs(params))
        spec = self.template.spec(trial.number, launch, self.settings, probe=probe,
                                  incumbent_low=_incumbent_low(self.study, self.settings, trial),
                                  server_gpus=gpus,
                                  screen=screen_for(self.study, self.settings, trial,
                                                    server_gpus=gpus, phase=self.phase))
        why = never_fits(self.executor, spec)
        if why is not None:
            self._reject(trial, params, [why])
            return
        self.rejected_in_a_row = 0
        trial.set_user_attr(A.FLAGS, list(launch.flags))
        trial.set_user_attr(A.ENV, dict(launch.env))
        flight = self.flights[trial.number] = _Flight(trial, params, launch, is_base, spec,
                                                      predicted_fail=predicted)
        if self.executor.fits(spec):
            self._submit(flight)
        else:  # its GPUs are busy: it waits, and nothing more is asked until it starts
            self.waiting = trial.number
            self._phase(trial.number, "waiting", 0.0,
                        f"waits for {gpus} free GPU(s) of one node")

    def _predict(self, trial: optuna.Trial, params: dict[str, ParamValue],
                 is_base: bool) -> tuple[bool, bool | None]:
        """The failure model's word on a search sample: (steered away: told as a failed
        constraint, never started; predicted to fail, recorded on a started trial). None:
        not asked (the defaults, a queued config, the re-check, no model)."""
        fm = self.failure_model
        if (fm is None or is_base or self.phase != "search"
                or trial.user_attrs.get(A.ENQUEUED) or trial.user_attrs.get(A.RETRY_OF)
                is not None):
            return False, None
        pred, away = fm.steer(params)
        if away:
            self._reject(trial, params, [pred.text()], reason=FailureReason.PREDICTED)
            return True, pred.fail
        if pred.neighbours:
            trial.set_user_attr(A.PREDICTED_FAILURE, {
                "fail": pred.fail, "p_fail": round(pred.p_fail, 3), "reason": pred.reason,
                "neighbours": pred.neighbours})
        return False, pred.fail

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

    def _reject(self, trial: optuna.Trial, params: dict[str, ParamValue],
                problems: list[str],
                reason: FailureReason = FailureReason.REJECTED) -> None:
        """A sample the space's rules forbid (or the failure model steers away: ``reason``
        predicted_failure): PRUNED with a failed constraint, never launched, not counted."""
        self.rejected_in_a_row += 1
        if self.rejected_in_a_row > _MAX_REJECTED_IN_A_ROW:
            raise StudyError(
                f"the space {self.space.name} rejected {_MAX_REJECTED_IN_A_ROW} samples in a "
                f"row (last: {problems[0]}); its rules exclude almost everything - fix them"
            )
        mark_failed(trial, reason, "; ".join(problems))
        _commit_tell(self.study, trial, None)
        self.beats.discard(trial._trial_id)
        record = TrialRecord(number=trial.number, params=params, flags=(), env={},
                             state=State.FAILED, reason=reason, value=None,
                             baseline=False, outcome=None, violations=tuple(problems))
        self.callbacks.on_trial_end(self.event("trial_rejected", trial_number=trial.number,
                                               trial_ok=False, trial_params=params,
                                               trial_reason=reason),
                                    record)

    def _tell(self, outcome: TrialOutcome) -> tuple[StudyEvent, TrialRecord]:
        """Judge and tell a finished trial; returns what its subscribers are told."""
        import optuna

        f = self.flights.pop(outcome.number)
        lossy = (not f.baseline) and bool(self.space.lossy_knobs(f.params))
        self.walls.append(outcome.wall_s)
        self.recheck_walls.append(max(0.0, outcome.wall_s - (outcome.compile_s or 0.0)))
        self.gpu_time.add(outcome)
        recheck = f.trial.user_attrs.get(A.RECHECK_OF) is not None
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
        self.phases.add(outcome, server_gpus=f.spec.server_gpus if f.spec else 1,
                        kind="recheck" if recheck else "pruned" if state == State.PRUNED
                        else "screened" if state == State.SCREENED else "search")
        if self.failure_model is not None and (reason in START_FAILURES
                                               or state != State.FAILED):
            self.failure_model.outcome(f.params, reason if reason in START_FAILURES else None,
                                       predicted=bool(f.predicted_fail))
        record = TrialRecord(number=outcome.number, params=f.params, flags=f.launch.flags,
                             env=dict(f.launch.env), state=state, reason=reason, value=value,
                             baseline=f.baseline, outcome=outcome)
        event = self.event(
            "trial_finished", trial_number=outcome.number, trial_ok=outcome.ok,
            trial_value=value[0] if isinstance(value, list) else value, trial_reason=reason,
            trial_ci_low=_per_gpu_metric(f.trial, interval_keys(self.settings.objective)[0]),
            trial_ci_high=_per_gpu_metric(f.trial, interval_keys(self.settings.objective)[1]),
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
