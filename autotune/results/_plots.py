"""PNG plots of a study (for MLflow artifacts): optimization history, importances, Pareto front.

Matplotlib's object API with the Agg canvas (no pyplot, no global backend switch, no display).
Every plot is written even when the study has too few trials for it: the figure then says
why, so a study always has the same artifacts. Trials copied from an earlier study as prior
knowledge (:attr:`autotune.store.A.PRIOR`) are left out: they were measured under
another traffic shape.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.errors import TrackingError
from autotune.report import param_importances
from autotune.store import (
    A,
    FailureReason,
    State,
    feasible,
    is_prior,
    objective_metric,
    pareto_front,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from optuna import Study

__all__ = ["PLOT_FILES", "param_importances", "pareto_front", "trial_points", "write_study_plots"]

logger = logging.getLogger(__name__)

#: plot key -> file name written by :func:`write_study_plots`.
PLOT_FILES = {
    "history": "optimization_history.png",
    "importance": "param_importances.png",
    "pareto": "pareto_front.png",
}

_THROUGHPUT = "output_tokens_per_s"
_TTFT = "ttft_p99_s"
_MAX_LABELS = 20  # failed trials labelled with their reason in the history plot
# failure reasons: none of the colours that mean feasible/best/infeasible/defaults
_FAIL_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black")


@dataclass(frozen=True)
class _Point:
    number: int
    kind: str  # "ok" | "infeasible" | "failed" | "rejected"
    value: float | None
    reason: str
    baseline: bool
    metrics: dict[str, float]


def trial_points(study: Study) -> list[_Point]:
    from optuna.trial import TrialState

    out: list[_Point] = []
    for t in study.get_trials(deepcopy=False):
        if is_prior(t) or t.state not in (
            TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL
        ):  # fmt: skip
            continue
        reason = str(t.user_attrs.get(A.REASON) or "")
        metrics = {
            str(k): float(v) for k, v in dict(t.user_attrs.get(A.METRICS, {})).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }  # fmt: skip
        # a Pareto study's first objective is throughput (what tune() ranks by)
        value = t.values[0] if t.state == TrialState.COMPLETE and t.values else None
        if value is not None and not math.isfinite(value):
            value = None
        if t.state == TrialState.COMPLETE and value is not None:
            kind: str = State.OK if feasible(t) else State.INFEASIBLE
            reason = reason or ("" if kind == State.OK else State.INFEASIBLE)
        else:
            reason = reason or t.state.name.lower()
            kind = "rejected" if reason == FailureReason.REJECTED else State.FAILED
        out.append(_Point(t.number, kind, value, reason, bool(t.user_attrs.get(A.BASELINE)),
                          metrics))
    return out


def _prior_sources(study: Study) -> dict[str, int]:
    """Study name -> number of prior trials copied from it by a warm start."""
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        prior = t.user_attrs.get(A.PRIOR)
        if prior:
            name = str(prior.get("study", "?")) if isinstance(prior, dict) else "?"
            out[name] = out.get(name, 0) + 1
    return out


def _metric_label(study: Study) -> str:
    settings = study.user_attrs.get(A.SETTINGS) or {}
    objective = settings.get("objective", "throughput") if isinstance(settings, dict) else ""
    try:
        return objective_metric(str(objective))
    except KeyError:
        return "objective"


def _slo(study: Study, key: str) -> float | None:
    settings = study.user_attrs.get(A.SETTINGS) or {}
    slo = settings.get("slo") if isinstance(settings, dict) else None
    value = slo.get(key) if isinstance(slo, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def _figure(size: tuple[float, float] = (8.0, 4.5)) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    return fig, fig.subplots()


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10,
            color="0.35", wrap=True)


def _save(fig: Figure, path: Path, *, tight: bool = False) -> Path:
    """Write the PNG atomically (temp file, then ``os.replace``).

    ``tight``: fit the margins to the labels (an extra layout pass: only where labels vary,
    e.g. parameter names); otherwise fixed margins that fit the axis labels used here.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if tight:
            fig.tight_layout()
        else:
            fig.subplots_adjust(left=0.09, right=0.98, bottom=0.11, top=0.88)
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# ------------------------------------------------------------------------------------------
# Optimization history


