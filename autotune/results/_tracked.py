"""The registry read from MLflow: the best config per shape when the Optuna storage is
not at hand (``--tracking-uri``).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.exceptions import MlflowException

from autotune.engine import serve_command
from autotune.errors import ConfigError
from autotune.events import ParamValue
from autotune.records import BestFile, JsonValue
from autotune.results._registry import (
    _THROUGHPUT,
    UNKNOWN_GPU,
    RegistryHit,
    _same_gpu,
    _same_model,
)
from autotune.results._tracking import BEST_TAG, BEST_VALUE, TAGS
from autotune.store import A, objective_metric, sqlite_path
from autotune.traffic import TrafficShape

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)


@contextmanager
def _no_download_bar() -> Iterator[None]:
    """MLflow draws a tqdm bar on stderr for every artifact download, even of one small
    file; a lookup is not a download the user asked for. MLflow reads the variable when it
    downloads: it is set for the download only, then restored (process-wide meanwhile)."""
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR as var

    before = var.get_raw()
    var.set("false")
    try:
        yield
    finally:
        if before is None:
            var.unset()
        else:
            var.set(before)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def _json_or_str(text: str) -> ParamValue:
    """An MLflow param (always a string) as the value it was logged from: its JSON reading
    when it has one ("1024" -> 1024, "true" -> True), else the string ("auto"; "NaN" too)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return text
    return value if isinstance(value, (int, float, str, bool)) or value is None else text


def _best_json(client: MlflowClient, run_id: str) -> BestFile | None:
    """The study run's best.json, or None when its artifact is not in the store."""
    try:
        with tempfile.TemporaryDirectory() as tmp, _no_download_bar():
            return BestFile.load(Path(client.download_artifacts(run_id, "best.json", tmp)))
    except (MlflowException, OSError, ConfigError) as exc:  # no artifact folder
        logger.info("registry: no best.json for MLflow run %s (%s)", run_id, exc)
        return None


@dataclass(frozen=True)
class _Declared:
    """What a study run records of its best.json (:meth:`MlflowTracker.mark_best`), in
    best.json's names; a figure that does not read back is None."""

    value: float
    trial: int | None = None
    readings: list[float] | None = None
    params: dict[str, ParamValue] | None = None


def _study_record(parent: Run) -> _Declared | None:
    """What the study run records of its best.json: objective value, readings, params and
    trial; None when it records no value (a store written before autotune recorded them).
    A figure that does not read back is left out (the trial run's is used)."""
    value = parent.data.metrics.get(BEST_VALUE)
    if value is None or not math.isfinite(value):
        return None
    ptags = parent.data.tags
    try:
        trial: int | None = int(ptags[TAGS["best_trial"]])
    except (KeyError, ValueError):
        trial = None
    figures: dict[str, object] = {}
    for name in ("readings", "params"):
        text = ptags.get(TAGS[f"best_{name}"])
        if text is None:
            continue
        try:
            figures[name] = json.loads(text, parse_constant=_no_constant)
        except ValueError:
            logger.info("registry: tag %s of MLflow run %s is not JSON", TAGS[f"best_{name}"],
                        parent.info.run_id)
    params, readings = figures.get("params"), figures.get("readings")
    return _Declared(
        value=float(value), trial=trial,
        params=params if isinstance(params, dict) else None,
        readings=([float(v) for v in readings] if isinstance(readings, list) and readings
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                          for v in readings) else None))


def _tracked_hit(client: MlflowClient, run: Run, uri: str) -> RegistryHit | None:
    """A hit from one MLflow trial run tagged best for its shape: its study run's best.json
    (the declared value: the median of its readings), else what the study run records of it
    (:func:`_study_record`), else the trial run's own figures (its single reading)."""
    tags = run.data.tags
    parent_id = tags.get("mlflow.parentRunId")
    parent = client.get_run(parent_id) if parent_id else None
    if parent is not None and parent.data.tags.get(TAGS["best_run"], run.info.run_id) \
            != run.info.run_id:
        return None  # an earlier best of a resumed study, since superseded
    best = _best_json(client, parent.info.run_id) if parent is not None else None
    notes: list[str] = []
    record = None
    if best is None:
        record = _study_record(parent) if parent is not None else None
        notes.append(f"MLflow run {parent_id}: no best.json artifact; " + (
            "figures of the study run's record" if record else
            "figures of the trial run (the value is its single reading)"))
    ptags = parent.data.tags if parent is not None else {}
    params = dict(run.data.params)
    flags = str(params.pop("flags", "")).split()
    env = {k[4:]: v for k, v in params.items() if k.startswith("env.")}
    metrics = {k: float(v) for k, v in run.data.metrics.items()}
    objective = best.objective.name if best is not None else (
        parent.data.params.get("objective", "throughput") if parent is not None else "throughput")
    metric = objective_metric(objective) if objective in ("throughput", "goodput", "pareto",
                                                          "capacity") else _THROUGHPUT
    value = (best.objective.value if best is not None
             else record.value if record is not None else metrics.get(metric))
    if value is None:
        return None
    model = best.model if best is not None else tags.get(TAGS["model"])
    trial = (best.trial if best is not None
             else record.trial if record is not None and record.trial is not None
             else int(tags.get(TAGS["trial"], -1)))
    readings = (best.readings if best is not None
                else record.readings if record is not None and record.readings else [value])
    run_params = {k: _json_or_str(v) for k, v in params.items() if not k.startswith("env.")}
    return RegistryHit(
        study=best.study if best is not None and best.study else tags.get(TAGS["study"], "?"),
        trial=trial, value=float(value), readings=[float(v) for v in readings], metric=metric,
        objective=objective,
        params=(best.params if best is not None and best.params
                else record.params if record is not None and record.params else run_params),
        flags=best.flags if best is not None else flags,
        env=best.env if best is not None and best.env else env,
        serve_command=(best.serve_command if best is not None and best.serve_command
                       else serve_command(model or "MODEL", flags, env)),
        metrics=({k: v for k, v in best.metrics.items() if v is not None}
                 if best is not None and best.metrics else metrics),
        quality={k: v for k, v in metrics.items() if k.startswith("quality_")},
        shape_fingerprint=tags.get(TAGS["shape"]) or tags.get("autotune.best_for_shape", ""),
        shape_path=best.shape.path if best is not None and best.shape else None,
        exact=True, distance=0.0, verdict="same", drifted_dimensions=[], model=model,
        engine_version=ptags.get(TAGS["engine"]) or tags.get(TAGS["engine"]),
        gpu_type=ptags.get(TAGS["gpu"]) or tags.get(TAGS["gpu"]) or UNKNOWN_GPU,
        is_baseline=(best.is_baseline if best is not None
                     else tags.get("autotune.baseline") == "true"),
        storage=uri, notes=notes, study_verdict=_tracked_verdict(best, parent),
        cost=best.cost if best is not None else None,
    )  # fmt: skip


