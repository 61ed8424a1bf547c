"""Search cost on the simulated surface: counted trials and server-seconds until a config
within 3 % of the best is measured at full resolution, for the study before issue 67 and
with its defaults (the interval pruner, screen-then-refine, the failure model, learning
from the store), for a retune that learns from a finished study of a neighbouring shape,
and with each of the four parts off in turn (the rule: README.md).

    nice -n 10 python experiments/search_cost/run.py --seeds 100 --budget 100 --workers 1

Each run is autotune's own loop (:class:`autotune.study.StudyLoop`) with a simulated
executor over experiments/sample_efficiency/surface.py (surface A, and B: the same with
MTP depth-2 acceptance 1.9, whose optimum is MTP 1). The surface models fidelity
(:func:`autotune.testing.fidelity_outcome`): a trial's full reading is the true value with
7 % log-normal noise (a server start's), its coarse reading that reading with 3 % more (a
run read to 3x the precision); the pruner and the screen judge the coarse reading, as a
real trial's segment rule does, and a trial they stop costs ``COARSE_COST`` of a full
trial's server-seconds. ``retune`` rows first run a study of A (the defaults, the same
seed), then studies of B with A's trials as priors of weight 0.5 (autotune.results'
warm-start copy, the weight learn_from_store gives a shape at the drift threshold) and the
failure model trained on them. Writes results.json and results.md beside this file
(atomically).
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

#: rows on the cold surface A, and the retunes on B (each of the four parts off in turn)
COLD_ROWS = ("before", "new", "new-no-screen", "new-no-pruner")
RETUNE_ROWS = ("retune", "retune-no-pruner", "retune-no-screen", "retune-no-failure-model",
               "retune-no-learn")
ROWS = COLD_ROWS + RETUNE_ROWS
#: server-seconds of a trial, in full trials: one measured to full resolution costs 1; one
#: stopped at its coarse reading (screened, or pruned) its start and warm-up (0.35 + 0.15)
#: and a ninth of the measurement (0.5 / 9: 3x the precision needs ~1/9 of the segments),
#: rounded up to 0.6; a failed start its start (0.35)
FULL_COST, COARSE_COST, FAILED_COST = 1.0, 0.6, 0.35
COARSE_NOISE = 0.03  # the coarse reading's own noise (sigma, log): 6 % half-width / 1.96
ACCEPT = {"A": dict(S.ACCEPT), "B": {**S.ACCEPT, 2: 1.9}}
BEST_CACHE = HERE / "best-cache.json"  # surface_best's figures by the grid's key
NEIGHBOUR_WEIGHT = 0.5  # learn_from_store's weight at shape distance 1 (the drift threshold)


@dataclass
class Run:
    row: str
    surface: str
    seed: int
    first_hit: int | None  # counted trials until a within-3 % config is measured in full
    incumbent_hit: int | None
    final_ratio: float
    n_failed: int
    n_rejected: int
    n_steered: int
    n_priors: int
    wall_s: float
    # the same in server-seconds (full trials' worth): COARSE_COST per screened or pruned
    first_hit_cost: float | None = None
    incumbent_hit_cost: float | None = None
    n_screened: int = 0
    n_pruned: int = 0
    cost: float = 0.0  # the whole study's


class _CostScore:
    """Counts a run's trials and their server-seconds as the study finishes them (a
    subscriber of the study). A hit is a full-resolution reading: a screened or pruned
    trial's coarse reading is never one, as the verdict never rests on it."""

    def __init__(self, best: float) -> None:
        self.best = best
        self.truth: dict[int, float | None] = {}
        self.counted = self.failed = self.rejected = self.screened = self.pruned = 0
        self.steered = 0
        self.cost = 0.0
        self.first_hit: int | None = None
        self.inc_hit: int | None = None
        self.first_cost: float | None = None
        self.inc_cost: float | None = None
        self.inc_obs, self.inc_true = -math.inf, 0.0

    def trial_end(self, record: Any) -> None:
        from autotune.store import State

        if record.rejected:
            self.rejected += 1
            return
        self.counted += 1
        true = self.truth.get(record.number)
        if record.state in (State.SCREENED, State.PRUNED):
            self.cost += COARSE_COST
            self.screened += record.state == State.SCREENED
            self.pruned += record.state == State.PRUNED
            return
        if true is None or record.value is None:
            self.cost += FAILED_COST
            self.failed += 1
            return
        self.cost += FULL_COST
        observed = float(record.value)
        if self.first_hit is None and true >= (1 - SE_RUN.TOL) * self.best:
            self.first_hit, self.first_cost = self.counted, self.cost
        if observed > self.inc_obs:
            self.inc_obs, self.inc_true = observed, true
        if self.inc_hit is None and self.inc_true >= (1 - SE_RUN.TOL) * self.best:
            self.inc_hit, self.inc_cost = self.counted, self.cost


