"""A study's result files: best.json, serve_command.sh, trials.csv, study.json and plots.

Written atomically (temp file, then ``os.replace``) with the config, seed and versions
beside the numbers. ``trials.csv`` is also rewritten after every trial by
:class:`TrialsCsvCallback`, a subscriber of the study's events.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from autotune import __version__, records
from autotune.cost import best_cost, capacity_need
from autotune.credentials import redact, redact_settings
from autotune.engine import serve_command
from autotune.errors import AutotuneError
from autotune.events import StudyCallback, StudyContext, StudyEvent, TrialRecord
from autotune.measure import fmt_value
from autotune.records import BestFile, StudyFile, write_atomic, write_text_atomic
from autotune.report import explain_no_winner, one_line_message, trial_row, write_report
from autotune.results._plots import write_study_plots
from autotune.store import (
    A,
    State,
    failures_by_reason,
    feasible,
    is_prior,
    mlflow_run,
    objective_metric,
    pareto_trials,
    primary,
    rung_counts,
    server_gpus_of,
    verdict,
)
from autotune.trial import recorded_rate

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

    from autotune.config import TuneSettings
    from autotune.traffic import TrafficShape

__all__ = ["TrialsCsvCallback", "TuneResult", "write_config", "write_json_atomic",
           "write_results", "write_trials_csv"]

logger = logging.getLogger(__name__)


@dataclass
class TuneResult:
    """The outcome of :func:`autotune.study.tune`."""

    study_name: str
    storage: str
    out_dir: Path
    best: BestFile | None  # best.json (None when no trial succeeded)
    n_trials: int
    n_ok: int
    n_failed: int  # no measurement (the config failed); pruned trials are not failures
    tracking_uri: str
    failures_by_reason: dict[str, int]
    # artifact name -> file ("plots/optimization_history.png", "trials.csv")
    files: dict[str, Path] = field(default_factory=dict)
    explanation: str = ""  # why no trial won, in one paragraph (empty when one did)
    report: Path | None = None  # OUT/report.html, when it could be written
    verdict: dict[str, object] = field(default_factory=dict)  # autotune.verdict
    gpu_time: dict[str, dict[str, float]] = field(default_factory=dict)  # autotune.gpu_time
    # MLflow: trials logged after the tracking store came back, and what it still lacks
    # ("trial 3", "the study run's results"; ``autotune sync OUT`` logs them)
    mlflow_late: list[int] = field(default_factory=list)
    mlflow_unlogged: list[str] = field(default_factory=list)
    n_pruned: int = 0  # stopped early by the pruner as clear losers: measured, not failed
    # screen, then refine: {"screened": stopped at rung 0, "refined": full resolution}
    rungs: dict[str, int] = field(default_factory=dict)
    gpu_phases: dict[str, float] = field(default_factory=dict)  # autotune.gpu_phases


def write_json_atomic(path: Path, obj: object) -> None:
    """Write JSON via a temp file and ``os.replace`` so readers never see half a file."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_trials_csv(study: Study, path: Path) -> None:
    """One row per trial of this study (priors copied by a warm start left out)."""
    import pandas as pd

    rows = []
    for t in study.get_trials(deepcopy=False):
        if is_prior(t):
            continue  # copied from an earlier study by a warm start: not measured here
        row: dict[str, object] = {
            "number": t.number, "state": t.user_attrs.get(A.STATE, t.state.name.lower()),
            "reason": t.user_attrs.get(A.REASON, ""), "value": primary(t) if t.values else None,
            "baseline": bool(t.user_attrs.get(A.BASELINE)),
            "wall_s": t.user_attrs.get(A.WALL_S), "start_s": t.user_attrs.get(A.START_S),
        }  # fmt: skip
        row.update({f"param.{k}": v for k, v in t.params.items()})
        row.update({f"metric.{k}": v for k, v in t.user_attrs.get(A.METRICS, {}).items()})
        row["flags"] = " ".join(t.user_attrs.get(A.FLAGS, []))
        row["message"] = one_line_message(str(t.user_attrs.get(A.MESSAGE) or ""),
                                          t.user_attrs.get(A.REASON), 2000)
        named = dict(getattr(t, "constraints", None) or {}) or dict(zip(
            ("failed", "slo", "errors", "quality"), t.user_attrs.get(A.CONSTRAINTS, []),
            strict=False))  # Optuna keeps constraints in key order: by name, not position
        for name in ("failed", "slo", "errors", "quality"):
            if name in named:  # > 0: violated (by how much, relative to the limit)
                row[f"constraint.{name}"] = named[name]
        rows.append(row)
    write_atomic(path, lambda tmp: pd.DataFrame(rows).to_csv(tmp, index=False))


