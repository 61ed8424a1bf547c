"""MLflow: a parent run per study, a child run per trial, the best config per shape.

Uses :class:`mlflow.tracking.MlflowClient` directly (no global active run), so the tracker
can be injected and used from the driver while trials run elsewhere. Optuna's storage is
the source of truth; if the MLflow store goes away mid-study, the tracker logs a warning,
keeps the study going and says what it could not write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from autotune.cost import cost_metrics
from autotune.credentials import redact, warn_if_password
from autotune.errors import TrackingError
from autotune.events import StudyCallback, StudyContext, StudyEvent, TrialRecord
from autotune.load import _http
from autotune.store import A, State, schema_race, sqlite_path

if TYPE_CHECKING:
    from mlflow.entities import Metric, RunTag
    from optuna import Study

    from autotune.records import BestFile
    from autotune.results._outputs import TuneResult

__all__ = ["BEST_TAG", "BEST_VALUE", "EXPERIMENT_KIND", "TAGS", "MlflowCallback",
           "MlflowTracker", "default_tracking_uri", "log_study_end"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
logger = logging.getLogger(__name__)

BEST_TAG = "autotune.best"
TAGS = {
    "study": "autotune.study",
    "shape": "autotune.shape_fingerprint",
    "shape_name": "autotune.shape_name",
    "model": "autotune.model",
    "engine": "autotune.engine_version",
    "gpu": "autotune.gpu_type",
    "state": "autotune.trial_state",
    "reason": "autotune.failure_reason",
    "message": "autotune.failure_message",  # why, in words (first lines; no log tail)
    "trial": "autotune.trial_number",
    "space": "autotune.space",
    "kind": "autotune.kind",
    "rung": "autotune.rung",  # screen, then refine: 0 screened, 1 refined
    # on the study run: its best trial's run, and what best.json declares, so that a store
    # copied without its artifact folder still answers with the declared figures
    "best_run": "autotune.best_run_id",
    "best_trial": "autotune.best_trial",  # best.json's "trial"
    "best_readings": "autotune.best_readings",  # best.json's "readings", JSON
    "best_params": "autotune.best_params",  # best.json's "params", JSON
}


def screen_fields(coarse: Mapping[str, object] | None, rung: object
                  ) -> tuple[dict[str, float], dict[str, str]]:
    """A trial's coarse reading as MLflow metrics (``screen_value``, ``_ci_low``,
    ``_ci_high``, ``_bar``) and its rung as a tag: a screened trial's reading is kept."""
    got = {f"screen_{k}": (coarse or {}).get(k) for k in ("value", "ci_low", "ci_high", "bar")}
    return ({k: float(v) for k, v in got.items() if isinstance(v, (int, float))
             and math.isfinite(v)}, {TAGS["rung"]: str(rung)} if rung is not None else {})
#: Study-run metric: best.json's objective value (the median of ``autotune.best_readings``).
BEST_VALUE = "best_value"
#: The experiment tag MLflow 3's UI reads to choose its view: without it, an experiment
#: opens on GenAI traces (none here); with it, on the runs, where the trials are.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# MLflow's tag value limit (mlflow.utils.validation.MAX_TAG_VAL_LENGTH) is 8000 characters
# since MLflow 2, 5000 before; a longer tag is cut, and a cut JSON does not read back.
_TAG_MAX = 5000


def default_tracking_uri(out_root: str | Path = "experiments") -> str:
    """``sqlite:///<abs path>/mlflow.db`` under ``out_root``."""
    p = Path(out_root).resolve() / "mlflow.db"
    return f"sqlite:///{p}"


def _artifact_root(tracking_uri: str) -> str | None:
    db = sqlite_path(tracking_uri)
    if db is not None:
        return (db.parent / "mlartifacts").resolve().as_uri()
    return None


