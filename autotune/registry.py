"""The best config per traffic shape, read from the Optuna storage; warm starts for re-tuning.

The Optuna storage is the registry. Every study autotune runs records the shape it was tuned
for (``autotune.shape_fingerprint`` and the file in ``autotune.shape_path``), the model, the
engine version and the GPU type; every trial its state, metrics, flags and environment (see
:mod:`autotune.schema`). :func:`find_best` scans all studies: the winner (as the study's
best.json names it) of the studies tuned for the exact fingerprint, else that of the nearest
tuned shape (by :func:`autotune.traffic.diff_shapes`). :func:`plan_retune` compares a new
shape with that one and, when it drifted, builds a :class:`WarmStart` from the earlier study. See
docs/registry.md.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from autotune.credentials import redact
from autotune.errors import ShapeError, StudyError
from autotune.schema import A, feasible, is_prior, objective_metric, open_storage, primary, verdict
from autotune.traffic import ShapeDiff, TrafficShape, diff_shapes, load_shape

if TYPE_CHECKING:
    from typing import TypeAlias

    import optuna

    from autotune.space import SearchSpace

    #: An Optuna storage URL, or a storage already opened (saves a schema check per call).
    StorageLike: TypeAlias = "str | optuna.storages.BaseStorage"

__all__ = [
    "GPU_ATTR",
    "PRIOR_ATTR",
    "UNKNOWN_GPU",
    "RegistryHit",
    "RetunePlan",
    "TunedStudy",
    "WarmStart",
    "explain_miss",
    "find_best",
    "find_best_tracked",
    "plan_retune",
    "tuned_studies",
    "warm_start_from",
]

logger = logging.getLogger(__name__)

#: Study attribute with the GPU type the study ran on (same name as the MLflow tag).
GPU_ATTR = A.GPU
#: Trial attribute of a prior trial copied from an earlier study (``{"study", "trial", ...}``).
PRIOR_ATTR = A.PRIOR
#: GPU type of studies that did not record one.
UNKNOWN_GPU = "unknown"

_THROUGHPUT = "output_tokens_per_s"
# Trial attributes that belong to the earlier study's run, not to a copy in a new study.
_NOT_COPIED = (A.MLFLOW_RUN, A.BASELINE, A.RECHECK_OF)


# ------------------------------------------------------------------------------------------
# Models


class TunedStudy(BaseModel):
    """One study in the storage that autotune ran, with its winner (if a trial was feasible)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    shape_fingerprint: str
    shape_path: str | None
    model: str | None
    engine_version: str | None
    gpu_type: str
    objective: str
    metric: str
    started: datetime | None
    n_trials: int
    n_feasible: int
    best_trial: int | None
    best_value: float | None