def _xy(points: Sequence[_Point]) -> tuple[list[int], list[float]]:
    """Trial numbers and values of the points that have a value."""
    have = [p for p in points if p.value is not None]
    return [p.number for p in have], [float(p.value or 0.0) for p in have]


def _history(study: Study, points: Sequence[_Point], path: Path) -> Path:
    fig, ax = _figure((9.0, 5.0))
    label = _metric_label(study)
    ok = [p for p in points if p.kind == "ok"]
    bad = [p for p in points if p.kind == "infeasible"]
    failed = [p for p in points if p.kind in ("failed", "rejected")]
    n_ok = len(ok)
    title = f"{study.study_name}: optimization history ({len(points)} trials, {n_ok} feasible)"
    priors = _prior_sources(study)
    if priors:
        title += f"\n{sum(priors.values())} prior trial(s) from " + ", ".join(
            f"{name}" for name in sorted(priors)) + " not shown (measured under another shape)"
    ax.set_title(title, fontsize=10 if priors else None)
    ax.set_xlabel("trial number")
    ax.set_ylabel(label)
    if not points:
        _note(ax, "no finished trials yet")
        return _save(fig, path)
    if ok:
        ax.scatter(*_xy(ok), s=28, color="tab:blue", label="feasible", zorder=3)
        best_x: list[float] = []
        best_y: list[float] = []
        best = -math.inf
        for p in sorted(ok, key=lambda q: q.number):
            best = max(best, float(p.value or 0.0))
            best_x.append(p.number)
            best_y.append(best)
        last = max(p.number for p in points)
        if best_x[-1] < last:
            best_x.append(last)
            best_y.append(best_y[-1])
        ax.step(best_x, best_y, where="post", color="tab:red", linewidth=1.5,
                label=f"best so far ({best_y[-1]:,.1f})", zorder=2)
    if bad:
        ax.scatter(*_xy(bad), marker="x", s=36, color="tab:orange",
                   label="infeasible (SLO / error rate)", zorder=3)
    base = next((p for p in points if p.baseline and p.value is not None), None)
    if base is not None:
        ax.axhline(float(base.value or 0.0), color="tab:green", linestyle="--", linewidth=1)
        ax.scatter(*_xy([base]), marker="*", s=160, color="tab:green",
                   label=f"vLLM defaults (trial {base.number}: {base.value:,.1f})", zorder=4)
    if not ok and not bad:
        ax.set_ylim(0.0, 1.0)
        ax.set_yticks([])
        _note(ax, "no trial was measured: every trial failed")
    if failed:
        # failures have no value: mark them on a strip at the bottom, one colour per reason
        trans = ax.get_xaxis_transform()
        reasons = sorted({p.reason for p in failed})
        for i, reason in enumerate(reasons):
            xs = [p.number for p in failed if p.reason == reason]
            color = "0.6" if reason == "rejected" else _FAIL_COLORS[i % len(_FAIL_COLORS)]
            ax.scatter(xs, [0.03] * len(xs), transform=trans, marker="v", s=40, color=color,
                       clip_on=False, zorder=4,
                       label=f"failed: {reason} ({len(xs)})" if reason != "rejected"
                       else f"rejected by the space's rules ({len(xs)})")
        launched = [p for p in failed if p.reason != "rejected"]
        if len(launched) <= _MAX_LABELS:
            for p in launched:
                ax.text(p.number, 0.07, p.reason, transform=trans, rotation=90, fontsize=7,
                        ha="center", va="bottom", color="0.25")
    ax.set_xlim(min(p.number for p in points) - 0.5, max(p.number for p in points) + 0.5)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------
# Parameter importances


def _importance(study: Study, path: Path) -> Path:
    fig, ax = _figure((8.0, 4.5))
    imp, why, n = param_importances(study)
    ax.set_title(f"{study.study_name}: parameter importances (fANOVA, {n} measured trials)")
    if imp is None:
        ax.set_axis_off()
        _note(ax, why)
        return _save(fig, path)
    names = list(imp)[::-1]  # most important on top
    ax.barh(names, [imp[k] for k in names], color="tab:blue")
    ax.set_xlabel(f"share of the variance of {_metric_label(study)}")
    ax.set_xlim(0.0, max(1.0, max(imp.values())))
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path, tight=True)


