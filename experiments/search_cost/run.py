"""Search cost on the simulated surface: counted trials until a config within 3 % of the
best is measured, for the study before and with its new defaults, and for a retune that
learns from a finished study of a neighbouring shape (the rule: README.md).

    nice -n 10 python experiments/search_cost/run.py --seeds 30 --budget 100

Each run is autotune's own loop (:class:`autotune.study.StudyLoop`) with a simulated
executor over experiments/sample_efficiency/surface.py (surface A, and B: the same with
MTP depth-2 acceptance 1.9, whose optimum is MTP 1). ``retune`` rows first run a study of
A (the new defaults, the same seed), then a study of B with A's trials as priors of weight
0.5 (autotune.results' warm-start copy, the weight learn_from_store gives a shape at the
drift threshold) and the failure model trained on them. Writes results.json and
results.md beside this file (atomically).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SE = REPO / "experiments" / "sample_efficiency"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(SE))


def _load_se() -> Any:
    """experiments/sample_efficiency/run.py, whose study set-up, scoring and grid summary
    this benchmark shares (loaded under its own name: both scripts are run.py)."""
    spec = importlib.util.spec_from_file_location("sample_efficiency_run", SE / "run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


SE_RUN = _load_se()
import surface as S  # noqa: E402 - after sys.path

ROWS = ("before", "new", "retune", "retune-no-learn", "retune-no-failure-model")
ACCEPT = {"A": dict(S.ACCEPT), "B": {**S.ACCEPT, 2: 1.9}}
BEST_CACHE = HERE / "best-cache.json"  # surface_best's figures by the grid's key
NEIGHBOUR_WEIGHT = 0.5  # learn_from_store's weight at shape distance 1 (the drift threshold)


@dataclass
class Run:
    row: str
    surface: str
    seed: int
    first_hit: int | None
    incumbent_hit: int | None
    final_ratio: float
    n_failed: int
    n_rejected: int
    n_steered: int
    n_priors: int
    wall_s: float


def _study(surface: str, seed: int, budget: int, noise: float, best: float, *,
           failure_model: bool, priors: list[Any] | None = None,
           learned_fm: list[Any] | None = None, storage: Any = None,
           name: str | None = None) -> tuple[Any, Any]:
    """One study on ``surface``; returns (its score, the Optuna study)."""
    import numpy as np
    import optuna

    from autotune.events import StudyCallback, StudyCallbacks
    from autotune.space import load_space
    from autotune.store import A
    from autotune.study import StudyLoop, TrialTemplate, make_sampler
    from autotune.study._failmodel import FailureModel, label
    from autotune.testing import SimulatedExecutor

    space = load_space(SE_RUN.SPACE, facts=SE_RUN._facts())
    measured = S.read_measured(SE / "measured.csv")
    surf = S.Surface(measured, ACCEPT[surface])
    # the noise stream: the same for every row at a seed (a source study has its own)
    rng = np.random.default_rng((10_000 if name is None else 20_000) + seed)
    score = SE_RUN._Score(best)

    def evaluate(params: dict[str, Any], spec: Any) -> dict[str, float] | str:
        true, reason, _ = surf.value(params)
        draw = float(rng.normal(0.0, noise))
        score.truth[spec.number] = true
        if true is None:
            return str(reason)
        return {"output_tokens_per_s": true * math.exp(draw)}

    class Subscriber(StudyCallback):
        def on_trial_end(self, event: Any, record: Any) -> None:
            score.trial_end(record)

    settings = SE_RUN._settings("default", seed, budget)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(settings),
                                storage=storage, study_name=name)
    study.enqueue_trial(space.baseline_params(), user_attrs={A.BASELINE: True})
    if priors:
        study.add_trials(priors)
    fm = None
    if failure_model:
        fm = FailureModel(space=space)
        for t in learned_fm or []:
            usable, reason = label(t)
            if usable:
                fm.add(t.params, reason)
    sim = SimulatedExecutor(evaluate)
    StudyLoop(study=study, settings=settings, space=space, executor=sim,
              template=TrialTemplate(model="m", shape=None), failure_model=fm,
              callbacks=StudyCallbacks([sim, Subscriber()])).run()
    score.steered = sum(fm.steered.values()) if fm is not None else 0
    return score, study


def one_run(row: str, surface: str, seed: int, budget: int, noise: float,
            best: dict[str, float]) -> Run:
    import optuna

    from autotune.results._warm import _warm_start
    from autotune.space import load_space

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore")
    t0 = time.monotonic()
    priors: list[Any] = []
    source: list[Any] = []
    if row.startswith("retune"):
        storage = optuna.storages.InMemoryStorage()
        _, src = _study("A", seed, budget, noise, best["A"], failure_model=True,
                        storage=storage, name="source")
        source = src.get_trials(deepcopy=False)
        if row != "retune-no-learn":
            space = load_space(SE_RUN.SPACE, facts=SE_RUN._facts())
            priors = _warm_start("memory", "source", top_k=0, space=space, value_scale=1.0,
                                 objective="throughput", st=storage,
                                 weight=NEIGHBOUR_WEIGHT).prior_trials
    score, _ = _study(surface, seed, budget, noise, best[surface],
                      failure_model=row != "before" and row != "retune-no-failure-model",
                      priors=priors,
                      learned_fm=source if row in ("retune", "retune-no-learn") else [])
    return Run(row, surface, seed, score.first_hit, score.inc_hit, score.inc_true / best[surface],
               score.failed, score.rejected, score.steered, len(priors), time.monotonic() - t0)


def surface_best(accept: dict[int, float], measured: list[Any]) -> tuple[float, str]:
    """The best cell's value: from the sample-efficiency grid cache when it holds this
    surface, else over the grid of the 14 knobs the model values (surface.KNOBS; every
    other knob at its default, where it cannot change a cell's value): seconds, not the
    full grid's 13 minutes."""
    surf = S.Surface(measured, accept)
    key = SE_RUN._grid_key(measured, accept)
    cache = json.loads(SE_RUN.GRID_CACHE.read_text()) if SE_RUN.GRID_CACHE.exists() else {}
    if key in cache:
        return float(cache[key]["best_value"]), "the full grid (grid-cache.json)"
    known = json.loads(BEST_CACHE.read_text()) if BEST_CACHE.exists() else {}
    source = "the grid of surface.KNOBS, other knobs at their defaults"
    if key in known:
        return float(known[key]), source
    from autotune.space import load_space

    space = load_space(SE_RUN.SPACE, facts=SE_RUN._facts())
    names = list(space.knobs)

    def values(k: Any) -> list[Any]:
        if k.name not in S.KNOBS:
            return [k.default]
        if k.type == "bool":
            return [False, True]
        if k.type == "categorical":
            return list(k.choices)
        return list(range(int(k.low), int(k.high) + 1))

    def cells(i: int, params: dict[str, Any]) -> Any:
        if i == len(names):
            if not space.violations(params):
                yield dict(params)
            return
        if not space.is_active(names[i], params):
            yield from cells(i + 1, params)
            return
        for v in values(space.knobs[names[i]]):
            params[names[i]] = v
            yield from cells(i + 1, params)
            del params[names[i]]

    best = max((surf.value(c)[0] or 0.0) for c in cells(0, {}))
    known[key] = best
    tmp = BEST_CACHE.with_name(f".{BEST_CACHE.name}.tmp")
    tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, BEST_CACHE)
    return best, source


