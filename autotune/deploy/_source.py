"""What ``autotune export`` exports: one measured config of a study, from its best.json or
from the Optuna storage (:class:`ExportSource`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.config import store_where
from autotune.errors import ConfigError, StudyError
from autotune.records import BestFile, CapacityDeclared, JsonValue, StudyFile
from autotune.store import A, feasible, objective_metric, open_storage, primary, verdict

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

__all__ = ["ExportSource", "from_best_json", "from_study"]


@dataclass(frozen=True)
class ExportSource:
    """One config as its study measured it: flags and environment as the trial ran them,
    the engine, the verdict and what the traffic needs."""

    study: str
    trial: int
    model: str
    flags: list[str]
    env: dict[str, str]
    engine_version: str | None
    device: str  # "cuda" or "cpu"
    feasible: bool
    verdict: str | None = None
    ratio_to_defaults: dict[str, float] | None = None
    value: float | None = None
    metric: str = "output_tokens_per_s"
    gpus_per_server: int = 1
    gpus_needed: float | None = None  # for the traffic at its peak window (with growth)
    shape_path: str | None = None
    shape_fingerprint: str | None = None
    cpu_kv_cache_gib: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def replicas(self) -> int:
        """Servers for the traffic: the GPUs needed / the GPUs of one server (at least 1)."""
        if self.gpus_needed is None or not math.isfinite(self.gpus_needed):
            return 1
        return max(1, math.ceil(self.gpus_needed / self.gpus_per_server - 1e-9))


def _gpus_needed(cost: Mapping[str, JsonValue] | None, capacity: CapacityDeclared | None,
                 metrics: Mapping[str, float | None]) -> float | None:
    """Whole GPUs at the traffic's peak window with growth (best.json's ``cost``), else the
    capacity study's GPUs for the recorded rate."""
    whole: object = cost
    for key in ("best", "gpus", "peak", "growth", "whole"):
        whole = whole.get(key) if isinstance(whole, dict) else None
    if isinstance(whole, (int, float)):
        return float(whole)
    for v in (capacity.gpus_needed if capacity is not None else None,
              metrics.get("gpus_needed")):
        if v is not None and math.isfinite(v):
            return float(v)
    return None


def _server_gpus(settings: Mapping[str, JsonValue], device: str) -> int:
    n = settings.get("gpus_per_trial")
    return int(n) if device != "cpu" and isinstance(n, int) and n > 0 else 1


def _cpu_kv_cache_gib(settings: Mapping[str, JsonValue], device: str) -> float | None:
    v = settings.get("cpu_kv_cache_gib", 1.0)
    return float(v) if device == "cpu" and isinstance(v, (int, float)) else None


def _cost_gpus_per_server(cost: Mapping[str, JsonValue] | None) -> int | None:
    n = (cost or {}).get("gpus_per_server")
    return int(n) if isinstance(n, (int, float)) else None


def from_best_json(path: Path) -> ExportSource:
    """The declared config of a study's best.json (``path``: the file or its folder); the
    study.json beside it adds the settings the trial ran with."""
    best = BestFile.load(path)
    folder = path if path.is_dir() else path.parent
    settings: dict[str, JsonValue] = {}
    if (folder / StudyFile.FILE_NAME).exists():
        try:
            settings = StudyFile.load(folder / StudyFile.FILE_NAME).settings
        except ConfigError:
            pass  # the settings only add the server's GPUs and a CPU's KV cache
    device = best.engine.device if best.engine is not None and best.engine.device else "cuda"
    ratio = best.ratio_to_defaults
    return ExportSource(
        study=best.study or folder.name, trial=best.trial,
        model=best.model, flags=list(best.flags), env=dict(best.env),
        engine_version=best.engine.version if best.engine is not None else None, device=device,
        feasible=True,  # best.json names a config its study measured feasible
        verdict=best.verdict,
        ratio_to_defaults=({k: v for k, v in ratio.model_dump().items()
                            if isinstance(v, float)} if ratio is not None else None),
        value=best.objective.value, metric=best.objective.metric,
        gpus_per_server=(_cost_gpus_per_server(best.cost)
                         or _server_gpus(settings, device)),
        gpus_needed=_gpus_needed(best.cost, best.capacity, best.metrics),
        shape_path=best.shape.path if best.shape is not None else None,
        shape_fingerprint=best.shape.fingerprint if best.shape is not None else None,
        cpu_kv_cache_gib=_cpu_kv_cache_gib(settings, device),
    )  # fmt: skip