def _study(surface: str, seed: int, budget: int, noise: float, best: float, *,
           parts: dict[str, bool], priors: list[Any] | None = None,
           learned_fm: list[Any] | None = None, storage: Any = None,
           name: str | None = None) -> tuple[_CostScore, Any]:
    """One study on ``surface`` with the parts of issue 67 in ``parts`` (pruner, screen,
    failure_model) on or off; returns (its score, the Optuna study)."""
    import numpy as np
    import optuna

    from autotune.events import StudyCallback, StudyCallbacks
    from autotune.space import load_space
    from autotune.store import A
    from autotune.study import StudyLoop, TrialTemplate, make_sampler
    from autotune.study._failmodel import FailureModel, label
    from autotune.testing import SimulatedExecutor, fidelity_outcome

    space = load_space(SE_RUN.SPACE, facts=SE_RUN._facts())
    measured = S.read_measured(SE / "measured.csv")
    surf = S.Surface(measured, ACCEPT[surface])
    # the noise stream: the same for every row at a seed (a source study has its own)
    rng = np.random.default_rng((10_000 if name is None else 20_000) + seed)
    score = _CostScore(best)

    def evaluate(params: dict[str, Any], spec: Any) -> Any:
        true, reason, _ = surf.value(params)
        draw, coarse_draw = float(rng.normal(0.0, noise)), float(rng.normal(0.0, COARSE_NOISE))
        score.truth[spec.number] = true
        if true is None:
            return str(reason)
        full = true * math.exp(draw)
        return fidelity_outcome(spec, full=full, coarse=full * math.exp(coarse_draw))

    class Subscriber(StudyCallback):
        def on_trial_end(self, event: Any, record: Any) -> None:
            score.trial_end(record)

    settings = SE_RUN._settings("default", seed, budget).model_copy(update={
        "pruner": "interval" if parts["pruner"] else "none", "screen": parts["screen"]})
    study = optuna.create_study(direction="maximize", sampler=make_sampler(settings),
                                storage=storage, study_name=name)
    study.enqueue_trial(space.baseline_params(), user_attrs={A.BASELINE: True})
    if priors:
        study.add_trials(priors)
    fm = None
    if parts["failure_model"]:
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


ALL_ON = {"pruner": True, "screen": True, "failure_model": True, "learn": True}


def row_parts(row: str) -> dict[str, bool]:
    """The parts of issue 67 a row runs with: ``before`` none, every other row all but the
    one its name turns off (``-no-<part>``)."""
    if row == "before":
        return dict.fromkeys(ALL_ON, False)
    off = row.partition("-no-")[2].replace("-", "_")
    if off and off not in ALL_ON:
        raise ValueError(f"row {row!r}: no part {off!r} (parts: {', '.join(ALL_ON)})")
    return {k: k != off for k in ALL_ON}


def _run(row: str, surface: str, seed: int, score: _CostScore, n_priors: int,
         t0: float) -> Run:
    return Run(row, surface, seed, score.first_hit, score.inc_hit,
               score.inc_true / score.best, score.failed, score.rejected, score.steered,
               n_priors, time.monotonic() - t0, score.first_cost, score.inc_cost,
               score.screened, score.pruned, round(score.cost, 2))


