"""What ``autotune export`` exports: one measured config of a study, from its best.json or
from the Optuna storage (:class:`ExportSource`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError, StudyError

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


def _gpus_needed(cost: dict[str, Any] | None, capacity: dict[str, Any] | None,
                 metrics: dict[str, Any]) -> float | None:
    """Whole GPUs at the traffic's peak window with growth (best.json's ``cost``), else the
    capacity study's GPUs for the recorded rate."""
    try:
        return float(cost["best"]["gpus"]["peak"]["growth"]["whole"])  # type: ignore[index]
    except (KeyError, TypeError):
        pass
    for src in (capacity or {}, metrics):
        v = src.get("gpus_needed")
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


def _server_gpus(settings: dict[str, Any], device: str) -> int:
    n = settings.get("gpus_per_trial")
    return int(n) if device != "cpu" and isinstance(n, int) and n > 0 else 1


def from_best_json(path: Path) -> ExportSource:
    """The declared config of a study's best.json (``path``: the file or its folder); the
    study.json beside it adds the settings the trial ran with."""
    p = path / "best.json" if path.is_dir() else path
    try:
        best = json.loads(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror or exc}; give a study's best.json "
                          "or its output folder") from None
    except ValueError as exc:
        raise ConfigError(f"{p} is not JSON ({exc}); give a study's best.json") from None
    if not isinstance(best, dict) or "flags" not in best or "model" not in best:
        raise ConfigError(f"{p} is not a study's best.json (no 'flags' or 'model')")
    settings: dict[str, Any] = {}
    try:
        settings = json.loads((p.parent / "study.json").read_text()).get("settings") or {}
    except (OSError, ValueError, AttributeError):
        pass
    engine = best.get("engine") or {}
    device = str(engine.get("device") or "cuda")
    cost = best.get("cost") if isinstance(best.get("cost"), dict) else None
    return ExportSource(
        study=str(best.get("study") or p.parent.name), trial=int(best.get("trial", -1)),
        model=str(best["model"]), flags=[str(f) for f in best["flags"]],
        env={str(k): str(v) for k, v in (best.get("env") or {}).items()},
        engine_version=engine.get("version"), device=device,
        feasible=True,  # best.json names a config its study measured feasible
        verdict=best.get("verdict"), ratio_to_defaults=best.get("ratio_to_defaults"),
        value=(best.get("objective") or {}).get("value"),
        metric=(best.get("objective") or {}).get("metric") or "output_tokens_per_s",
        gpus_per_server=int(cost["gpus_per_server"]) if cost else _server_gpus(settings, device),
        gpus_needed=_gpus_needed(cost, best.get("capacity"), best.get("metrics") or {}),
        shape_path=(best.get("shape") or {}).get("path"),
        shape_fingerprint=(best.get("shape") or {}).get("fingerprint"),
        cpu_kv_cache_gib=settings.get("cpu_kv_cache_gib", 1.0) if device == "cpu" else None,
    )  # fmt: skip


def from_study(*, storage: str, study_name: str, trial: int | None = None) -> ExportSource:
    """The declared config of a study in the Optuna storage, or its trial ``trial``."""
    import optuna

    from autotune.config import store_where
    from autotune.store import A, feasible, objective_metric, open_storage, primary, verdict

    st = open_storage(storage, create=False)
    if st is None:
        raise StudyError(f"no Optuna storage at {store_where(storage)}; give --storage of the "
                         "study (its --out folder keeps it), or its best.json")
    try:
        study = optuna.load_study(study_name=study_name, storage=st)
    except KeyError:
        raise StudyError(f"study {study_name!r} is not in {store_where(storage)}; 'autotune "
                         "report --storage ...' lists the studies there") from None
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
    settings = attrs.get(A.SETTINGS) or {}
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
        gpus_per_server=int(cost["gpus_per_server"]) if cost else _server_gpus(settings, device),
        gpus_needed=_gpus_needed(cost, None, dict(t.user_attrs.get(A.METRICS, {}))),
        shape_path=attrs.get(A.SHAPE_PATH), shape_fingerprint=attrs.get(A.SHAPE),
        cpu_kv_cache_gib=settings.get("cpu_kv_cache_gib", 1.0) if device == "cpu" else None,
    )  # fmt: skip
