"""The registry read from MLflow: the best config per shape when the Optuna storage is
not at hand (``--tracking-uri``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.store import A, objective_metric
from autotune.traffic import TrafficShape

if TYPE_CHECKING:
    from typing import TypeAlias

    import optuna


    #: An Optuna storage URL, or a storage already opened (saves a schema check per call).
    StorageLike: TypeAlias = "str | optuna.storages.BaseStorage"
from autotune.results._registry import _THROUGHPUT, UNKNOWN_GPU, RegistryHit, _same_gpu, _same_model

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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _json_or_str(text: str) -> Any:
    """An MLflow param (always a string) as the value it was logged from: its JSON reading
    when it has one ("1024" -> 1024, "true" -> True), else the string ("auto"; "NaN" too)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return text


def _best_json(client: Any, run_id: str) -> dict[str, Any]:
    """The study run's best.json, or {} when its artifact is not in the store."""
    import tempfile

    from mlflow.exceptions import MlflowException

    try:
        with tempfile.TemporaryDirectory() as tmp, _no_download_bar():
            doc = json.loads(Path(client.download_artifacts(run_id, "best.json", tmp))
                             .read_text())
    except (MlflowException, OSError, ValueError) as exc:  # no artifact folder
        logger.info("registry: no best.json for MLflow run %s (%s)", run_id, exc)
        return {}
    return doc if isinstance(doc, dict) else {}


def _study_record(parent: Any) -> dict[str, Any]:
    """What the study run records of its best.json (:func:`autotune.tracking.mark_best`), in
    best.json's names: objective value, readings, params and trial; {} when it records no
    value (a store written before autotune recorded them). A figure that does not read back
    is left out (the trial run's is used)."""
    from autotune.results._tracking import BEST_VALUE, TAGS

    value = parent.data.metrics.get(BEST_VALUE)
    if value is None or not math.isfinite(value):
        return {}
    out: dict[str, Any] = {"objective": {"value": float(value)}}
    ptags = parent.data.tags
    try:
        out["trial"] = int(ptags[TAGS["best_trial"]])
    except (KeyError, ValueError):
        pass
    for name in ("readings", "params"):
        text = ptags.get(TAGS[f"best_{name}"])
        if text is None:
            continue
        try:
            doc = json.loads(text, parse_constant=_no_constant)
        except ValueError:
            logger.info("registry: tag %s of MLflow run %s is not JSON", TAGS[f"best_{name}"],
                        parent.info.run_id)
            continue
        if name == "params" and isinstance(doc, dict):
            out[name] = doc
        elif name == "readings" and isinstance(doc, list) and doc and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in doc):
            out[name] = [float(v) for v in doc]
    return out