def one_job(group: str, seed: int, budget: int, noise: float, best: dict[str, float],
            rows: tuple[str, ...]) -> list[Run]:
    """``cold``: the cold rows on A; ``retune``: one study of A (every part on), then each
    retune row's study of B learning from it (priors of weight 0.5, unless learning is the
    part off; the failure model trained on A's trials, unless it is)."""
    import optuna

    from autotune.results._warm import _warm_start
    from autotune.space import load_space

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore")
    out: list[Run] = []
    if group == "cold":
        for row in rows:
            t0 = time.monotonic()
            score, _ = _study("A", seed, budget, noise, best["A"], parts=row_parts(row))
            out.append(_run(row, "A", seed, score, 0, t0))
        return out
    t_src = time.monotonic()
    storage = optuna.storages.InMemoryStorage()
    _, src = _study("A", seed, budget, noise, best["A"], parts=ALL_ON, storage=storage,
                    name="source")
    src_s = time.monotonic() - t_src
    source = src.get_trials(deepcopy=False)
    space = load_space(SE_RUN.SPACE, facts=SE_RUN._facts())
    all_priors = _warm_start("memory", "source", top_k=0, space=space, value_scale=1.0,
                             objective="throughput", st=storage,
                             weight=NEIGHBOUR_WEIGHT).prior_trials
    for row in rows:
        t0 = time.monotonic() - src_s
        parts = row_parts(row)
        priors = all_priors if parts["learn"] else []
        score, _ = _study("B", seed, budget, noise, best["B"], parts=parts, priors=priors,
                          learned_fm=source)
        out.append(_run(row, "B", seed, score, len(priors), t0))
    return out


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


def _jobs(seeds: int, rows: tuple[str, ...]) -> list[tuple[str, int, tuple[str, ...]]]:
    cold = tuple(r for r in rows if r in COLD_ROWS)
    retune = tuple(r for r in rows if r in RETUNE_ROWS)
    return [(g, s, rs) for s in range(seeds) for g, rs in (("cold", cold), ("retune", retune))
            if rs]


def _median_ci(xs: list[float | None]) -> tuple[float | None, float | None]:
    """The distribution-free 95 % interval of the median (order statistics, binomial):
    misses count as > budget (None where the interval reaches them)."""
    vals = sorted(math.inf if x is None else float(x) for x in xs)
    n = len(vals)
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half) - 1), min(n - 1, math.ceil(n / 2 + half) - 1)
    return tuple(None if math.isinf(v) else v for v in (vals[lo], vals[hi]))  # type: ignore[return-value]


def _stats(xs: list[Any], budget: float) -> dict[str, Any]:
    out = SE_RUN._stats(xs, budget)
    out["median_ci95"] = list(_median_ci(xs))
    return out


def _fmt(st: dict[str, Any]) -> str:
    def f(v: float | None) -> str:
        return f"> {st['budget']:g}" if v is None else f"{v:.3g}"

    lo, hi = st.get("median_ci95") or (None, None)
    return f"{f(st['median'])} [{f(st['q25'])}, {f(st['q75'])}] ({f(lo)}-{f(hi)})"


def _table(summary: dict[str, Any], budget: int) -> str:
    lines = ["| row | surface | first hit, counted trials: median [IQR] (95 % CI of the "
             "median) | reached | first hit, server-seconds in full trials | incumbent "
             "within 3 %, counted trials | screened / pruned / failed starts per run | "
             "steered away | priors |",
             "|---|---|---|---:|---|---|---|---:|---:|"]
    for key, s in summary.items():
        row, surf = key.split("@")
        lines.append(f"| {row} | {surf} | {_fmt(s['first_hit'])} | "
                     f"{s['first_hit']['hit_rate']:.0%} | {_fmt(s['first_hit_cost'])} | "
                     f"{_fmt(s['incumbent_hit'])} | {s['screened_mean']:.1f} / "
                     f"{s['pruned_mean']:.1f} / {s['failed_mean']:.1f} | "
                     f"{s['steered_mean']:.1f} | {s['priors_mean']:.0f} |")
    return "\n".join(lines)


