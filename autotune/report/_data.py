"""What a study report shows, read from the Optuna storage (and the study's out dir when it
is there): one :class:`ReportData`, built by :func:`load_report_data`.

Figures that newer studies record (``autotune.verdict``, ``autotune.gpu_time``, the
throughput interval of each trial) are read when present; for an older study the report
computes what it can from what is stored and says so (``*_source``), or says "not
recorded".
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config import DEFAULT_OUT_ROOT, store_where
from autotune.errors import StudyError
from autotune.events import ParamValue
from autotune.hardware import unit_of
from autotune.report._importance import param_importances
from autotune.store import A, latest_study, objective_metric, open_storage, server_gpus_of
from autotune.store import verdict as study_verdict

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

__all__ = ["ReportData", "TrialRow", "load_report_data", "trial_row"]

logger = logging.getLogger(__name__)

VERDICT_ATTR = A.VERDICT  # written by the study (issue 14's verdict)
GPU_TIME_ATTR = A.GPU_TIME
REQUEST_ERRORS_ATTR = A.REQUEST_ERRORS  # failed requests by kind (measured trials)
CI_LOW, CI_HIGH = "output_tokens_per_s_ci_low", "output_tokens_per_s_ci_high"


@dataclass(frozen=True)
class TrialRow:
    """One trial of the study as the report shows it."""

    number: int
    state: str  # ok | infeasible | failed | rejected | interrupted | tuner_died | stale | running
    reason: str
    message: str
    value: float | None  # the objective (a Pareto study's first one)
    values: tuple[float, ...]
    baseline: bool
    recheck_of: int | None
    params: dict[str, ParamValue]
    metrics: dict[str, float]
    start_s: float | None
    wall_s: float | None
    log_path: str | None
    slot: str  # the GPU(s) or node the trial ran on ("local" when not recorded)
    request_errors: dict[str, int] = field(default_factory=dict)  # failed requests by kind
    # --objective capacity: the bracket and every load level (autotune.capacity)
    capacity: dict[str, Any] = field(default_factory=dict)
    server_gpus: int = 1  # GPUs one server of its config uses: ``value`` is per GPU

    @property
    def interval(self) -> tuple[float, float] | None:
        """The value's interval (per GPU, as the value; the metrics are the server's)."""
        # a capacity study's interval is its bracket (its high end is missing when capped)
        keys = (("capacity_rps_ci_low", "capacity_rps_ci_high") if "capacity_rps" in self.metrics
                else (CI_LOW, CI_HIGH))
        lo, hi = self.metrics.get(keys[0]), self.metrics.get(keys[1])
        n = self.server_gpus
        return (lo / n, hi / n) if lo is not None and hi is not None else None

    @property
    def label(self) -> str:
        what = "vLLM defaults" if self.baseline else "trial"
        return f"{what} #{self.number}" + (f" (re-check of #{self.recheck_of})"
                                           if self.recheck_of is not None else "")


@dataclass
class ReportData:
    """Everything the report renders; built from storage, never from a live study."""

    study_name: str
    storage: str
    attrs: dict[str, Any]
    n_objectives: int
    metric: str
    trials: list[TrialRow]
    out_dir: Path | None
    shape: dict[str, Any] | None
    shape_note: str
    verdict: dict[str, Any] | None
    verdict_source: str  # "recorded" | "computed" | "none"
    gpu_time: dict[str, dict[str, float]] | None
    gpu_time_source: str  # "recorded" | "computed" | "none"
    importances: dict[str, float] | None
    importance_note: str
    priors: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        """What figures are per and time is counted on: "GPU", or "server" for a study on
        the CPU build of vLLM whose trials ran on no GPU (nothing to count)."""
        if any(t.slot.startswith("gpu") for t in self.trials):
            return "GPU"
        return unit_of(str(self.attrs.get(A.GPU) or ""))

    @property
    def measured(self) -> list[TrialRow]:
        return [t for t in self.trials if t.value is not None]

    @property
    def feasible(self) -> list[TrialRow]:
        return [t for t in self.trials if t.state == "ok" and t.value is not None]

    @property
    def failed(self) -> list[TrialRow]:
        return [t for t in self.trials
                if t.state not in ("ok", "infeasible", "running", "pruned", "screened")]

    @property
    def pruned(self) -> list[TrialRow]:
        """Stopped early by the pruner as clear losers, or at their coarse reading as no
        leaders (screened): measured, not failed."""
        return [t for t in self.trials if t.state in ("pruned", "screened")]

    @property
    def infeasible(self) -> list[TrialRow]:
        return [t for t in self.trials if t.state == "infeasible"]


def _finite_metrics(raw: object) -> dict[str, float]:
    if not isinstance(raw, dict):
        return {}
    return {str(k): float(v) for k, v in raw.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def trial_row(t: FrozenTrial) -> TrialRow:
    from optuna.trial import TrialState  # heavy: loaded when a report is read

    ua = t.user_attrs
    values = tuple(float(v) for v in (t.values or ()) if v is not None)
    value = values[0] if t.state == TrialState.COMPLETE and values else None
    if value is not None and not math.isfinite(value):
        value = None
    reason = str(ua.get(A.REASON) or "")
    if t.state == TrialState.RUNNING:
        state = "running"
    elif t.state == TrialState.COMPLETE:
        state = str(ua.get(A.STATE) or ("ok" if all(
            c <= 0 for c in (t.constraints or {}).values()) else "infeasible"))
    else:
        state = "rejected" if reason == "rejected" else str(ua.get(A.STATE) or "failed")
        if reason in ("interrupted", "tuner_died", "stale"):
            state = reason
    gpus = ua.get(A.GPUS)
    slot = ("gpu " + ",".join(str(g) for g in gpus) if gpus
            else str(ua.get(A.NODE) or "")[:12] or "local")
    recheck = ua.get(A.RECHECK_OF)
    return TrialRow(
        number=t.number, state=state, reason=reason, message=str(ua.get(A.MESSAGE) or ""),
        value=value, values=values, baseline=bool(ua.get(A.BASELINE)),
        recheck_of=int(recheck) if recheck is not None else None, params=dict(t.params),
        metrics=_finite_metrics(ua.get(A.METRICS)), start_s=_num(ua.get(A.START_S)),
        wall_s=_num(ua.get(A.WALL_S)), log_path=ua.get(A.LOG), slot=slot,
        request_errors={str(k): int(v) for k, v in dict(ua.get(REQUEST_ERRORS_ATTR) or {}).items()
                        if isinstance(v, int)},
        capacity=dict(ua.get(A.CAPACITY) or {}), server_gpus=server_gpus_of(t),
    )  # fmt: skip


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _out_dir(attrs: Mapping[str, object], study_name: str, out_dir: Path | None) -> Path | None:
    if out_dir is not None:
        return out_dir
    settings = attrs.get("autotune.settings") or {}
    guess = settings.get("out") if isinstance(settings, dict) else None
    path = Path(guess) if guess else DEFAULT_OUT_ROOT / study_name
    return path if path.is_dir() else None


def _shape(attrs: Mapping[str, object], out_dir: Path | None) -> tuple[dict[str, Any] | None, str]:
    raw = attrs.get("autotune.shape_path")
    candidates = [Path(str(raw))] if raw else []
    if out_dir is not None:
        candidates.append(out_dir / "shape.json")
    for path in candidates:
        try:
            obj = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict):
            fp = attrs.get("autotune.shape_fingerprint")
            note = "" if not fp or obj.get("fingerprint") == fp else (
                f"{path} now has fingerprint {obj.get('fingerprint')}, the study was tuned "
                f"for {fp}: the file changed since")
            return obj, note
    fp = attrs.get("autotune.shape_fingerprint")
    return None, ((f"the shape file {raw} is not readable here" if raw else
                   "the study recorded no shape file and its out dir holds no shape.json")
                  + (f"; the study was tuned for shape fingerprint {fp}" if fp else
                     "; nor did it record the shape's fingerprint"))


def _bootstrap_ratio(win: list[float], base: list[float], seed: int = 0,
                     n: int = 2000) -> tuple[float, float] | None:
    import numpy as np

    if len(win) < 2 or len(base) < 2 or min(base) <= 0:
        return None
    rng = np.random.default_rng(seed)
    w = np.median(rng.choice(win, size=(n, len(win))), axis=1)
    b = np.median(rng.choice(base, size=(n, len(base))), axis=1)
    r = w / b
    return float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))


def _verdict(study: Study, attrs: Mapping[str, object], out_dir: Path | None
             ) -> tuple[dict[str, Any] | None, str]:
    import numpy as np

    rec = attrs.get(VERDICT_ATTR)
    if isinstance(rec, dict) and rec.get("verdict") not in (None, "none"):
        return rec, "recorded"
    win, win_vals, base, base_vals = study_verdict(study)
    if win is None:
        return None, "none"
    med = float(np.median(win_vals))
    base_med = float(np.median(base_vals)) if base_vals else None
    ratio: dict[str, float | None] | None = None
    if base_med:
        ci = _bootstrap_ratio(win_vals, base_vals)
        ratio = {"median": med / base_med, "ci_low": ci[0] if ci else None,
                 "ci_high": ci[1] if ci else None}
    is_base = bool(win.user_attrs.get("autotune.baseline"))
    return {
        "verdict": "defaults_best" if is_base else "winner",
        "ratio_to_defaults": ratio,
        "winner_number": win.number,
        "baseline_number": base.number if base is not None else None,
        "winner_value": med, "winner_readings": win_vals,
        "baseline_value": base_med, "baseline_readings": base_vals,
    }, "computed"


def _gpu_time(attrs: Mapping[str, object], trials: list[TrialRow]
              ) -> tuple[dict[str, dict[str, float]] | None, str]:
    rec = attrs.get(GPU_TIME_ATTR)
    if isinstance(rec, dict) and rec:
        return {str(k): {str(a): float(b) for a, b in v.items()
                         if isinstance(b, (int, float))}
                for k, v in rec.items() if isinstance(v, dict)}, "recorded"
    out: dict[str, dict[str, float]] = {}
    for t in trials:
        if t.wall_s is None:
            continue
        acc = out.setdefault(t.slot, {"start_s": 0.0, "measure_s": 0.0, "other_s": 0.0})
        start = min(t.start_s or 0.0, t.wall_s)
        acc["start_s"] += start
        # without a recorded split, the rest of a measured trial is its replay (warm-up
        # included) and the rest of a failed one is teardown and waiting
        acc["measure_s" if t.value is not None else "other_s"] += t.wall_s - start
    return (out, "computed") if out else (None, "none")


def load_report_data(*, storage: str, study_name: str | None = None,
                     out_dir: Path | None = None) -> ReportData:
    """Read a study (the newest in ``storage`` when ``study_name`` is None) for the report.

    Raises :class:`StudyError` when the storage or the study cannot be read."""
    import optuna


    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = open_storage(storage, create=False)  # a report leaves no empty store behind
    if store is None or study_name is None:
        study_name = latest_study(store) if store is not None else None
        if study_name is None:
            raise StudyError(
                f"no study in {store_where(storage)}"
                f"{' (no such file)' if store is None else ''}; a study keeps its stores in "
                "its --out folder: pass --out DIR (or --storage with the URL the study used), "
                "or run 'autotune tune' first")
    assert store is not None  # without a store there is no study name: raised above
    try:
        study = optuna.load_study(study_name=study_name, storage=store)
    except KeyError:
        names = sorted(optuna.get_all_study_names(store))
        raise StudyError(f"study {study_name!r} is not in {store_where(storage)}; known "
                         f"studies: {', '.join(names) or 'none'}") from None
    attrs = dict(study.user_attrs)
    all_trials = study.get_trials(deepcopy=False)
    own = [t for t in all_trials if not t.user_attrs.get(A.PRIOR)]
    rows = [trial_row(t) for t in own]
    raw = attrs.get(A.SETTINGS)
    settings: dict[str, Any] = raw if isinstance(raw, dict) else {}
    try:
        metric = objective_metric(str(settings.get("objective", "throughput")))
    except KeyError:
        metric = "objective"
    out = _out_dir(attrs, study_name, out_dir)
    shape, shape_note = _shape(attrs, out)
    verdict, verdict_source = _verdict(study, attrs, out)
    gpu_time, gpu_source = _gpu_time(attrs, rows)
    imp, imp_note, _ = param_importances(study)
    return ReportData(
        study_name=study_name, storage=storage, attrs=attrs,
        n_objectives=len(study.directions), metric=metric, trials=rows, out_dir=out,
        shape=shape, shape_note=shape_note, verdict=verdict, verdict_source=verdict_source,
        gpu_time=gpu_time, gpu_time_source=gpu_source, importances=imp,
        importance_note=imp_note, priors=len(all_trials) - len(own), settings=settings,
    )  # fmt: skip