def _not_stored(st: BaseStorage, storage: str, study_name: str) -> str:
    """Why ``study_name`` cannot be exported from ``storage``: the studies it holds, and the
    export of the newest, as it runs (the storage by its absolute path, no password)."""
    import shlex

    import optuna

    names = [s.study_name for s in sorted(
        optuna.get_all_study_summaries(st, include_best_trial=False),
        key=lambda s: s.datetime_start or datetime.min)]
    where = store_where(storage)
    if not names:
        return f"study {study_name!r} is not in {where}: it holds no study"
    return (f"study {study_name!r} is not in {where}; it holds "
            f"{', '.join(repr(n) for n in names)}: e.g. 'autotune export --storage "
            f"{shlex.quote(where)} --study-name {shlex.quote(names[-1])}' (the newest)")


def from_study(*, storage: str, study_name: str, trial: int | None = None) -> ExportSource:
    """The declared config of a study in the Optuna storage, or its trial ``trial``."""
    import optuna  # heavy: only an export from the storage needs it

    st = open_storage(storage, create=False)
    if st is None:
        raise StudyError(f"no Optuna storage at {store_where(storage)}; give --storage of the "
                         "study (its --out folder keeps it), or its best.json")
    try:
        study = optuna.load_study(study_name=study_name, storage=st)
    except KeyError:
        raise StudyError(_not_stored(st, storage, study_name)) from None
    attrs = study.user_attrs
    if trial is None:
        t = verdict(study)[0]
        if t is None:
            raise StudyError(f"study {study_name!r} has no feasible trial to export; give "
                             "--trial N with --force to export a config it never measured "
                             "feasible")
    else:
        found = [x for x in study.get_trials(deepcopy=False) if x.number == trial]
        if not found:
            raise ConfigError(f"--trial {trial}: study {study_name!r} has no such trial")
        t = found[0]
    raw = attrs.get(A.SETTINGS)
    settings: dict[str, JsonValue] = raw if isinstance(raw, dict) else {}
    device = "cpu" if attrs.get(A.GPU) == "cpu" else "cuda"
    rec = attrs.get(A.VERDICT) or {}
    cost = attrs.get(A.COST) if isinstance(attrs.get(A.COST), dict) and trial is None else None
    objective = str(settings.get("objective", "throughput"))
    ok = feasible(t)
    return ExportSource(
        study=study_name, trial=t.number, model=str(attrs.get(A.MODEL) or "MODEL"),
        flags=[str(f) for f in t.user_attrs.get(A.FLAGS, [])],
        env={str(k): str(v) for k, v in dict(t.user_attrs.get(A.ENV, {})).items()},
        engine_version=attrs.get(A.ENGINE), device=device, feasible=ok,
        verdict=rec.get("verdict"), ratio_to_defaults=rec.get("ratio_to_defaults"),
        value=primary(t) if ok else None, metric=objective_metric(objective),
        gpus_per_server=_cost_gpus_per_server(cost) or _server_gpus(settings, device),
        gpus_needed=_gpus_needed(cost, None, dict(t.user_attrs.get(A.METRICS, {}))),
        shape_path=attrs.get(A.SHAPE_PATH), shape_fingerprint=attrs.get(A.SHAPE),
        cpu_kv_cache_gib=_cpu_kv_cache_gib(settings, device),
    )  # fmt: skip