class RegistryHit(BaseModel):
    """The best known config for a shape: its study's winner as best.json names it.

    ``value`` is the median of ``readings`` (every measurement of that config in the study;
    one unless the study re-measured its leaders) and ``trial`` the reading closest to it.

    ``exact`` is True when a study was tuned for this very fingerprint (``distance`` 0,
    ``verdict`` "same"); otherwise the hit is the best config of the nearest tuned shape,
    ``distance`` is :attr:`ShapeDiff.distance` (RMS of distance/threshold; <= 1 everywhere
    means "same") and ``verdict`` says whether the new shape drifted from it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    study: str
    trial: int
    value: float
    readings: list[float]
    metric: str
    objective: str
    params: dict[str, Any]
    flags: list[str]
    env: dict[str, str]
    serve_command: str
    metrics: dict[str, float]
    quality: dict[str, float]
    shape_fingerprint: str
    shape_path: str | None
    exact: bool
    distance: float
    verdict: Literal["same", "drifted"]
    drifted_dimensions: list[str]
    model: str | None
    engine_version: str | None
    gpu_type: str
    is_baseline: bool
    storage: str
    notes: list[str] = []
    # the study's verdict (study.json's "verdict": verdict, ratio_to_defaults, method, ...);
    # None where the store does not record it
    study_verdict: dict[str, Any] | None = None
    # best.json's "cost" (autotune.cost) where the study was given a price, else None
    cost: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``autotune best --json`` prints)."""
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class WarmStart:
    """What a new study starts from, taken from an earlier study.

    ``enqueue``: the earlier study's top configs, to measure first (after the baseline).
    ``prior_trials``: the earlier study's finished trials, rebuilt with
    :func:`optuna.trial.create_trial` (params, distributions, value, state, constraints), to
    add with ``study.add_trials`` before the first ``ask()`` so the sampler starts with that
    knowledge. Their values were measured under the *old* shape (see :func:`warm_start_from`);
    each carries :data:`PRIOR_ATTR` and must not count toward the trial budget, the best trial,
    the baseline or the result files. ``enqueue_from[i]`` is the trial ``enqueue[i]`` came from.
    ``enqueue_baseline[i]`` is True when that trial was the earlier study's baseline (vLLM's
    defaults: the new study runs it as its baseline, with no knob flags).
    """

    enqueue: list[dict[str, Any]]
    prior_trials: list[optuna.trial.FrozenTrial]
    source_study: str = ""
    source_shape_fingerprint: str = ""
    enqueue_from: list[int] = field(default_factory=list)
    enqueue_baseline: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class RetunePlan:
    """The comparison of a new shape with the tuned one, and what a re-tune starts from.

    ``diff`` is None for an exact fingerprint match (nothing to compare). ``warm_start`` is
    set when ``drifted`` (or when the caller forced it).
    """

    hit: RegistryHit
    diff: ShapeDiff | None
    drifted: bool
    warm_start: WarmStart | None


# ------------------------------------------------------------------------------------------
# Storage access


def _resolve(storage: StorageLike) -> tuple[str, Any | None]:
    """(a label for messages, the opened storage or None when nothing is there)."""
    if isinstance(storage, str):
        return storage, _open(storage)
    return str(getattr(storage, "url", type(storage).__name__)), storage


def _open(storage: str) -> Any | None:
    """The RDB storage, or None for a SQLite file that does not exist (nothing was tuned).

    A missing SQLite file is not created: looking something up must not leave files behind.
    """
    return open_storage(storage, create=False)


def _load_study(st: Any, name: str) -> optuna.study.Study:
    import optuna

    try:
        return optuna.load_study(study_name=name, storage=st,
                                 sampler=optuna.samplers.RandomSampler())
    except KeyError as exc:
        raise StudyError(f"study {name!r} is not in the storage") from exc


def _objective(attrs: dict[str, Any]) -> tuple[str, str]:
    settings = attrs.get(A.SETTINGS) or {}
    objective = (settings.get("objective", "throughput") if isinstance(settings, dict)
                 else "throughput")
    try:
        return objective, objective_metric(objective)
    except KeyError:
        return str(objective), str(objective)


@dataclass(frozen=True)
class _Best:
    """A study's winner: the representative trial and every reading of its config."""

    trial: Any
    readings: list[float]
    verdict: dict[str, Any] | None = None  # the study's (autotune.verdict), as study.json's
    cost: dict[str, Any] | None = None  # best.json's "cost" (autotune.cost)

    @property
    def value(self) -> float:
        return float(statistics.median(self.readings))


def _winner(study: Any) -> _Best | None:
    """The study's winner as ``tune()`` declares it in best.json (:func:`schema.verdict`): the
    best median over configs measured more than once when any was re-measured, else the
    best single reading; prior trials never win."""
    rep, readings, _, _ = verdict(study)
    if rep is None or not readings or not all(math.isfinite(v) for v in readings):
        return None
    rec = study.user_attrs.get(A.VERDICT)
    cost = study.user_attrs.get(A.COST)
    return _Best(rep, [float(v) for v in readings], rec if isinstance(rec, dict) else None,
                 cost if isinstance(cost, dict) else None)