def _tracked_verdict(best: BestFile | None, parent: Run | None) -> dict[str, JsonValue] | None:
    """The study's verdict from its best.json, else from the study run's tag and
    ``ratio_to_defaults_*`` or ``ratio_at_least``/``ratio_at_most`` metrics
    (:meth:`autotune.tracking.Tracker.log_verdict`)."""
    if best is not None and best.verdict:
        ratio = best.ratio_to_defaults
        return {**best.verdict_detail, "verdict": best.verdict,
                "ratio_to_defaults": ratio.model_dump() if ratio is not None else None}
    if parent is None or not parent.data.tags.get(A.VERDICT):
        return None
    m = parent.data.metrics
    keys = ("median", "ci_low", "ci_high")
    ratio_d: dict[str, JsonValue] | None = (
        {k: float(m[f"ratio_to_defaults_{k}"]) for k in keys}
        if all(f"ratio_to_defaults_{k}" in m for k in keys) else None)
    bound: dict[str, JsonValue] | None = None
    for kind in ("at_most", "at_least"):  # at_least when both are recorded
        if f"ratio_{kind}" in m:
            bound = {"kind": kind, "value": float(m[f"ratio_{kind}"])}
    return {"verdict": parent.data.tags[A.VERDICT], "ratio_to_defaults": ratio_d,
            "ratio_bound": bound}


def _open_for_lookup(tracking_uri: str) -> tuple[Any, list[str]] | None:
    """(client, experiment ids) of an MLflow store to read from; None when it has no
    experiment, or is a SQLite file that does not exist (a lookup must not leave a new
    store behind)."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(tracking_uri)
    if db is not None and not db.exists():
        return None
    client = MlflowClient(tracking_uri=tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return (client, exps) if exps else None


def find_best_tracked(*, tracking_uri: str, shape: TrafficShape, model: str | None = None,
                      gpu: str | None = None) -> RegistryHit | None:
    """The best known config for ``shape`` from an MLflow store: the trial runs tagged
    ``autotune.best_for_shape=<shape fingerprint>`` (exact fingerprint only; the nearest
    tuned shape is :func:`find_best`'s, from the Optuna storage), filtered like
    :func:`find_best`; throughput studies answer when objectives are mixed."""
    opened = _open_for_lookup(tracking_uri)
    if opened is None:
        return None
    client, exps = opened
    runs = client.search_runs(
        exps, filter_string=f"tags.`{BEST_TAG}_for_shape` = '{shape.fingerprint}'")
    hits = [h for h in (_tracked_hit(client, r, tracking_uri) for r in runs) if h is not None
            and (model is None or _same_model(model, h.model))
            and (gpu is None or _same_gpu(gpu, h.gpu_type))]
    if not hits:
        return None
    keep = _THROUGHPUT if any(h.metric == _THROUGHPUT for h in hits) else hits[0].metric
    return max((h for h in hits if h.metric == keep), key=lambda h: h.value)


def tracked_inputs(*, tracking_uri: str, model: str | None = None) -> tuple[str, str] | None:
    """(model, search space file) of the newest study run in an MLflow store (of ``model``
    when given, matched as :func:`find_best` matches it): what a study of another shape
    in that store takes, for a command a message suggests. None when it holds none."""
    opened = _open_for_lookup(tracking_uri)
    if opened is None:
        return None
    client, exps = opened
    runs = client.search_runs(exps, filter_string=f"tags.`{TAGS['kind']}` = 'study'",
                              order_by=["attributes.start_time DESC"])
    for run in runs:
        found, space = run.data.tags.get(TAGS["model"]), run.data.params.get("space")
        if found and space and (model is None or _same_model(model, found)):
            return found, space
    return None