class TrialsCsvCallback(StudyCallback):
    """Rewrites ``trials.csv`` after every measured trial (a killed study keeps its table)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._study: Study | None = None

    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        self._study = context.study

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        if self._study is not None and not record.rejected:
            write_trials_csv(self._study, self.path)


def _write_plots(study: Study, out: Path) -> dict[str, Path]:
    """Optimization history, parameter importances and the Pareto front as PNGs."""
    try:
        return write_study_plots(study, out)
    except AutotuneError as exc:  # plots are a convenience: never fail a finished study
        logger.warning("could not write the study plots: %s", exc)
        return {}


def write_config(settings: TuneSettings, path: Path) -> None:
    """The resolved settings as a --config file: the study runs again from it as it is."""
    import yaml

    text = ("# the resolved config of this study: autotune tune --config " + path.name + "\n"
            + yaml.safe_dump(redact_settings(settings.model_dump(mode="json")), sort_keys=False))
    write_atomic(path, lambda tmp: tmp.write_text(text))


def _write_report(ctx: StudyContext) -> Path | None:
    """OUT/report.html; a convenience like the plots: never fails a finished study."""
    try:
        return write_report(ctx.out_dir / "report.html", storage=ctx.settings.storage,
                            study_name=ctx.study.study_name, out_dir=ctx.out_dir)
    except (AutotuneError, OSError, ValueError, RuntimeError, ImportError) as exc:
        logger.warning("could not write the study report: %s", exc)
        return None


def _explain(trials: list[FrozenTrial], settings: TuneSettings) -> str:
    """Why no trial won, in one paragraph (see :func:`autotune.report.explain_no_winner`)."""
    return explain_no_winner([trial_row(t) for t in trials], settings.model_dump(mode="json"))


def _serve_command(model: Path, t: FrozenTrial) -> str:
    return serve_command(str(model), list(t.user_attrs.get(A.FLAGS, [])),
                         dict(t.user_attrs.get(A.ENV, {})))


def capacity_record(t: FrozenTrial, value: float,
                    settings: TuneSettings) -> records.CapacityDeclared:
    """best.json's ``capacity``: the declared capacity (the median of its readings), the
    bracket of the reading it rests on, output tokens/s there, and the GPUs (servers on a
    CPU) the recorded traffic needs: recorded rate / capacity x GPUs per server, an upper
    bound (``needed_is`` "at_most"), and recorded rate / the bracket's top, the least it
    can be (``gpus_needed_low``; None when no level failed: ``bracket_closed`` false)."""
    m: dict[str, float] = dict(t.user_attrs.get(A.METRICS, {}))
    cap = dict(t.user_attrs.get(A.CAPACITY) or {})
    recorded = float(m.get("capacity_recorded_rps") or cap.get("recorded_rps") or 0.0)
    per_server = (m["gpus_needed"] / m["servers_needed"]
                  if m.get("servers_needed") else 1.0)
    high = m.get("capacity_rps_ci_high")
    need = capacity_need(recorded_rps=recorded, capacity_rps=value, high_rps=high,
                         gpus_per_server=per_server)
    # sessions/s: the same scale of the recorded session rate (a session search)
    sps = m.get("capacity_recorded_sps")
    per = float(sps) / recorded if sps is not None and recorded > 0 else None
    return records.CapacityDeclared(
        capacity_rps=value,
        capacity_rps_ci_low=m.get("capacity_rps_ci_low"),
        capacity_rps_ci_high=high,
        bracket_closed=high is not None,
        output_tokens_per_s_at_capacity=m.get("output_tokens_per_s_at_capacity"),
        busiest_rps_at_capacity=m.get("capacity_busiest_rps"),
        recorded_rps=recorded,
        servers_needed=need.servers if need else None,
        gpus_needed=need.gpus if need else None,
        servers_needed_low=need.servers_low if need else None,
        gpus_needed_low=need.gpus_low if need else None,
        needed_is="at_most",
        goodput_bar=settings.measure.capacity_goodput,
        slo=dict(settings.measure.slo),
        search=cap.get("status"),
        flat_misses_rps=cap.get("flat_misses_rps"),
        levels=cap.get("levels", []),
        capacity_sps=value * per if per is not None else None,
        capacity_sps_ci_high=high * per if per is not None and high is not None else None,
        recorded_sps=float(sps) if sps is not None else None,
    )


def gpus_record(t: FrozenTrial, value: float, settings: TuneSettings,
                shape: TrafficShape) -> records.GpusNeeded:
    """best.json's ``gpus``: the GPUs one server of the declared config uses and, where
    the shape has a recorded arrival rate, the servers (and GPUs) that rate needs. ``value``
    is the declared objective per GPU: capacity (req/s) -> recorded rate / a server's
    capacity, at most (``needed_is`` "at_most"; at least recorded rate / the bracket's top,
    ``servers_needed_low``); throughput -> the rate's output tokens/s (rate x mean output
    length) / a server's; goodput -> recorded rate / a server's goodput (``needed_is``
    "estimate"). A closed-loop shape has no rate: its traffic ran on one server."""
    n = server_gpus_of(t)
    capacity = settings.objective == "capacity"
    closed = records.GpusNeeded(per_server=n, servers_needed=None, gpus_needed=None,
                        servers_needed_low=None, gpus_needed_low=None,
                        needed_is="at_most" if capacity else "estimate",
                        basis="a closed-loop shape: its traffic ran on one server")
    try:
        rate = recorded_rate(shape)
    except AutotuneError:
        return closed
    per_server = value * n
    if capacity:
        need = capacity_need(recorded_rps=rate, capacity_rps=per_server,
                             high_rps=(t.user_attrs.get(A.METRICS) or {}).get(
                                 "capacity_rps_ci_high"), gpus_per_server=n)
        if need is None:
            return closed
        return closed.model_copy(update={
            "servers_needed": need.servers, "gpus_needed": need.gpus,
            "servers_needed_low": need.servers_low, "gpus_needed_low": need.gpus_low,
            "basis": f"the recorded {fmt_value(rate)} req/s / a server's capacity"})
    if settings.objective == "goodput":
        demand, basis = rate, f"the recorded {fmt_value(rate)} req/s / a server's goodput"
    else:
        mean_out = float(shape.output_tokens.mean)
        demand = rate * mean_out
        basis = (f"the recorded {fmt_value(rate)} req/s x {mean_out:.0f} output tokens / a "
                 "server's output tokens/s")
    if per_server <= 0:
        return closed
    servers = demand / per_server
    return closed.model_copy(update={"servers_needed": servers, "gpus_needed": servers * n,
                                     "basis": basis})


def _baseline(t: FrozenTrial | None, value: float | None,
              readings: list[float]) -> records.BaselineRecord | None:
    if t is None:
        return None
    return records.BaselineRecord(trial=t.number, value=value, readings=readings,
                          metrics=t.user_attrs.get(A.METRICS, {}), server_gpus=server_gpus_of(t))


def _pareto(ctx: StudyContext) -> dict[str, object]:
    """best.json's ``pareto_latency`` and ``pareto_front`` (``--objective pareto``)."""
    latency = ctx.settings.pareto_latency
    return {"pareto_latency": latency, "pareto_front": [
        records.ParetoPoint.model_validate(
            {"trial": t.number, "output_tokens_per_s": t.values[0], latency + "_s": t.values[1],
             "params": dict(t.params), "serve_command": _serve_command(ctx.model, t)})
        for t in pareto_trials(ctx.study)]}