def _jobs(seeds: int) -> list[tuple[str, str, int]]:
    out = []
    for s in range(seeds):
        for row in ("before", "new"):
            out += [(row, "A", s), (row, "B", s)]
        out += [(row, "B", s) for row in ROWS[2:]]
    return out


def _table(summary: dict[str, Any], budget: int) -> str:
    lines = ["| row | surface | first hit: median [IQR] | reached | incumbent: median [IQR] | "
             "reached | failed starts | steered away | priors |",
             "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for key, s in summary.items():
        row, surf = key.split("@")
        lines.append(f"| {row} | {surf} | {SE_RUN._fmt(s['first_hit'])} | "
                     f"{s['first_hit']['hit_rate']:.0%} | {SE_RUN._fmt(s['incumbent_hit'])} | "
                     f"{s['incumbent_hit']['hit_rate']:.0%} | {s['failed_mean']:.1f} | "
                     f"{s['steered_mean']:.1f} | {s['priors_mean']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30, help="seeds per row")
    ap.add_argument("--budget", type=int, default=100, help="counted trials per study")
    ap.add_argument("--noise", type=float, default=0.07, help="sigma of the log-normal noise")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=HERE, help="folder for results.json/.md")
    args = ap.parse_args()
    measured = S.read_measured(SE / "measured.csv")
    best, best_source = {}, {}
    for name, accept in ACCEPT.items():
        best[name], best_source[name] = surface_best(accept, measured)
    print(f"best cells: A {best['A']:,.0f} ({best_source['A']}), B {best['B']:,.0f} "
          f"({best_source['B']})", flush=True)
    runs: list[Run] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futs = [pool.submit(one_run, r, s, seed, args.budget, args.noise, best)
                for r, s, seed in _jobs(args.seeds)]
        for f in futs:
            r = f.result()
            runs.append(r)
            print(f"{r.row:>24} {r.surface} seed {r.seed:3d}: first hit {r.first_hit}, "
                  f"incumbent {r.incumbent_hit}, failed {r.n_failed}, steered {r.n_steered}, "
                  f"priors {r.n_priors}, {r.wall_s:.0f} s", flush=True)
    summary: dict[str, Any] = {}
    for key in dict.fromkeys(f"{r.row}@{r.surface}" for r in runs):
        rs = [r for r in runs if f"{r.row}@{r.surface}" == key]
        summary[key] = {
            "first_hit": SE_RUN._stats([r.first_hit for r in rs], args.budget),
            "incumbent_hit": SE_RUN._stats([r.incumbent_hit for r in rs], args.budget),
            "final_ratio_median": float(np.median([r.final_ratio for r in rs])),
            "failed_mean": float(np.mean([r.n_failed for r in rs])),
            "steered_mean": float(np.mean([r.n_steered for r in rs])),
            "priors_mean": float(np.mean([r.n_priors for r in rs])), "seeds": len(rs)}
    import optuna

    command = "python experiments/search_cost/run.py " + " ".join(sys.argv[1:])
    result = {"command": command, "created": datetime.now(UTC).isoformat(timespec="seconds"),
              "settings": {"seeds": args.seeds, "budget": args.budget, "noise": args.noise,
                           "neighbour_weight": NEIGHBOUR_WEIGHT, "best": best,
                           "best_source": best_source},
              "versions": {"python": platform.python_version(), "optuna": optuna.__version__,
                           "numpy": np.__version__,
                           "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)"},
              "summary": summary, "runs": [asdict(r) for r in runs]}
    args.out.mkdir(parents=True, exist_ok=True)
    for path, text in ((args.out / "results.json", json.dumps(result, indent=1) + "\n"),
                       (args.out / "results.md", f"`{command}`\n\n"
                        + _table(summary, args.budget) + "\n")):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    print(_table(summary, args.budget))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