def _summary(runs: list[Run], budget: int) -> dict[str, Any]:
    import numpy as np

    summary: dict[str, Any] = {}
    for key in dict.fromkeys(f"{r.row}@{r.surface}" for r in runs):
        rs = [r for r in runs if f"{r.row}@{r.surface}" == key]
        summary[key] = {
            "first_hit": _stats([r.first_hit for r in rs], budget),
            "first_hit_cost": _stats([r.first_hit_cost for r in rs], budget),
            "incumbent_hit": _stats([r.incumbent_hit for r in rs], budget),
            "incumbent_hit_cost": _stats([r.incumbent_hit_cost for r in rs], budget),
            "final_ratio_median": float(np.median([r.final_ratio for r in rs])),
            "failed_mean": float(np.mean([r.n_failed for r in rs])),
            "screened_mean": float(np.mean([r.n_screened for r in rs])),
            "pruned_mean": float(np.mean([r.n_pruned for r in rs])),
            "cost_mean": float(np.mean([r.cost for r in rs])),
            "steered_mean": float(np.mean([r.n_steered for r in rs])),
            "priors_mean": float(np.mean([r.n_priors for r in rs])), "seeds": len(rs)}
    return summary


def _write(args: Any, rows: tuple[str, ...], best: dict[str, float],
           best_source: dict[str, str], runs: list[Run], t0: float) -> dict[str, Any]:
    """results.json and results.md of the runs so far (atomically): a long run that is
    stopped keeps the seeds it finished (``seeds_done``)."""
    import numpy as np
    import optuna

    summary = _summary(runs, args.budget)
    done = min((v["seeds"] for v in summary.values()), default=0)
    command = "python experiments/search_cost/run.py " + " ".join(sys.argv[1:])
    result = {"command": command, "created": datetime.now(UTC).isoformat(timespec="seconds"),
              "settings": {"seeds": args.seeds, "seeds_done": done, "budget": args.budget,
                           "noise": args.noise, "coarse_noise": COARSE_NOISE, "costs": {
                               "full": FULL_COST, "coarse": COARSE_COST,
                               "failed_start": FAILED_COST},
                           "neighbour_weight": NEIGHBOUR_WEIGHT, "best": best,
                           "best_source": best_source, "rows": list(rows)},
              "versions": {"python": platform.python_version(), "optuna": optuna.__version__,
                           "numpy": np.__version__,
                           "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)"},
              "wall_s": round(time.monotonic() - t0, 1),
              "summary": summary, "runs": [asdict(r) for r in runs]}
    args.out.mkdir(parents=True, exist_ok=True)
    for path, text in ((args.out / "results.json", json.dumps(result, indent=1) + "\n"),
                       (args.out / "results.md", f"`{command}` ({done} of {args.seeds} "
                        "seeds done)\n\n" + _table(summary, args.budget) + "\n")):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=100, help="seeds per row")
    ap.add_argument("--budget", type=int, default=100, help="counted trials per study")
    ap.add_argument("--noise", type=float, default=0.07, help="sigma of the log-normal noise")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE, help="folder for results.json/.md")
    args = ap.parse_args()
    rows = tuple(r for r in args.rows.split(",") if r)
    for r in rows:
        if r not in ROWS:
            ap.error(f"--rows: no row {r!r}; rows: {', '.join(ROWS)}")
    measured = S.read_measured(SE / "measured.csv")
    best, best_source = {}, {}
    for name, accept in ACCEPT.items():
        best[name], best_source[name] = surface_best(accept, measured)
    print(f"best cells: A {best['A']:,.0f} ({best_source['A']}), B {best['B']:,.0f} "
          f"({best_source['B']})", flush=True)
    runs: list[Run] = []
    t0 = time.monotonic()
    jobs = _jobs(args.seeds, rows)
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futs = [pool.submit(one_job, g, seed, args.budget, args.noise, best, rs)
                for g, seed, rs in jobs]
        for i, f in enumerate(futs):
            for r in f.result():
                runs.append(r)
                print(f"{r.row:>24} {r.surface} seed {r.seed:3d}: first hit {r.first_hit} "
                      f"({r.first_hit_cost}), incumbent {r.incumbent_hit}, screened "
                      f"{r.n_screened}, pruned {r.n_pruned}, failed {r.n_failed}, steered "
                      f"{r.n_steered}, priors {r.n_priors}, {r.wall_s:.0f} s", flush=True)
            if i % 2 == 1 or i == len(futs) - 1:  # results so far, after each seed
                summary = _write(args, rows, best, best_source, runs, t0)
    print(_table(summary, args.budget))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
