"""Judge a committed study again with this checkout's verdict rule, and write the new verdict
wherever the study's own run wrote it: the Optuna study attribute, study.json, best.json
(which names the defaults when the verdict turns to them) and the MLflow study run.

Why: study:azure was judged on the GPU by the rule of the day (one
fresh start per config -> the capacity brackets as within-run intervals: 1.54x [1.45,
1.64], a winner). Its own readings show a 10 % start-to-start spread (the recipe 15.6 then
18.6 req/s), which the rule now pools (docs/measurement.md, section 9). The figures
measured do not change; the judgement does. The verdict of the run is kept as
``verdict_at_run`` (study.json) and best-at-run.json.

    .venv/bin/python experiments/h200-shapes/rejudge.py [--results DIR] KEY...   (here, on CPU)

Prints one line per study: unchanged, or the old and new verdicts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna

from autotune.results import best_config, write_json_atomic
from autotune.store import A, judge_study, verdict_record

H = Path(__file__).resolve().parent


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("verdict", "ratio_to_defaults", "method", "winner_number")
    return all(a.get(k) == b.get(k) for k in keys)


def _ctx(study: Any, best: dict[str, Any], summary: dict[str, Any], out: Path) -> Any:
    """What best_config reads of a study's context, from the files the run wrote."""
    s = summary["settings"]
    settings = SimpleNamespace(
        objective=s["objective"], storage=s["storage"], shape=s["shape"], space=s["space"],
        slo=s.get("slo"), seed=s.get("seed"), pareto_latency=s.get("pareto_latency"),
        **{k: v for k, v in s.items() if k.startswith("capacity")})
    shape = SimpleNamespace(name=best["shape"]["name"], fingerprint=best["shape"]["fingerprint"])
    engine = SimpleNamespace(**best["engine"])
    return SimpleNamespace(study=study, settings=settings, shape=shape,
                           space=SimpleNamespace(name=best["space"]["name"]),
                           model=Path(best["model"]), engine=engine, out_dir=out)


def _mlflow(uri: str, study_name: str, best: dict[str, Any], rec: dict[str, Any], *,
            only_missing: bool = False) -> str:
    """Record the new verdict and what best.json now declares on the study's MLflow run.
    ``only_missing``: only when the run lacks it or records another value (a study run
    whose record was never written: `autotune best` would answer with a trial's single
    reading instead of the declared median)."""
    from autotune.records import BestFile
    from autotune.results import BEST_TAG, BEST_VALUE, TAGS, MlflowTracker, _declared

    tracker = MlflowTracker(uri, experiment="h200-shapes")
    client = tracker.client
    runs = [r for r in client.search_runs(
                [tracker.experiment_id], filter_string=f"tags.`{TAGS['study']}` = '{study_name}'")
            if r.data.tags.get(TAGS["kind"]) == "study"]
    if not runs:
        return "no MLflow study run"
    run = tracker.parent_run_id = runs[0].info.run_id
    if only_missing and runs[0].data.metrics.get(BEST_VALUE) == best["objective"]["value"]:
        return ""
    metrics, tags = _declared(BestFile.model_validate(best))
    client.log_batch(run, metrics=metrics, tags=tags)
    tracker.log_verdict(rec)
    if tracker.failures:
        sys.exit(f"MLflow {uri}: {'; '.join(tracker.failures)}")
    # the trial run tagged best for the shape moves to the declared reading (not
    # tracker.mark_best: it would store best.json in the run's artifact folder, which is
    # the GPU machine's path, not here)
    new = best.get("mlflow_run_id")
    if new:
        old = runs[0].data.tags.get(TAGS["best_run"])
        if old and old != new:
            client.set_tag(old, BEST_TAG, "false")
            client.delete_tag(old, f"{BEST_TAG}_for_shape")
        client.set_tag(new, BEST_TAG, "true")
        client.set_tag(new, f"{BEST_TAG}_for_shape", best["shape"]["fingerprint"])
        client.set_tag(run, TAGS["best_run"], new)
    return f"MLflow study run {run[:8]} {'record filled in' if only_missing else 'updated'}"


def rejudge(results: Path, key: str) -> str:
    sd = results / f"study-{key}"
    best_p, summ_p = sd / "best.json", sd / "study.json"
    if not (best_p.exists() and summ_p.exists()):
        return f"study:{key}: not run yet (no best.json/study.json under {sd})"
    best_old, summary = json.loads(best_p.read_text()), json.loads(summ_p.read_text())
    db = results / "stores" / "autotune.db"
    study = optuna.load_study(study_name=summary["study"], storage=f"sqlite:///{db}")
    rec = verdict_record(judge_study(study))
    old = summary.get("verdict") or {}
    ml = results / "stores" / "mlflow.db"
    if _same(old, rec):
        note = (_mlflow(f"sqlite:///{ml}", study.study_name, best_old, rec, only_missing=True)
                if ml.exists() else "")
        return (f"study:{key}: unchanged ({old.get('verdict')}, {old.get('method')})"
                + (f"; {note}" if note else ""))
    study.set_user_attr(A.VERDICT, rec)
    declared = best_config(_ctx(study, best_old, summary, sd))
    if declared is None:
        sys.exit(f"study:{key}: no feasible trial in {db}")
    best = declared.to_json()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    run = summary.get("verdict_at_run") or old  # judged again before: the run's stays
    best["rejudged"] = {"by": f"experiments/h200-shapes/rejudge.py at {rev}",
                        "verdict_at_run": run.get("verdict"),
                        "ratio_at_run": run.get("ratio_to_defaults")}
    if not (sd / "best-at-run.json").exists():
        write_json_atomic(sd / "best-at-run.json", best_old)
    write_json_atomic(best_p, best)
    summary.setdefault("verdict_at_run", old)
    summary.update(verdict=rec, best_trial=best["trial"], best_value=best["objective"]["value"])
    write_json_atomic(summ_p, summary)
    (sd / "serve_command.sh").write_text(
        f"#!/bin/sh\n# best config of study {study.study_name} (trial {best['trial']}; "
        f"judged again by rejudge.py)\n{best['serve_command']}\n")
    note = _mlflow(f"sqlite:///{ml}", study.study_name, best, rec) if ml.exists() else ""

    def say(v: dict[str, Any]) -> str:
        r = v.get("ratio_to_defaults") or {}
        return (f"{v.get('verdict')} {r.get('median', 0):.3f}x "
                f"[{r.get('ci_low', 0):.3f}, {r.get('ci_high', 0):.3f}]")
    return f"study:{key}: {say(old)} -> {say(rec)}; {rec.get('reason')}. {note}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("keys", nargs="+", metavar="KEY", help="casestudy, azure, mooncake")
    ap.add_argument("--results", type=Path, default=H / "results")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for key in args.keys:
        print(rejudge(args.results, key))


if __name__ == "__main__":
    main()