def best_config(ctx: StudyContext) -> BestFile | None:
    """best.json: the study's winner (:func:`autotune.store.verdict`)."""
    study, settings = ctx.study, ctx.settings
    best_t, best_vals, base_t, base_vals = verdict(study)
    if best_t is None:
        return None
    record = dict(study.user_attrs.get(A.VERDICT) or {})
    best_value = float(statistics.median(best_vals))
    base_value = float(statistics.median(base_vals)) if base_vals else None
    ratio = record.get("ratio_to_defaults")
    fields: dict[str, object] = {
        "verdict": record.get("verdict"),
        "ratio_to_defaults": records.RatioRecord.model_validate(ratio) if ratio else None,
        "verdict_detail": {k: v for k, v in record.items()
                           if k not in ("verdict", "ratio_to_defaults")},
        "params": dict(best_t.params),
        # a lossy winner's accuracy: judged, or plainly not (autotune.quality.quality_caveat);
        # when the defaults remain best (or the leader is unconfirmed) the verdict's word is
        # on another config than this
        "quality": (record.get("quality")
                    if record.get("verdict") not in ("defaults_best", "unconfirmed") else None),
        "serve_command": _serve_command(ctx.model, best_t),
        "metrics": dict(best_t.user_attrs.get(A.METRICS, {})),
        # the objective is per GPU (the server's figure / its GPUs); metrics are the server's
        "objective": records.ObjectiveRecord(
            name=settings.objective, metric=objective_metric(settings.objective), per_gpu=True,
            value=best_value, value_per_server=best_value * server_gpus_of(best_t)),
        "gpus": gpus_record(best_t, best_value, settings, ctx.shape),
        "readings": best_vals,
        "spread": (max(best_vals) - min(best_vals)) / best_value if best_value else None,
        "selection": (f"median of {len(best_vals)} readings (fresh-server re-check)"
                      if len(best_vals) > 1 else "single reading"),
        "flags": list(best_t.user_attrs.get(A.FLAGS, [])),
        "env": dict(best_t.user_attrs.get(A.ENV, {})),
        "trial": best_t.number,
        # the config's first trial when this reading is a fresh-server re-check of it
        "recheck_of": best_t.user_attrs.get(A.RECHECK_OF),
        "is_baseline": bool(best_t.user_attrs.get(A.BASELINE)),
        "baseline": _baseline(base_t, base_value, base_vals),
        "ratio_to_baseline": (best_value / base_value) if base_value else None,
        "study": study.study_name,
        "storage": redact(settings.storage),
        "shape": records.ShapeRef(name=ctx.shape.name, fingerprint=ctx.shape.fingerprint,
                          path=str(settings.shape)),
        "model": str(ctx.model),
        "space": records.SpaceRef(name=ctx.space.name, path=str(settings.space)),
        "engine": records.EngineRef(package=ctx.engine.package, version=ctx.engine.version,
                            device=ctx.engine.device),
        "slo": settings.measure.slo,
        "seed": settings.seed,
        "mlflow_run_id": mlflow_run(study, best_t),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "autotune_version": __version__,
    }
    if settings.objective == "capacity":  # per server: the value is per GPU
        fields["capacity"] = capacity_record(best_t, best_value * server_gpus_of(best_t),
                                             settings)
    best = BestFile.model_validate(fields)
    cost = best_cost(best.to_json(), settings=settings, shape=ctx.shape,
                     device=ctx.engine.device)
    if cost is not None:  # no price is built in: without --gpu-hour-price, no cost
        fields["cost"] = json.loads(json.dumps(cost))  # as the file holds it (lists)
    if settings.objective == "pareto":
        fields.update(_pareto(ctx))
    return BestFile.model_validate(fields)


