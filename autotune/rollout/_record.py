"""The rollout's MLflow run, linked to the study that chose the config.

The run is a child of the study's run (``mlflow.parentRunId``) when that run is found in the
store (tag ``autotune.study``), and names the chosen trial's run (best.json's
``mlflow_run_id``); each judged step's ratios and interval bounds are its metrics, the log
and summary its artifacts. A store that fails is reported, never fatal: the files on disk
are the record.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.records import BestFile

__all__ = ["log_rollout_run"]

logger = logging.getLogger(__name__)


def _study_run(client: Any, experiment_id: str, study: str) -> str | None:
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`autotune.kind` = 'study' and tags.`autotune.study` = '{study}'",
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def log_rollout_run(*, tracking_uri: str, summary: Mapping[str, Any], files: list[Path],
                    best: BestFile | None) -> tuple[str | None, list[str]]:
    """Write the rollout's run; returns (its id or None, what could not be written)."""
    from mlflow.entities import Metric, Param, RunStatus

    from autotune.results import TAGS, MlflowTracker

    tracker = MlflowTracker(tracking_uri)
    client = tracker.client
    study = best.study if best is not None else ""
    tags = {TAGS["kind"]: "rollout", "autotune.rollout_outcome": str(summary["outcome"])}
    if study:
        tags[TAGS["study"]] = study
        parent = tracker._safe("find the study's run", _study_run, client,
                               tracker.experiment_id, study)
        if parent:
            tags["mlflow.parentRunId"] = parent
    if best is not None and best.mlflow_run_id:
        tags["autotune.config_run_id"] = best.mlflow_run_id
    run = tracker._safe("create the rollout run", client.create_run, tracker.experiment_id,
                        run_name=f"rollout-{summary.get('started', '')}", tags=tags)
    if run is None:
        return None, tracker.failures
    rid = run.info.run_id
    metrics: list[Metric] = []
    for i, step in enumerate(summary.get("steps", [])):
        for m in step.get("metrics", []):
            for key in ("ratio", "low", "high"):
                v = m.get(key)
                if isinstance(v, int | float) and math.isfinite(v):
                    metrics.append(Metric(f"{m['metric']}_{key}", float(v), 0, i + 1))
    params = {k: v for k, v in summary.get("settings", {}).items() if v not in (None, "", [])}
    tracker._safe("log the rollout", client.log_batch, rid, metrics=metrics,
                  params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])
    for p in files:
        if p.exists():
            tracker._safe(f"store {p.name}", client.log_artifact, rid, str(p))
    status = RunStatus.FINISHED if summary["outcome"] == "promoted" else RunStatus.FAILED
    tracker._safe("close the rollout run", client.set_terminated, rid,
                  RunStatus.to_string(status))
    return rid, tracker.failures