@contextlib.contextmanager
def _store_lock(db: Path | None) -> Iterator[None]:
    """One process at a time sets up a SQLite MLflow store (a lock file beside it). MLflow
    creates and migrates a store's tables on first use; two tuners doing so at once fail
    (``table ... already exists``, alembic's migration rows). A server store needs none."""
    if db is None:
        yield
        return
    import fcntl

    with open(db.parent / f".{db.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


class MlflowTracker:
    """Logs a study and its trials to an MLflow store.

    ``strict`` (default True at construction): the store is checked at once and an
    unreachable store raises :class:`TrackingError` before any GPU time is spent. Later
    write failures are logged and counted in :attr:`failures`, never raised.
    """

    def __init__(self, tracking_uri: str, *, experiment: str = "autotune") -> None:
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment
        self.failures: list[str] = []
        self.parent_run_id: str | None = None
        self.disabled = False
        self._failed_at = 0.0  # time.monotonic() of the failure that disabled the writes
        self._half_written: list[str] = []  # runs of trials whose writes failed midway
        db = sqlite_path(tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        warn_if_password("--tracking-uri", tracking_uri,
                         env="MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
        if tracking_uri.startswith(("http://", "https://")):
            _probe_server(tracking_uri)  # MLflow's own client retries for minutes
            # ...and so would every write to a server that dies mid-study.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        try:
            import mlflow
            from mlflow.tracking import MlflowClient

            self._mlflow = mlflow
            with _store_lock(db):  # the first use creates and migrates a SQLite store
                self._open(MlflowClient, experiment)
        except Exception as exc:
            first = redact(str(exc).splitlines()[0]) if str(exc) else ""
            fix = ("start the tracking server, fix --tracking-uri, or use a local "
                   "sqlite:///PATH store")
            if "401" in first or "403" in first or "nauthorized" in first:
                fix = ("the server wants credentials: set MLFLOW_TRACKING_USERNAME and "
                       "MLFLOW_TRACKING_PASSWORD (a user with EDIT permission)")
            raise TrackingError(f"cannot use the MLflow store {redact(tracking_uri)!r}: "
                                f"{type(exc).__name__}: {first}; {fix}") from exc

    def _open(self, client_cls: Any, experiment: str, attempts: int = 5) -> None:
        """The client and the experiment's id. A database store (``postgresql://``) that
        another tuner creates at the same moment fails one of the two on its tables (a
        duplicate key of ``pg_type``, alembic's row): opened again, as Optuna's storage
        is (:func:`autotune.store._rdb_storage`); a SQLite store is locked instead."""
        import time

        for attempt in range(1, attempts + 1):
            try:
                self.client = client_cls(tracking_uri=self.tracking_uri)
                self.experiment_id = self._experiment(experiment)
                return
            except Exception as exc:
                text = str(exc).lower()
                if attempt == attempts or not (schema_race(exc) or "duplicate key" in text):
                    raise
                time.sleep(0.3 * attempt)

    def _experiment(self, name: str) -> str:
        """The experiment's id, created when missing; a tuner that creates it at the same
        moment as another (a shared tracking server) takes the other's."""
        key, kind = EXPERIMENT_KIND
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if key not in exp.tags:  # made by an older autotune: open it on its runs too
                self.client.set_experiment_tag(exp.experiment_id, key, kind)
            return str(exp.experiment_id)
        try:
            return str(self.client.create_experiment(
                name, artifact_location=_artifact_root(self.tracking_uri), tags={key: kind}))
        except Exception:
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return str(exp.experiment_id)

    def reconnect(self, *, every_s: float = 15.0) -> bool:
        """Whether writes go on: True at once unless a failure stopped them; then the store
        is asked again (at most every ``every_s`` seconds) and writes resume if it answers."""
        import time

        if not self.disabled:
            return True
        if time.monotonic() - self._failed_at < every_s:
            return False
        self._failed_at = time.monotonic()
        try:
            if self.tracking_uri.startswith(("http://", "https://")):
                _probe_server(self.tracking_uri, timeout_s=3.0)
            self.client.get_experiment(self.experiment_id)
        except Exception:  # noqa: BLE001 - still away: the study goes on without it
            return False
        self.disabled = False
        logger.warning("MLflow: the store %s answers again; writes resume",
                       redact(self.tracking_uri))
        while self._half_written and not self.disabled:
            self._safe("remove a half-written trial run", self.client.delete_run,
                       self._half_written.pop())
        return not self.disabled

    # -- helpers ----------------------------------------------------------------------------
    def _safe(self, what: str, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
              ) -> _R | None:
        if self.disabled:
            self.failures.append(f"MLflow: skipped: {what} (the store failed earlier)")
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop a study
            import time

            msg = (f"MLflow: could not {what}: {type(exc).__name__}: "
                   f"{redact(str(exc))[:300]}; MLflow writes pause until the store answers "
                   "again (Optuna keeps every trial; autotune sync logs what is missed)")
            self.failures.append(msg)
            logger.warning(msg)
            # A store that fails once (a server that went away) would cost minutes of
            # retries on every later call: stop writing to it until reconnect() finds it.
            self.disabled = True
            self._failed_at = time.monotonic()
            return None

    def _log_dict(self, run_id: str, obj: object, name: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / name
            p.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
            self.client.log_artifact(run_id, str(p))

    def _log_text(self, run_id: str, text: str, name: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / name
            p.write_text(text)
            self.client.log_artifact(run_id, str(p))

    # -- study ------------------------------------------------------------------------------
    def start_study(
        self, *, study_name: str, tags: Mapping[str, str], params: Mapping[str, Any],
        resume_run_id: str | None = None,
    ) -> str | None:  # fmt: skip
        """Create (or, on resume, reopen) the parent run; returns its id."""
        from mlflow.entities import RunStatus

        if resume_run_id:
            self.parent_run_id = resume_run_id
            self._safe("reopen the study run", self.client.update_run, resume_run_id,
                       RunStatus.to_string(RunStatus.RUNNING))
            return resume_run_id
        run = self._safe(
            "create the study run",
            self.client.create_run,
            self.experiment_id,
            run_name=study_name,
            tags={**tags, TAGS["kind"]: "study", TAGS["study"]: study_name},
        )
        if run is None:
            return None
        self.parent_run_id = run.info.run_id
        from mlflow.entities import Param

        self._safe(
            "log study parameters", self.client.log_batch, self.parent_run_id,
            params=[Param(k, _param_str(v)) for k, v in sorted(params.items())],
        )  # fmt: skip
        return self.parent_run_id

    def log_trial(
        self,
        *,
        number: int,
        params: Mapping[str, Any],
        flags: list[str] | tuple[str, ...],
        env: Mapping[str, str],
        metrics: Mapping[str, float],
        tags: Mapping[str, str],
        ok: bool,
        log_path: str | None = None,
        outcome: Mapping[str, Any] | None = None,
    ) -> str | None:
        """One child run for one finished trial; returns its run id."""
        from mlflow.entities import Metric, Param, RunStatus

        if self.parent_run_id is None:
            return None
        run = self._safe(
            f"create the run of trial {number}",
            self.client.create_run,
            self.experiment_id,
            run_name=f"trial-{number:04d}",
            tags={
                **tags,
                "mlflow.parentRunId": self.parent_run_id,
                TAGS["kind"]: "trial",
                TAGS["trial"]: str(number),
            },
        )
        if run is None:
            return None
        rid = run.info.run_id
        failures_before = len(self.failures)
        import time as _t

        now = int(_t.time() * 1000)
        all_params = {**{k: _param_str(v) for k, v in params.items()},
                      "flags": " ".join(flags)[:6000]}
        all_params.update({f"env.{k}": v for k, v in env.items()})
        self._safe(
            f"log trial {number}", self.client.log_batch, rid,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
            params=[Param(k, v) for k, v in sorted(all_params.items())],
        )  # fmt: skip
        if log_path and os.path.exists(log_path):
            self._safe(f"store the server log of trial {number}", self.client.log_artifact,
                       rid, log_path)
        if outcome is not None:
            self._safe(f"store the outcome of trial {number}", self._log_dict, rid,
                       dict(outcome), "outcome.json")
        status = RunStatus.FINISHED if ok else RunStatus.FAILED
        self._safe(f"close the run of trial {number}", self.client.set_terminated, rid,
                   RunStatus.to_string(status))
        if len(self.failures) == failures_before:
            return rid
        # a run half written is not the trial's record: it goes once the store is back, and
        # the trial is logged anew
        self._half_written.append(rid)
        return None

    def mark_best(self, *, run_id: str, shape_fingerprint: str, best: BestFile,
                  serve_command: str, artifacts: Mapping[str, str] | None = None) -> None:
        """Tag the best trial's run and record the best config on the study run: best.json
        and the serve command as artifacts, and what best.json declares (:func:`_declared`)
        in the run itself, for a store kept without its artifact folder."""
        self._safe("tag the best trial", self.client.set_tag, run_id, BEST_TAG, "true")
        self._safe("tag the best trial", self.client.set_tag, run_id,
                   f"{BEST_TAG}_for_shape", shape_fingerprint)
        if self.parent_run_id:
            pid = self.parent_run_id
            metrics, tags = _declared(best)
            # one batch: the best run and its declared figures are never half written
            self._safe("record the best run", self.client.log_batch, pid,
                       metrics=metrics, tags=[*tags, _tag(TAGS["best_run"], run_id)])
            self._safe("store best.json", self._log_dict, pid, best.to_json(), "best.json")
            self._safe("store the serve command", self._log_text, pid,
                       "#!/bin/sh\n" + serve_command + "\n", "serve_command.sh")
            for name, path in (artifacts or {}).items():
                if os.path.exists(path):
                    self._safe(f"store {name}", self.client.log_artifact, pid, path)

    def log_study_artifacts(self, files: Mapping[str, str]) -> None:
        """Attach files to the study run (``{"plots/history.png": path}``: folder/name)."""
        if not self.parent_run_id:
            return
        for name, path in files.items():
            if os.path.exists(path):
                folder = os.path.dirname(name) or None
                self._safe(f"store {name}", self.client.log_artifact, self.parent_run_id, path,
                           folder)

    def log_study_metrics(self, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if not self.parent_run_id:
            return
        import time as _t

        now = int(_t.time() * 1000)
        self._safe("log study metrics", self.client.log_batch, self.parent_run_id,
                   metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])

    def log_verdict(self, verdict: Mapping[str, Any]) -> None:
        """The study run's record of a verdict (``autotune.verdict``): metrics
        ``ratio_to_defaults_*`` (or a capacity's bound, ``ratio_at_least`` or
        ``ratio_at_most``) and ``starts_needed_per_config``, tag ``autotune.verdict``."""
        ratio = verdict.get("ratio_to_defaults") or {}
        self.log_study_metrics({f"ratio_to_defaults_{k}": float(v)
                                for k, v in ratio.items() if v is not None})
        bound = verdict.get("ratio_bound") or {}
        if bound.get("value") is not None:  # an open capacity bracket: a bound, no ratio
            self.log_study_metrics({f"ratio_{bound['kind']}": float(bound["value"])})
        need = verdict.get("starts_needed") or {}
        if need.get("per_config") is not None:  # defaults_best, but not shown either way
            self.log_study_metrics({"starts_needed_per_config": float(need["per_config"])})
        if verdict:
            self.set_study_tags({A.VERDICT: str(verdict.get("verdict"))})

    def set_study_tags(self, tags: Mapping[str, str]) -> None:
        if self.parent_run_id:
            for k, v in tags.items():
                self._safe(f"tag the study ({k})", self.client.set_tag, self.parent_run_id, k, v)

    def end_study(self, *, ok: bool = True, why: str = "") -> None:
        """Close the study run: FINISHED, KILLED (``why`` "interrupted") or FAILED with
        ``why`` in its tag ``autotune.failure_message``."""
        from mlflow.entities import RunStatus

        if self.parent_run_id:
            status = (RunStatus.FINISHED if ok else RunStatus.KILLED if why == "interrupted"
                      else RunStatus.FAILED)
            if why:
                self._safe("tag why the study stopped", self.client.set_tag,
                           self.parent_run_id, TAGS["message"], why[:1000])
            self._safe("close the study run", self.client.set_terminated, self.parent_run_id,
                       RunStatus.to_string(status))


class MlflowCallback(StudyCallback):
    """Logs a study to MLflow as a subscriber of its events: the parent run at the start, a
    child run per finished trial (rejected samples too), the best config, plots and
    trials.csv at the end. The Optuna trial is final before any of it is written: a
    tracking store that hangs never costs a measured trial. A trial finished while the
    store was away is logged as soon as it answers again (at a later trial or at the end);
    what is still missing at the end is named in ``TuneResult.mlflow_unlogged``."""

    def __init__(self, tracker: MlflowTracker) -> None:
        self.tracker = tracker
        self._study: Study | None = None
        self._tags: dict[str, str] = {}
        self._unlogged: dict[int, tuple[StudyEvent, TrialRecord]] = {}
        self.late: list[int] = []  # trials logged after the store came back

    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        settings, study = context.settings, context.study
        self._study = study
        self._tags = {
            TAGS["shape"]: context.shape.fingerprint,
            TAGS["shape_name"]: context.shape.name,
            TAGS["model"]: str(context.model),
            TAGS["engine"]: f"{context.engine.package} {context.engine.version}",
            TAGS["gpu"]: context.gpu_type,
            TAGS["space"]: context.space.name,
            TAGS["study"]: context.study_name,
        }
        parent = self.tracker.start_study(
            study_name=context.study_name,
            tags=self._tags,
            params={"trials": settings.trials, "objective": settings.objective,
                    "sampler": settings.sampler, "seed": settings.seed, "slo": settings.measure.slo,
                    "repeats": settings.measure.repeats, "space": str(settings.space),
                    "shape": str(settings.shape), "storage": redact(settings.storage)},
            resume_run_id=study.user_attrs.get(A.MLFLOW_PARENT) if settings.resume else None,
        )  # fmt: skip
        if parent and not settings.resume:
            study.set_user_attr(A.MLFLOW_PARENT, parent)

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        self._unlogged[record.number] = (event, record)
        self._catch_up(current=record.number)

    def _catch_up(self, *, current: int | None, every_s: float = 15.0) -> None:
        """Log the trials not logged yet, oldest first, while the store takes them (a
        trial other than ``current`` is logged late)."""
        for number in sorted(self._unlogged):
            if not self.tracker.reconnect(every_s=every_s):
                return
            event, record = self._unlogged[number]
            if self._log(event, record) is None and self.tracker.disabled:
                return
            del self._unlogged[number]
            if number != current:
                self.late.append(number)

    def _log(self, event: StudyEvent, record: TrialRecord) -> str | None:
        tags = dict(self._tags)
        outcome: dict[str, object]
        if record.outcome is None:  # rejected by the space's rules: it never ran
            metrics: dict[str, float] = {}
            log_path, outcome = None, {"violations": list(record.violations)}
        else:
            tags[TAGS["state"]] = record.state
            if record.baseline:
                tags["autotune.baseline"] = "true"
            o = record.outcome
            extra, rung_tag = screen_fields(o.coarse, o.coarse and int(not o.screened))
            metrics = {**o.metrics, **extra}
            tags.update(rung_tag)
            log_path, outcome = record.outcome.log_path, record.outcome.to_dict()
        ok = record.state == State.OK
        if record.reason:
            tags[TAGS["reason"]] = str(record.reason)
        why = "; ".join(record.violations) if record.rejected else event.message
        if why and not ok:
            tags[TAGS["message"]] = why[:1000]  # the why, beside the reason
        tags.setdefault(TAGS["state"], "ok" if ok else "failed")
        rid = self.tracker.log_trial(number=record.number, params=record.params,
                                     flags=list(record.flags), env=dict(record.env),
                                     metrics=metrics, tags=tags, ok=ok, log_path=log_path,
                                     outcome=outcome)
        if rid and not record.rejected and self._study is not None:
            self._study.set_user_attr(f"{A.MLFLOW_RUN}.{record.number}", rid)
        return rid

    def on_study_end(self, event: StudyEvent, result: TuneResult | None) -> None:
        self._catch_up(current=None, every_s=0.0)  # the store may be back: one more try
        if result is None:
            self.tracker.end_study(ok=False, why=event.message)
            return
        log_study_end(self.tracker, result, self._study)
        result.mlflow_late = sorted(self.late)
        if self.tracker.disabled:
            result.mlflow_unlogged = [f"trial {n}" for n in sorted(self._unlogged)] + [
                "the study run's results"]


def log_study_end(tracker: MlflowTracker, result: TuneResult, study: Study | None = None
                  ) -> None:
    """The study run's record of a finished study (``result``: a
    :class:`~autotune.results.TuneResult`): the best config, the verdict, the GPU time,
    the result files, the counts; then the run is closed. ``study``: where a best trial
    logged late finds its run id."""
    best = result.best
    if best is not None:
        rid = best.mlflow_run_id
        if not rid and study is not None:
            rid = study.user_attrs.get(f"{A.MLFLOW_RUN}.{best.trial}")
        if rid:
            tracker.mark_best(run_id=rid,
                              shape_fingerprint=best.shape.fingerprint if best.shape else "",
                              best=best.model_copy(update={"mlflow_run_id": rid}),
                              serve_command=best.serve_command)
        tracker.log_study_metrics({f"best_{k}": v for k, v in best.metrics.items()
                                   if v is not None})
        if best.cost:  # USD per million tokens, GPUs for the traffic (cost.*)
            tracker.log_study_metrics(cost_metrics(best.cost))
    # the verdict with its interval and the GPU-time account (issue 14)
    tracker.log_verdict(result.verdict or {})
    tracker.log_study_metrics({f"gpu_time.{label}.{k}": float(v)
                               for label, acc in (result.gpu_time or {}).items()
                               for k, v in acc.items()})
    tracker.log_study_artifacts({k: str(v) for k, v in result.files.items()})
    tracker.set_study_tags({"autotune.n_ok": str(result.n_ok),
                            "autotune.n_trials": str(result.n_trials)})
    if getattr(result, "explanation", ""):
        tracker.set_study_tags({"autotune.no_winner_why": result.explanation[:4000]})
    tracker.end_study(ok=True)


def _probe_server(uri: str, timeout_s: float = 5.0) -> None:
    try:
        status = _http.get(uri.rstrip("/") + "/health", timeout_s=timeout_s).status
        if status == 200:
            return
        problem = f"HTTP {status}"
    except _http.HttpError as exc:
        problem = str(exc)
    raise TrackingError(
        f"the MLflow tracking server {redact(uri)} does not answer ({redact(problem)}); start it "
        "(mlflow server ...), fix --tracking-uri, or use a local sqlite:///PATH store"
    )


def _tag(key: str, value: str) -> RunTag:
    from mlflow.entities import RunTag

    return RunTag(key, value)


def _declared(best: BestFile) -> tuple[list[Metric], list[RunTag]]:
    """The study run's record of what best.json declares: the metric :data:`BEST_VALUE` and
    the tags ``autotune.best_trial``, ``autotune.best_readings``, ``autotune.best_params``.
    A figure best.json lacks is not recorded; a tag longer than MLflow keeps is left out
    with a warning (the registry then takes it from the trial run)."""
    import math
    import time

    from mlflow.entities import Metric

    metrics: list[Metric] = []
    value = best.objective.value
    if math.isfinite(value):
        metrics.append(Metric(BEST_VALUE, float(value), int(time.time() * 1000), 0))
    tags: list[RunTag] = [_tag(TAGS["best_trial"], str(best.trial))]
    declared: dict[str, object] = {"readings": best.readings, "params": best.params}
    for name, figure in declared.items():
        text = json.dumps(figure, sort_keys=True, default=str)
        if len(text) > _TAG_MAX:
            logger.warning("MLflow: the best config's %s (%d characters) exceed the %d of a "
                           "tag; not recorded as %s (best.json has them)", name, len(text),
                           _TAG_MAX, TAGS[f"best_{name}"])
            continue
        tags.append(_tag(TAGS[f"best_{name}"], text))
    return metrics, tags


def _param_str(v: object) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s[:6000]