def _summary(ctx: StudyContext, trials: list[FrozenTrial], best: BestFile | None,
             explanation: str) -> StudyFile:
    """study.json: the counts, the verdict, the GPU-time account and the settings."""
    study, settings = ctx.study, ctx.settings
    return StudyFile(
        study=study.study_name, storage=redact(settings.storage),
        tracking_uri=redact(ctx.tracking_uri), trials=len(trials),
        ok=sum(1 for t in trials if feasible(t)),
        failed=_n_failed(trials), pruned=_n_pruned(trials), rungs=rung_counts(trials),
        failures_by_reason=failures_by_reason(trials),
        best_trial=best.trial if best else None,
        best_value=best.objective.value if best else None,
        baseline_value=best.baseline.value if best and best.baseline else None,
        explanation=explanation,
        verdict=dict(study.user_attrs.get(A.VERDICT) or {}),
        gpu_time=dict(study.user_attrs.get(A.GPU_TIME) or {}),
        # the resolved config (config.yaml)
        settings=redact_settings(settings.model_dump(mode="json")),
    )


def _n_pruned(trials: list[FrozenTrial]) -> int:
    """The pruner's clear losers: measured, counted apart from the configs that failed."""
    return sum(1 for t in trials if t.user_attrs.get(A.STATE) == State.PRUNED)