def _tracked_hit(client: Any, run: Any, uri: str) -> RegistryHit | None:
    """A hit from one MLflow trial run tagged best for its shape: its study run's best.json
    (the declared value: the median of its readings), else what the study run records of it
    (:func:`_study_record`), else the trial run's own figures (its single reading)."""
    from autotune.engine import serve_command
    from autotune.results._tracking import TAGS

    tags = run.data.tags
    parent_id = tags.get("mlflow.parentRunId")
    parent = client.get_run(parent_id) if parent_id else None
    if parent is not None and parent.data.tags.get(TAGS["best_run"], run.info.run_id) \
            != run.info.run_id:
        return None  # an earlier best of a resumed study, since superseded
    best: dict[str, Any] = _best_json(client, parent_id) if parent is not None else {}
    notes: list[str] = []
    if not best:
        best = _study_record(parent) if parent is not None else {}
        notes.append(f"MLflow run {parent_id}: no best.json artifact; " + (
            "figures of the study run's record" if best else
            "figures of the trial run (the value is its single reading)"))
    ptags = parent.data.tags if parent is not None else {}
    params = dict(run.data.params)
    flags = str(params.pop("flags", "")).split()
    env = {k[4:]: v for k, v in params.items() if k.startswith("env.")}
    metrics = {k: float(v) for k, v in run.data.metrics.items()}
    objective = (best.get("objective") or {}).get("name") or (
        parent.data.params.get("objective", "throughput") if parent is not None else "throughput")
    metric = objective_metric(objective) if objective in ("throughput", "goodput", "pareto",
                                                          "capacity") else _THROUGHPUT
    value = (best.get("objective") or {}).get("value", metrics.get(metric))
    if value is None:
        return None
    model = best.get("model") or tags.get(TAGS["model"])
    return RegistryHit(
        study=best.get("study") or tags.get(TAGS["study"], "?"),
        trial=int(best.get("trial", tags.get(TAGS["trial"], -1))), value=float(value),
        readings=[float(v) for v in best.get("readings", [value])], metric=metric,
        objective=objective,
        params=best.get("params") or {k: _json_or_str(v) for k, v in params.items()
                                      if not k.startswith("env.")},
        flags=[str(f) for f in best.get("flags", flags)],
        env={str(k): str(v) for k, v in (best.get("env") or env).items()},
        serve_command=best.get("serve_command") or serve_command(model or "MODEL", flags, env),
        metrics={k: float(v) for k, v in (best.get("metrics") or metrics).items()
                 if isinstance(v, (int, float))},
        quality={k: v for k, v in metrics.items() if k.startswith("quality_")},
        shape_fingerprint=tags.get(TAGS["shape"]) or tags.get("autotune.best_for_shape", ""),
        shape_path=(best.get("shape") or {}).get("path"), exact=True, distance=0.0,
        verdict="same", drifted_dimensions=[], model=model,
        engine_version=ptags.get(TAGS["engine"]) or tags.get(TAGS["engine"]),
        gpu_type=ptags.get(TAGS["gpu"]) or tags.get(TAGS["gpu"]) or UNKNOWN_GPU,
        is_baseline=bool(best.get("is_baseline", tags.get("autotune.baseline") == "true")),
        storage=uri, notes=notes, study_verdict=_tracked_verdict(best, parent),
        cost=best.get("cost") if isinstance(best.get("cost"), dict) else None,
    )  # fmt: skip


def _tracked_verdict(best: dict[str, Any], parent: Any) -> dict[str, Any] | None:
    """The study's verdict from its best.json, else from the study run's tag and
    ``ratio_to_defaults_*`` or ``ratio_at_least``/``ratio_at_most`` metrics
    (:meth:`autotune.tracking.Tracker.log_verdict`)."""
    if best.get("verdict"):
        return {**(best.get("verdict_detail") or {}), "verdict": best["verdict"],
                "ratio_to_defaults": best.get("ratio_to_defaults")}
    if parent is None or not parent.data.tags.get(A.VERDICT):
        return None
    m = parent.data.metrics
    keys = ("median", "ci_low", "ci_high")
    ratio = ({k: float(m[f"ratio_to_defaults_{k}"]) for k in keys}
             if all(f"ratio_to_defaults_{k}" in m for k in keys) else None)
    bound = next(({"kind": kind, "value": float(m[f"ratio_{kind}"])}
                  for kind in ("at_least", "at_most") if f"ratio_{kind}" in m), None)
    return {"verdict": parent.data.tags[A.VERDICT], "ratio_to_defaults": ratio,
            "ratio_bound": bound}


def find_best_tracked(*, tracking_uri: str, shape: TrafficShape, model: str | None = None,
                      gpu: str | None = None) -> RegistryHit | None:
    """The best known config for ``shape`` from an MLflow store: the trial runs tagged
    ``autotune.best_for_shape=<shape fingerprint>`` (exact fingerprint only; the nearest
    tuned shape is :func:`find_best`'s, from the Optuna storage), filtered like
    :func:`find_best`; throughput studies answer when objectives are mixed."""
    from mlflow.tracking import MlflowClient

    from autotune.results._tracking import BEST_TAG
    from autotune.store import sqlite_path

    db = sqlite_path(tracking_uri)
    if db is not None and not db.exists():  # a lookup must not leave a new store behind
        return None
    client = MlflowClient(tracking_uri=tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    if not exps:
        return None
    runs = client.search_runs(
        exps, filter_string=f"tags.`{BEST_TAG}_for_shape` = '{shape.fingerprint}'")
    hits = [h for h in (_tracked_hit(client, r, tracking_uri) for r in runs) if h is not None
            and (model is None or _same_model(model, h.model))
            and (gpu is None or _same_gpu(gpu, h.gpu_type))]
    if not hits:
        return None
    keep = _THROUGHPUT if any(h.metric == _THROUGHPUT for h in hits) else hits[0].metric
    return max((h for h in hits if h.metric == keep), key=lambda h: h.value)
