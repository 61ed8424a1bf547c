"""``autotune sync``: log to MLflow what a study could not log while its store was away.

The Optuna storage is the source of truth: every finished trial is there, whatever MLflow
did. :func:`sync_study` compares it with the study's MLflow runs and writes what is
missing: a run for each finished trial that has none (a run half written is replaced),
and the study run's results (best config, verdict, files) from the study's output folder
when the study run was never closed. Running it again writes nothing new.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.credentials import redact
from autotune.errors import ConfigError, StudyError
from autotune.records import BestFile, StudyFile
from autotune.results._outputs import TuneResult
from autotune.results._tracking import TAGS, MlflowTracker, log_study_end, screen_fields
from autotune.store import A, State, is_prior, open_storage

if TYPE_CHECKING:
    from mlflow.entities import Run
    from optuna.trial import FrozenTrial

__all__ = ["SyncResult", "sync_study"]

logger = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """What :func:`sync_study` wrote: trial numbers logged now, those already logged, and
    whether it closed the study run with its results."""

    study_name: str
    logged: list[int] = field(default_factory=list)
    already: list[int] = field(default_factory=list)
    study_run_closed: bool = False
    failures: list[str] = field(default_factory=list)  # MLflow writes that failed again


def _study_file(out_dir: Path) -> StudyFile:
    try:
        return StudyFile.load(out_dir / StudyFile.FILE_NAME)
    except ConfigError as exc:
        raise StudyError(f"{exc}; pass the output folder of a study that finished (the one "
                         "its summary named)") from None


def _trial_runs(tracker: MlflowTracker, parent: str) -> dict[int, list[Run]]:
    """The study run's trial runs, by trial number."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'",
        max_results=50000)
    out: dict[int, list[Run]] = {}
    for r in runs:
        number = r.data.tags.get(TAGS["trial"])
        if number is not None and number.isdigit():
            out.setdefault(int(number), []).append(r)
    return out


def _log_trial(tracker: MlflowTracker, t: FrozenTrial, tags: dict[str, str]) -> str | None:
    """One trial's run from what the Optuna storage keeps of it."""
    ua = t.user_attrs
    state = str(ua.get(A.STATE) or ("ok" if t.state.name == "COMPLETE" else "failed"))
    run_tags = {**tags, TAGS["state"]: state}
    if ua.get(A.REASON):
        run_tags[TAGS["reason"]] = str(ua[A.REASON])
    if ua.get(A.MESSAGE) and state != State.OK:
        run_tags[TAGS["message"]] = str(ua[A.MESSAGE])[:1000]
    if ua.get(A.BASELINE):
        run_tags["autotune.baseline"] = "true"
    log = ua.get(A.LOG)
    screen, rung_tag = screen_fields(ua.get(A.SCREEN), ua.get(A.RUNG))
    run_tags.update(rung_tag)
    return tracker.log_trial(
        number=t.number, params=dict(t.params), flags=list(ua.get(A.FLAGS) or []),
        env=dict(ua.get(A.ENV) or {}), metrics={**dict(ua.get(A.METRICS) or {}), **screen},
        tags=run_tags,
        ok=state == State.OK, log_path=str(log) if log else None,
        outcome={"user_attrs": dict(ua), "state": t.state.name})


def _result_of(out_dir: Path, summary: StudyFile) -> TuneResult:
    """The study's :class:`TuneResult` as its output folder records it."""
    best_path = out_dir / BestFile.FILE_NAME
    best = BestFile.load(best_path) if best_path.exists() else None
    files = {f"plots/{p.name}": p for p in sorted((out_dir / "plots").glob("*"))
             if p.is_file()}
    files.update({name: out_dir / name for name in
                  ("trials.csv", "config.yaml", "study.json", "report.html")
                  if (out_dir / name).exists()})
    return TuneResult(
        study_name=summary.study, storage=summary.storage, out_dir=out_dir,
        best=best, n_trials=summary.trials, n_ok=summary.ok,
        n_failed=summary.failed, n_pruned=summary.pruned, rungs=dict(summary.rungs),
        tracking_uri=summary.tracking_uri,
        failures_by_reason=dict(summary.failures_by_reason), files=files,
        explanation=summary.explanation,
        verdict=dict(summary.verdict), gpu_time=dict(summary.gpu_time))


def sync_study(out_dir: Path, *, storage: str | None = None, tracking_uri: str | None = None,
               experiment: str | None = None) -> SyncResult:
    """Log what the study of ``out_dir`` (its ``study.json``) has not logged to MLflow.

    ``storage`` and ``tracking_uri`` default to the study's (``study.json`` keeps them
    without a password: give the password through the environment, or pass the URL)."""
    import optuna
    from mlflow.entities import RunStatus

    summary = _study_file(out_dir)
    settings = summary.settings
    storage = storage or summary.storage or str(settings.get("storage") or "")
    tracking_uri = tracking_uri or summary.tracking_uri
    if not storage or not tracking_uri:
        raise StudyError(f"{out_dir}/study.json names no storage or tracking URI; pass "
                         "--storage and --tracking-uri")
    name = summary.study
    study = optuna.load_study(study_name=name, storage=open_storage(storage))
    tracker = MlflowTracker(tracking_uri, experiment=experiment
                            or str(settings.get("experiment") or "autotune"))
    parent = study.user_attrs.get(A.MLFLOW_PARENT)
    if not parent:
        raise StudyError(f"study {name!r} has no MLflow study run in {redact(tracking_uri)}; "
                         "its tracking was off, or points at another store (--tracking-uri)")
    tracker.parent_run_id = parent
    parent_run = tracker.client.get_run(parent)
    tags = {k: v for k, v in parent_run.data.tags.items()
            if k in TAGS.values() and k not in (TAGS["kind"], TAGS["message"])}
    existing = _trial_runs(tracker, parent)
    out = SyncResult(study_name=name)
    for t in study.get_trials(deepcopy=False):
        if is_prior(t) or not t.state.is_finished():
            continue
        key = f"{A.MLFLOW_RUN}.{t.number}"
        if study.user_attrs.get(key):
            out.already.append(t.number)
            continue
        for half in existing.get(t.number, []):  # written midway when the store went away
            tracker.client.delete_run(half.info.run_id)
        rid = _log_trial(tracker, t, tags)
        if rid is None:
            break
        study.set_user_attr(key, rid)
        out.logged.append(t.number)
    if not tracker.disabled and parent_run.info.status != RunStatus.to_string(
            RunStatus.FINISHED):
        log_study_end(tracker, _result_of(out_dir, summary), study)
        out.study_run_closed = not tracker.disabled
    out.failures = list(tracker.failures)
    logger.info("sync of %s: %d trial run(s) logged, %d already there", name,
                len(out.logged), len(out.already))
    return out