def _n_failed(trials: list[FrozenTrial]) -> int:
    from optuna.trial import TrialState  # heavy: the study loaded it already

    return sum(1 for t in trials if t.state in (TrialState.PRUNED, TrialState.FAIL)
               and t.user_attrs.get(A.STATE) not in (State.PRUNED, State.SCREENED))



def confirm_command(out_dir: Path, study_name: str) -> str:
    """The command that confirms an unconfirmed lead (or not): the study resumed from its
    saved config (OUT/config.yaml) with one fresh-server start of the leader and of the
    defaults; no new search trial runs (``--trials`` are done)."""
    import shlex

    return (f"autotune tune --config {shlex.quote(str(out_dir / 'config.yaml'))} "
            f"--study-name {shlex.quote(study_name)} --resume --recheck 1 --recheck-starts 1")


def _add_confirm_command(study: Study, out_dir: Path) -> None:
    """A verdict from one server start each (an unconfirmed lead, or the defaults ahead)
    carries the command that re-checks it on fresh servers (study.json, best.json's
    ``verdict_detail``, the study's ``autotune.verdict``)."""
    from autotune.measure import ONE_START_METHODS

    record = dict(study.user_attrs.get(A.VERDICT) or {})
    if record.get("verdict") == "unconfirmed" or (
            record.get("method") in ONE_START_METHODS and not record.get("candidate_pruned")):
        record["confirm_command"] = confirm_command(out_dir, study.study_name)
        study.set_user_attr(A.VERDICT, record)


def write_results(ctx: StudyContext) -> TuneResult:
    """Write every result file of a finished study and return its :class:`TuneResult`."""
    study, settings, out_dir = ctx.study, ctx.settings, ctx.out_dir
    _add_confirm_command(study, out_dir)
    trials = [t for t in study.get_trials(deepcopy=False) if not is_prior(t)]
    best = best_config(ctx)
    if best is not None:
        if best.cost:  # for 'autotune best' from the storage
            study.set_user_attr(A.COST, best.cost)
        best.save(out_dir / BestFile.FILE_NAME)
        script = (f"#!/bin/sh\n# best config of study {study.study_name} (trial "
                  f"{best.trial})\n{best.serve_command}\n")
        write_text_atomic(out_dir / "serve_command.sh", script)
    write_trials_csv(study, out_dir / "trials.csv")
    plots = _write_plots(study, out_dir / "plots")
    explanation = "" if best is not None else _explain(trials, settings)
    summary = _summary(ctx, trials, best, explanation)
    summary.save(out_dir / StudyFile.FILE_NAME)
    report = _write_report(ctx)
    extra = {name: out_dir / name for name in ("config.yaml", "study.json")
             if (out_dir / name).exists()}
    if report is not None:
        extra["report.html"] = report
    return TuneResult(
        study_name=study.study_name, storage=settings.storage, out_dir=out_dir, best=best,
        n_trials=summary.trials, n_ok=summary.ok, n_failed=summary.failed,
        n_pruned=summary.pruned, rungs=dict(summary.rungs), tracking_uri=ctx.tracking_uri,
        failures_by_reason=summary.failures_by_reason, explanation=explanation, report=report,
        verdict=dict(study.user_attrs.get(A.VERDICT) or {}), gpu_time=summary.gpu_time,
        gpu_phases=dict(study.user_attrs.get(A.GPU_PHASES) or {}),
        files={**{f"plots/{p.name}": p for p in plots.values()},
               "trials.csv": out_dir / "trials.csv", **extra},
    )  # fmt: skip
