"""The best config per traffic shape, read from the Optuna storage; warm starts for re-tuning.

The Optuna storage is the registry. Every study autotune runs records the shape it was tuned
for (``autotune.shape_fingerprint`` and the file in ``autotune.shape_path``), the model, the
engine version and the GPU type; every trial its state, metrics, flags and environment (see
:mod:`autotune.store`). :func:`find_best` scans all studies: the winner (as the study's
best.json names it) of the studies tuned for the exact fingerprint, else that of the nearest
tuned shape (by :func:`autotune.traffic.diff_shapes`). :func:`plan_retune` compares a new
shape with that one and, when it drifted, builds a :class:`WarmStart` from the earlier study. See
docs/registry.md.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from autotune.config import store_where
from autotune.credentials import redact
from autotune.engine import serve_command
from autotune.errors import ShapeError, StudyError
from autotune.events import ParamValue
from autotune.records import JsonValue
from autotune.store import A, feasible, is_prior, objective_metric, open_storage, verdict
from autotune.traffic import ShapeDiff, TrafficShape, diff_shapes, load_shape

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import TypeAlias

    import optuna
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

    #: An Optuna storage URL, or a storage already opened (saves a schema check per call).
    StorageLike: TypeAlias = "str | optuna.storages.BaseStorage"

logger = logging.getLogger(__name__)
GPU_ATTR = A.GPU
PRIOR_ATTR = A.PRIOR
UNKNOWN_GPU = "unknown"
_THROUGHPUT = "output_tokens_per_s"
_NOT_COPIED = (A.MLFLOW_RUN, A.BASELINE, A.RECHECK_OF)


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
    # the search space file it was given (its settings' ``space``; None before they held it)
    space: str | None = None
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
    params: dict[str, ParamValue]
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
    study_verdict: dict[str, JsonValue] | None = None
    # best.json's "cost" (autotune.cost) where the study was given a price, else None
    cost: dict[str, JsonValue] | None = None

    def to_dict(self) -> dict[str, JsonValue]:
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


def _resolve(storage: StorageLike) -> tuple[str, BaseStorage | None]:
    """(a label for messages, the opened storage or None when nothing is there)."""
    if isinstance(storage, str):
        return storage, _open(storage)
    return str(getattr(storage, "url", type(storage).__name__)), storage


def _open(storage: str) -> BaseStorage | None:
    """The RDB storage, or None for a SQLite file that does not exist (nothing was tuned).

    A missing SQLite file is not created: looking something up must not leave files behind.
    """
    return open_storage(storage, create=False)


def _load_study(st: BaseStorage, name: str) -> optuna.study.Study:
    import optuna

    try:
        return optuna.load_study(study_name=name, storage=st,
                                 sampler=optuna.samplers.RandomSampler())
    except KeyError as exc:
        raise StudyError(f"study {name!r} is not in the storage") from exc


def _objective(attrs: Mapping[str, object]) -> tuple[str, str]:
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

    trial: FrozenTrial
    readings: list[float]
    verdict: dict[str, JsonValue] | None = None  # the study's (autotune.verdict), as study.json's
    cost: dict[str, JsonValue] | None = None  # best.json's "cost" (autotune.cost)

    @property
    def value(self) -> float:
        return float(statistics.median(self.readings))


def _winner(study: optuna.Study) -> _Best | None:
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


def _scan(storage: str, st: BaseStorage | None = None, model: str | None = None,
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
    out: list[tuple[TunedStudy, _Best | None]] = []
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
            engine_version=attrs.get(A.ENGINE), space=_space_of(attrs),
            gpu_type=gpu_type, objective=objective,
            metric=metric, started=min(starts) if starts else None,
            n_trials=sum(1 for t in trials if not is_prior(t)), n_feasible=len(ok),
            best_trial=best.trial.number if best else None,
            best_value=best.value if best else None,
        )  # fmt: skip
        out.append((info, best))
    return out


def _space_of(attrs: dict[str, object]) -> str | None:
    """The search space file a study's recorded settings name."""
    settings = attrs.get(A.SETTINGS)
    space = settings.get("space") if isinstance(settings, dict) else None
    return str(space) if space else None


def tuned_studies(*, storage: StorageLike) -> list[TunedStudy]:
    """The studies autotune ran in ``storage``, oldest first (empty when there are none)."""
    url, st = _resolve(storage)
    rows = [info for info, _ in _scan(url, st)] if st is not None else []
    return sorted(rows, key=lambda r: (r.started is None, r.started or datetime.min, r.name))


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


def _filter(rows: list[tuple[TunedStudy, _Best | None]], model: str | None,
            gpu: str | None) -> list[tuple[TunedStudy, _Best | None]]:
    return [
        (info, best) for info, best in rows
        if (model is None or _same_model(model, info.model))
        and (gpu is None or _same_gpu(gpu, info.gpu_type))
    ]  # fmt: skip


def _prefer_metric(rows: list[tuple[TunedStudy, _Best]]) -> list[tuple[TunedStudy, _Best]]:
    """Values of different objectives do not compare: keep throughput studies when mixed."""
    metrics = {info.metric for info, _ in rows}
    if len(metrics) <= 1:
        return rows
    keep = _THROUGHPUT if _THROUGHPUT in metrics else min(metrics)
    return [(i, b) for i, b in rows if i.metric == keep]


def _hit(storage: str, info: TunedStudy, win: _Best, *, exact: bool, diff: ShapeDiff | None,
         notes: list[str]) -> RegistryHit:

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
          st: BaseStorage | None = None) -> tuple[RegistryHit, ShapeDiff | None] | None:
    rows: list[tuple[TunedStudy, _Best]] = [
        (i, b) for i, b in _scan(storage, st, model, gpu) if b is not None]
    if not rows:
        return None
    exact = _prefer_metric([(i, b) for i, b in rows if i.shape_fingerprint == shape.fingerprint])
    if exact:
        info, best = max(exact, key=lambda r: r[1].value)
        return _hit(storage, info, best, exact=True, diff=None, notes=[]), None
    notes: list[str] = []
    cache: dict[str, TrafficShape | str] = {}
    scored: list[tuple[float, float, TunedStudy, _Best, ShapeDiff]] = []
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


def explain_miss(*, storage: StorageLike, model: str | None = None,
                 gpu: str | None = None) -> str:
    """Why :func:`find_best` found nothing, with the fix (for the CLI's message)."""
    url, st = _resolve(storage)
    rows = _scan(url, st) if st is not None else []
    storage = store_where(url)
    if not rows:
        return (f"no tuned study in {storage}"
                f"{'' if st is not None else ' (no such file)'}; a study keeps its stores in "
                "its --out folder: point --storage at that folder (or at the database the "
                "study was given), or tune one first ('autotune tune' with --model, --shape, "
                "--space and --out)")
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