def _scan(storage: str, st: Any | None = None, model: str | None = None,
          gpu: str | None = None) -> list[tuple[TunedStudy, _Best | None]]:
    """Every autotune study (of ``model`` and ``gpu`` when given) with its winner (None when
    no trial was feasible).

    ``st``: the storage already opened (opening one costs a schema check). Lists the studies
    from the storage directly (``get_all_study_summaries`` queries every study's trials).
    """

    st = st if st is not None else _open(storage)
    if st is None:
        return []
    try:
        studies = st.get_all_studies()
    except Exception as exc:  # one clear error for any storage failure
        raise StudyError(f"cannot list the studies in {redact(storage)!r}: "
                         f"{redact(str(exc))}") from exc
    out: list[tuple[TunedStudy, Any]] = []
    for s in studies:
        attrs = dict(s.user_attrs)
        fp = attrs.get(A.SHAPE)
        if not fp:
            continue  # not an autotune study
        gpu_type = str(attrs.get(GPU_ATTR) or UNKNOWN_GPU)
        if (model is not None and not _same_model(model, attrs.get(A.MODEL))) or (
            gpu is not None and not _same_gpu(gpu, gpu_type)
        ):
            continue  # filtered before reading its trials
        study = _load_study(st, s.study_name)
        trials = study.get_trials(deepcopy=False)  # cached: _winner reads them again
        ok = [t for t in trials if feasible(t)]
        best = _winner(study) if ok else None
        objective, metric = _objective(attrs)
        starts = [t.datetime_start for t in trials if t.datetime_start is not None]
        info = TunedStudy(
            name=s.study_name, shape_fingerprint=str(fp),
            shape_path=attrs.get(A.SHAPE_PATH), model=attrs.get(A.MODEL),
            engine_version=attrs.get(A.ENGINE),
            gpu_type=gpu_type, objective=objective,
            metric=metric, started=min(starts) if starts else None,
            n_trials=sum(1 for t in trials if not is_prior(t)), n_feasible=len(ok),
            best_trial=best.trial.number if best else None,
            best_value=best.value if best else None,
        )  # fmt: skip
        out.append((info, best))
    return out


def tuned_studies(*, storage: StorageLike) -> list[TunedStudy]:
    """The studies autotune ran in ``storage``, oldest first (empty when there are none)."""
    url, st = _resolve(storage)
    rows = [info for info, _ in _scan(url, st)] if st is not None else []
    return sorted(rows, key=lambda r: (r.started is None, r.started or datetime.min, r.name))


# ------------------------------------------------------------------------------------------
# Lookup


def _same_model(query: str, stored: str | None) -> bool:
    """``--model`` matches the stored (resolved) path, the same path, or its folder name."""
    if stored is None:
        return False
    if query == stored or Path(stored).name == query.rstrip("/"):
        return True
    try:
        return Path(query).expanduser().resolve() == Path(stored).resolve()
    except OSError:
        return False


def _same_gpu(query: str, stored: str) -> bool:
    """Case-insensitive; "H200" matches "NVIDIA H200"."""
    q, s = query.strip().lower(), stored.strip().lower()
    return q == s or (bool(q) and q in s)


def _filter(rows: list[tuple[TunedStudy, Any]], model: str | None,
            gpu: str | None) -> list[tuple[TunedStudy, Any]]:
    return [
        (info, best) for info, best in rows
        if (model is None or _same_model(model, info.model))
        and (gpu is None or _same_gpu(gpu, info.gpu_type))
    ]  # fmt: skip


def _prefer_metric(rows: list[tuple[TunedStudy, Any]]) -> list[tuple[TunedStudy, Any]]:
    """Values of different objectives do not compare: keep throughput studies when mixed."""
    metrics = {info.metric for info, _ in rows}
    if len(metrics) <= 1:
        return rows
    keep = _THROUGHPUT if _THROUGHPUT in metrics else min(metrics)
    return [(i, b) for i, b in rows if i.metric == keep]