# ------------------------------------------------------------------------------------------
# Pareto front


def _pareto(study: Study, points: Sequence[_Point], path: Path) -> Path:
    fig, ax = _figure((8.0, 5.0))
    measured = [p for p in points if p.kind in ("ok", "infeasible")
                and _THROUGHPUT in p.metrics and _TTFT in p.metrics]
    ax.set_title(f"{study.study_name}: throughput vs TTFT p99 ({len(measured)} measured trials)")
    ax.set_xlabel("TTFT p99 (s), lower is better")
    ax.set_ylabel("output tokens/s, higher is better")
    if not measured:
        _note(ax, "no trial measured both output_tokens_per_s and ttft_p99_s")
        return _save(fig, path)
    xy = [(p.metrics[_THROUGHPUT], p.metrics[_TTFT]) for p in measured]
    front = set(pareto_front(xy))
    others = [p for i, p in enumerate(measured) if i not in front]
    for kind, marker, color, name in (("ok", "o", "0.55", "feasible"),
                                      ("infeasible", "x", "tab:orange", "infeasible")):
        sel = [p for p in others if p.kind == kind]
        if sel:
            ax.scatter([p.metrics[_TTFT] for p in sel], [p.metrics[_THROUGHPUT] for p in sel],
                       marker=marker, s=30, color=color, label=name, zorder=2)
    fp = sorted((measured[i] for i in front), key=lambda p: p.metrics[_TTFT])
    ax.step([p.metrics[_TTFT] for p in fp], [p.metrics[_THROUGHPUT] for p in fp], where="post",
            color="tab:red", linewidth=1.2, zorder=3)
    for kind, marker, name in (("ok", "o", "Pareto front"),
                               ("infeasible", "X", "on the front, infeasible")):
        sel = [p for p in fp if p.kind == kind]
        if sel:
            ax.scatter([p.metrics[_TTFT] for p in sel], [p.metrics[_THROUGHPUT] for p in sel],
                       marker=marker, s=60, color="tab:red", edgecolor="k", zorder=4,
                       label=f"{name} ({len(sel)})")
    slo = _slo(study, "ttft_p99")
    if slo is not None:
        ax.axvline(slo, color="k", linestyle=":", linewidth=1, label=f"SLO ttft_p99 = {slo:g} s")
    for p in fp:
        ax.annotate(f"#{p.number}" + (" (defaults)" if p.baseline else ""),
                    (p.metrics[_TTFT], p.metrics[_THROUGHPUT]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    base = next((p for p in measured if p.baseline), None)
    if base is not None and base not in fp:
        ax.annotate(f"#{base.number} (defaults)", (base.metrics[_TTFT], base.metrics[_THROUGHPUT]),
                    textcoords="offset points", xytext=(4, -10), fontsize=7, color="tab:green")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------


def write_study_plots(study: Study, out_dir: str | Path) -> dict[str, Path]:
    """Write the history, importance and Pareto PNGs of ``study`` into ``out_dir``.

    Returns ``{"history": path, "importance": path, "pareto": path}`` (see
    :data:`PLOT_FILES`). Any number of trials works, none or only failed ones included.
    Raises :class:`TrackingError` when ``out_dir`` cannot be written or a plot cannot be
    drawn (never for too few trials).
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrackingError(f"cannot create the plot folder {out}: {exc}") from exc
    points = trial_points(study)
    written: dict[str, Path] = {}
    for key, name in PLOT_FILES.items():
        path = out / name
        try:
            if key == "history":
                written[key] = _history(study, points, path)
            elif key == "importance":
                written[key] = _importance(study, path)
            else:
                written[key] = _pareto(study, points, path)
        except OSError as exc:
            raise TrackingError(f"cannot write {path}: {exc}") from exc
        except Exception as exc:  # a foreign (matplotlib/Optuna) error: one clear error
            raise TrackingError(
                f"cannot draw the {key} plot of study {study.study_name}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    logger.info("study plots written: %s", ", ".join(str(p) for p in written.values()))
    return written