def _hit(storage: str, info: TunedStudy, win: _Best, *, exact: bool, diff: ShapeDiff | None,
         notes: list[str]) -> RegistryHit:
    from autotune.engine import serve_command

    best = win.trial
    flags = [str(f) for f in best.user_attrs.get(A.FLAGS, [])]
    env = {str(k): str(v) for k, v in dict(best.user_attrs.get(A.ENV, {})).items()}
    metrics = {str(k): float(v) for k, v in dict(best.user_attrs.get(A.METRICS, {})).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return RegistryHit(
        study=info.name, trial=best.number, value=win.value, readings=win.readings,
        metric=info.metric,
        objective=info.objective, params=dict(best.params), flags=flags, env=env,
        serve_command=serve_command(info.model or "MODEL", flags, env), metrics=metrics,
        quality={k: v for k, v in metrics.items() if k.startswith("quality_")},
        shape_fingerprint=info.shape_fingerprint, shape_path=info.shape_path, exact=exact,
        distance=0.0 if diff is None else float(diff.distance),
        verdict="same" if diff is None else diff.verdict,
        drifted_dimensions=[] if diff is None else list(diff.drifted_dimensions),
        model=info.model, engine_version=info.engine_version, gpu_type=info.gpu_type,
        is_baseline=bool(best.user_attrs.get(A.BASELINE)), storage=storage, notes=notes,
        study_verdict=win.verdict, cost=win.cost,
    )  # fmt: skip


def _tuned_shape(info: TunedStudy, cache: dict[str, TrafficShape | str]) -> TrafficShape | str:
    """The shape a study was tuned for, or why it cannot be read back."""
    if not info.shape_path:
        return f"study {info.name}: no shape file recorded"
    key = info.shape_path
    if key not in cache:
        p = Path(key)
        if not p.exists():
            cache[key] = f"study {info.name}: its shape file {key} no longer exists"
        else:
            try:
                cache[key] = load_shape(p)
            except ShapeError as exc:
                cache[key] = f"study {info.name}: {exc}"
    shape = cache[key]
    if isinstance(shape, TrafficShape) and shape.fingerprint != info.shape_fingerprint:
        return (f"study {info.name}: its shape file {key} changed since (fingerprint "
                f"{shape.fingerprint}, tuned for {info.shape_fingerprint})")
    return shape


def _find(storage: str, shape: TrafficShape, model: str | None, gpu: str | None,
          st: Any | None = None) -> tuple[RegistryHit, ShapeDiff | None] | None:
    rows = [(i, b) for i, b in _scan(storage, st, model, gpu) if b is not None]
    if not rows:
        return None
    exact = _prefer_metric([(i, b) for i, b in rows if i.shape_fingerprint == shape.fingerprint])
    if exact:
        info, best = max(exact, key=lambda r: r[1].value)
        return _hit(storage, info, best, exact=True, diff=None, notes=[]), None
    notes: list[str] = []
    cache: dict[str, TrafficShape | str] = {}
    scored: list[tuple[float, float, TunedStudy, Any, ShapeDiff]] = []
    for info, best in _prefer_metric(rows):
        tuned = _tuned_shape(info, cache)
        if isinstance(tuned, str):
            notes.append(tuned)
            logger.info("registry: %s", tuned)
            continue
        d = diff_shapes(tuned, shape)
        scored.append((d.distance, -best.value, info, best, d))
    if not scored:
        return None
    _, _, info, best, d = min(scored, key=lambda r: (r[0], r[1]))
    return _hit(storage, info, best, exact=False, diff=d, notes=notes), d


def find_best(
    *, storage: StorageLike, shape: TrafficShape, model: str | None = None,
    gpu: str | None = None,
) -> RegistryHit | None:
    """The best known config for ``shape`` in ``storage``, or None when nothing was tuned.

    The best of the winners (each study's best.json choice: feasible trials only, the best
    median when leaders were re-measured) of the studies tuned for ``shape.fingerprint``;
    else the winner of the nearest tuned shape (its file read back from the recorded path;
    studies whose file is gone or changed are skipped and named in ``notes``). ``model``
    and ``gpu`` restrict the studies (see :func:`_same_model`, :func:`_same_gpu`). When
    studies of different objectives match, throughput studies are preferred. Prior trials
    copied into a re-tune study never win: they were measured under another shape.
    ``storage``: an Optuna storage URL (a missing SQLite file is not created) or an opened
    storage.
    """
    url, st = _resolve(storage)
    found = _find(url, shape, model, gpu, st) if st is not None else None
    return found[0] if found else None


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
    from autotune.tracking import BEST_VALUE, TAGS

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
    from autotune.tracking import TAGS

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
    ``ratio_to_defaults_*`` metrics (:meth:`autotune.tracking.Tracker.log_verdict`)."""
    if best.get("verdict"):
        return {**(best.get("verdict_detail") or {}), "verdict": best["verdict"],
                "ratio_to_defaults": best.get("ratio_to_defaults")}
    if parent is None or not parent.data.tags.get(A.VERDICT):
        return None
    m = parent.data.metrics
    keys = ("median", "ci_low", "ci_high")
    ratio = ({k: float(m[f"ratio_to_defaults_{k}"]) for k in keys}
             if all(f"ratio_to_defaults_{k}" in m for k in keys) else None)
    return {"verdict": parent.data.tags[A.VERDICT], "ratio_to_defaults": ratio}


def find_best_tracked(*, tracking_uri: str, shape: TrafficShape, model: str | None = None,
                      gpu: str | None = None) -> RegistryHit | None:
    """The best known config for ``shape`` from an MLflow store: the trial runs tagged
    ``autotune.best_for_shape=<shape fingerprint>`` (exact fingerprint only; the nearest
    tuned shape is :func:`find_best`'s, from the Optuna storage), filtered like
    :func:`find_best`; throughput studies answer when objectives are mixed."""
    from mlflow.tracking import MlflowClient

    from autotune.schema import sqlite_path
    from autotune.tracking import BEST_TAG

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


def explain_miss(*, storage: StorageLike, model: str | None = None,
                 gpu: str | None = None) -> str:
    """Why :func:`find_best` found nothing, with the fix (for the CLI's message)."""
    storage, st = _resolve(storage)
    rows = _scan(storage, st) if st is not None else []
    if not rows:
        return (f"no tuned study in {storage}; tune one first (autotune tune --model DIR "
                "--shape FILE --space FILE --storage ...) or point --storage at the database "
                "your studies were written to")
    matching = _filter(rows, model, gpu)
    if not matching:
        models = sorted({i.model or "?" for i, _ in rows})
        gpus = sorted({i.gpu_type for i, _ in rows})
        want = ", ".join(x for x in (f"--model {model}" if model else "",
                                     f"--gpu {gpu}" if gpu else "") if x)
        return (f"{len(rows)} tuned stud{'y' if len(rows) == 1 else 'ies'} in {storage}, "
                f"none for {want}; tuned models: {', '.join(models)}; GPU types: "
                f"{', '.join(gpus)} ('{UNKNOWN_GPU}' = recorded before autotune stored it)")
    if all(b is None for _, b in matching):
        return (f"{len(matching)} matching stud{'y' if len(matching) == 1 else 'ies'} in "
                f"{storage}, but no trial in them was feasible (state 'ok'); see their "
                "failure reasons in trials.csv or MLflow, loosen --slo, or re-run the study")
    return (f"the tuned studies in {storage} cannot be compared with this shape: their shape "
            "files are gone or changed; keep shape files where they were tuned, or tune this "
            "shape (autotune tune)")


# ------------------------------------------------------------------------------------------
# Warm start


def _fit_to_space(params: dict[str, Any], dists: dict[str, Any],
                  space: SearchSpace | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Params and distributions re-expressed in ``space``; None when they no longer fit it.

    Optuna refuses a parameter whose distribution kind (or categorical choices) changed
    within one study, so a prior trial takes the new space's distribution when its value
    is inside it, and is dropped otherwise.
    """
    if space is None:
        return dict(params), dict(dists)
    new_p: dict[str, Any] = {}
    new_d: dict[str, Any] = {}
    for name, value in params.items():
        knob = space.knobs.get(name)
        if knob is None or not knob.contains(value):
            return None
        dist = knob.distribution()
        try:  # also checks an int knob's step, which Knob.contains does not
            inside = bool(dist._contains(dist.to_internal_repr(value)))
        except (ValueError, TypeError):
            inside = False
        if not inside:
            return None
        new_p[name], new_d[name] = value, dist
    return new_p, new_d


def warm_start_from(
    storage: StorageLike, study_name: str, *, top_k: int = 3, space: SearchSpace | None = None,
    value_scale: float = 1.0, objective: str | None = None, pareto_latency: str = "ttft_p99",
    include_baseline: bool = False,
) -> WarmStart:  # fmt: skip
    """A :class:`WarmStart` from study ``study_name`` in ``storage``.

    ``enqueue``: the params of its ``top_k`` best feasible configs (ranked by the median of
    their readings), the baseline left out (a new study measures vLLM's defaults itself)
    unless ``include_baseline`` (for a new study run without its baseline: the old defaults,
    when they rank among the top, are marked in ``enqueue_baseline`` and run as the new
    study's baseline). ``prior_trials``: its COMPLETE and PRUNED trials (failed starts and
    rejected samples included: they are what the sampler learns to avoid; FAIL = tuner died,
    no information) with their constraints.

    The choice about values: a prior trial keeps the objective value it had, measured under
    the *old* shape, multiplied by ``value_scale`` (pass new/old throughput of a reference
    config if known). TPE uses values only to rank trials into "good" and "bad", so what
    carries over is which regions were good or failed; because prior trials are added first,
    TPE's default weights down-weight them once the new study has more than 25 trials. If
    the new shape is much slower overall, raw old values outrank every new trial for a while
    and keep the search near the old optimum; that is the intended warm-start bias, and
    ``value_scale`` removes it when a ratio is known.

    ``space`` (the new study's space) keeps only what fits it: priors with a knob it lacks or
    a value outside a knob are dropped, the rest take its distributions; enqueued configs
    must also pass its rules.

    ``objective`` (the new study's: throughput, goodput or pareto with ``pareto_latency``):
    the priors' values are read from their measured metrics for that objective, so a study
    of another objective can warm-start this one (measured trials without the metric are
    left out); None keeps the values as stored (the same objective). Constraints (SLO and
    error-rate verdicts) carry over as the earlier study recorded them.
    """
    url, st = _resolve(storage)
    return _warm_start(url, study_name, top_k=top_k, space=space, value_scale=value_scale,
                       objective=objective, pareto_latency=pareto_latency, st=st,
                       include_baseline=include_baseline)


def _prior_values(t: Any, objective: str | None, latency: str,
                  scale: float) -> list[float] | None:
    """A COMPLETE trial's values for the new study (throughput scaled); None = unusable."""
    from autotune.config import SLO_KEYS

    if objective is None:
        vals = [float(v) for v in t.values]
    else:
        metrics = dict(t.user_attrs.get(A.METRICS, {}))
        keys = [objective_metric(objective)] + ([SLO_KEYS[latency]] if objective == "pareto"
                                                else [])
        raw = [metrics.get(k) for k in keys]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in raw):
            return None
        vals = [float(v) for v in raw]  # type: ignore[arg-type]
    if not all(math.isfinite(v) for v in vals):
        return None
    return [vals[0] * scale, *vals[1:]]


def _warm_start(storage: str, study_name: str, *, top_k: int, space: SearchSpace | None,
                value_scale: float, objective: str | None = None,
                pareto_latency: str = "ttft_p99", st: Any | None = None,
                include_baseline: bool = False) -> WarmStart:
    import optuna
    from optuna.trial import TrialState

    if top_k < 0:
        raise StudyError(f"--top-k {top_k}: must be >= 0")
    if not math.isfinite(value_scale) or value_scale <= 0:
        raise StudyError(f"value_scale {value_scale}: must be a positive, finite number")
    st = st if st is not None else _open(storage)
    if st is None:
        raise StudyError(f"no Optuna storage at {storage}; nothing to warm-start from")
    names = [s.study_name for s in st.get_all_studies()]
    if study_name not in names:
        raise StudyError(
            f"study {study_name!r} is not in {storage}; known studies: "
            f"{', '.join(sorted(names)) or 'none'}"
        )
    study = _load_study(st, study_name)
    fp = str(study.user_attrs.get(A.SHAPE, ""))
    trials = study.get_trials(deepcopy=False)

    # configs (not the baseline, unless asked): the one the study declared best first (the
    # verdict's rule, as best.json names it), then the rest by the median of their readings
    groups: dict[str, list[Any]] = {}
    for t in trials:
        if feasible(t) and (include_baseline or not t.user_attrs.get(A.BASELINE)):
            groups.setdefault(json.dumps(t.params, sort_keys=True, default=str), []).append(t)
    declared = verdict(study).winner
    first = json.dumps(declared.params, sort_keys=True, default=str) if declared else None
    ranked = sorted(groups.items(), key=lambda kv: (kv[0] == first,
                                                    statistics.median(primary(t) for t in kv[1])),
                    reverse=True)
    enqueue: list[dict[str, Any]] = []
    origin: list[int] = []
    was_base: list[bool] = []
    for _, ts in ranked:
        if len(enqueue) >= top_k:
            break
        t = min(ts, key=lambda u: u.number)
        fitted = _fit_to_space(dict(t.params), dict(t.distributions), space)
        if fitted is None or (space is not None and space.violations(fitted[0])):
            logger.info("warm start: trial %d of %s does not fit the new space", t.number,
                        study_name)
            continue
        enqueue.append(fitted[0])
        origin.append(t.number)
        was_base.append(bool(t.user_attrs.get(A.BASELINE)))

    priors: list[optuna.trial.FrozenTrial] = []
    dropped = 0
    for t in trials:
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED) or is_prior(t):
            continue
        fitted = _fit_to_space(dict(t.params), dict(t.distributions), space)
        if fitted is None:
            dropped += 1
            continue
        attrs = {k: v for k, v in t.user_attrs.items() if k not in _NOT_COPIED}
        attrs[PRIOR_ATTR] = {"study": study_name, "trial": t.number, "shape_fingerprint": fp,
                             "baseline": bool(t.user_attrs.get(A.BASELINE)),
                             "value_scale": value_scale}
        system = {k: v for k, v in t.system_attrs.items()
                  if not k.startswith("constraints") and k != "fixed_params"}
        values = None
        if t.state == TrialState.COMPLETE:
            values = _prior_values(t, objective, pareto_latency, value_scale)
            if values is None:
                dropped += 1
                continue
        try:
            priors.append(optuna.trial.create_trial(
                state=t.state, values=values, params=fitted[0], distributions=fitted[1],
                user_attrs=attrs, system_attrs=system, constraints=dict(t.constraints) or None,
            ))  # fmt: skip
        except ValueError as exc:
            dropped += 1
            logger.info("warm start: trial %d of %s cannot be copied: %s", t.number,
                        study_name, exc)
    if dropped:
        logger.info("warm start: %d trial(s) of %s left out (outside the new space, or no "
                    "measured value for the new objective)", dropped, study_name)
    return WarmStart(enqueue=enqueue, prior_trials=priors, source_study=study_name,
                     source_shape_fingerprint=fp, enqueue_from=origin,
                     enqueue_baseline=was_base)


# ------------------------------------------------------------------------------------------
# Re-tune


def plan_retune(
    *, storage: StorageLike, shape: TrafficShape, model: str | None = None,
    gpu: str | None = None, top_k: int = 3, space: SearchSpace | None = None, force: bool = False,
    objective: str | None = None, pareto_latency: str = "ttft_p99",
    include_baseline: bool = False,
) -> RetunePlan | None:  # fmt: skip
    """Compare ``shape`` with the shape the current best config was tuned for.

    The "current best" is :func:`find_best`'s hit for this model (and GPU): the exact
    fingerprint, else the nearest tuned shape, so a shape close to *any* tuned one reuses
    its config. Returns None when nothing was tuned for this model. When the shape drifted
    (or ``force``), ``warm_start`` comes from the hit's study (:func:`warm_start_from`, with
    the new study's ``objective``; ``include_baseline`` when the new study has no baseline).
    """
    url, st = _resolve(storage)
    found = _find(url, shape, model, gpu, st) if st is not None else None
    if found is None:
        return None
    hit, diff = found
    drifted = diff is not None and diff.verdict == "drifted"
    ws = None
    if drifted or force:
        ws = _warm_start(url, hit.study, top_k=top_k, space=space, value_scale=1.0,
                         objective=objective, pareto_latency=pareto_latency, st=st,
                         include_baseline=include_baseline)
    return RetunePlan(hit=hit, diff=diff, drifted=drifted, warm_start=ws)
