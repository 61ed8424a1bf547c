"""Every figure of experiments/README.md (the results page), computed from the committed
raw data: the studies' trials.csv and study.json, the benches' JSON, the cross cells.

    .venv/bin/python experiments/results.py            # all rows
    .venv/bin/python experiments/results.py q1-azure   # rows whose id starts with that

Each row is `id: text`. Ratios are autotune's own (autotune.measure.ratio_to_defaults: delta
method on log readings, between-start variance pooled, 95 %). A study's verdict is judged
again here with the rule autotune applies today (autotune.store.judge_study): when every
config was re-checked all its starts count; otherwise the fresh starts give the estimate
and the spread is pooled over every start; a capacity's interval is widened by its
brackets. Where the rule in force at the run gave another answer, both are printed.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

from autotune.measure import Interval, ratio_to_defaults

H = Path(__file__).resolve().parent
TRUST, SHAPES = H / "h200-trust", H / "h200-shapes"


def study(folder: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    """(defaults' search, defaults' fresh, candidate's search, candidate's fresh) readings
    of a two-config study; the candidate is the config its study.json judged."""
    rows = [r for r in csv.DictReader((folder / "trials.csv").open()) if r["state"] == "ok"]
    verdict = json.loads((folder / "study.json").read_text()).get("verdict") or {}
    cand = verdict.get("candidate_number")
    flags = next(r["flags"] for r in rows if int(r["number"]) == cand)
    base = [float(r["value"]) for r in rows if r["baseline"] == "True"]
    conf = [float(r["value"]) for r in rows if r["flags"] == flags and r["baseline"] != "True"]
    return base[:1], base[1:], conf[:1], conf[1:]


def others(folder: Path, exclude: set[str]) -> list[list[float]]:
    """Readings of the study's other configs (the spread is pooled over them too)."""
    groups: dict[str, list[float]] = {}
    for r in csv.DictReader((folder / "trials.csv").open()):
        if r["state"] == "ok" and r["flags"] not in exclude and r["baseline"] != "True":
            groups.setdefault(r["flags"], []).append(float(r["value"]))
    return list(groups.values())


def fmt_ratio(r: Any) -> str:
    return f"{r.median:.3f}x [{r.ci_low:.3f}, {r.ci_high:.3f}] (df {r.df})"


def brackets(folder: Path, values: list[float]) -> list[Interval] | None:
    """A capacity study's bracket of each reading, per GPU as its value (None for another
    objective): the verdict's interval is never narrower than they resolve."""
    rows = {float(r["value"]): r for r in csv.DictReader((folder / "trials.csv").open())
            if r["state"] == "ok" and r.get("metric.capacity_rps")}
    if not rows:
        return None
    out = []
    for v in values:
        r = rows[v]
        per = v / float(r["metric.capacity_rps"])  # the value is per GPU, metrics per server
        hi = r.get("metric.capacity_rps_ci_high")
        out.append(Interval(v, float(r["metric.capacity_rps_ci_low"]) * per,
                            float(hi) * per if hi else math.inf))
    return out


def judge(folder: Path) -> tuple[Any, str, int, int]:
    """Today's rule on a committed study: (ratio, verdict, starts of candidate, of defaults)."""
    ds, df_, cs, cf = study(folder)
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    cand_flags = {r["flags"] for r in rows if r["state"] == "ok" and r["baseline"] != "True"
                  and float(r["value"]) in cs + cf}
    rest = others(folder, cand_flags)
    c, d = (cs + cf, ds + df_) if df_ and cf and not rest else (cf or cs, df_ or ds)
    cb, db = brackets(folder, c), brackets(folder, d)
    br = {"config": cb, "defaults": db} if cb is not None and db is not None else None
    if df_ and cf and not rest:  # every config re-checked: all starts count
        r = ratio_to_defaults(c, d, brackets=br)
    else:
        r = ratio_to_defaults(c, d, spread=[cs + cf, ds + df_, *rest], brackets=br)
    n_c, n_d = len(c), len(d)
    verdict = "WINNER" if r.ci_low > 1 else "defaults remain best"
    return r, verdict, n_c, n_d


def bench(path: Path) -> float:
    return float(json.loads(path.read_text())["measurement"]["output_tokens_per_s"])


def repeats(path: Path) -> list[float]:
    return [float(x) for x in json.loads(path.read_text())["measurement"]["repeat_tokens_per_s"]]


def cell(path: Path, capacity: bool) -> float:
    m = json.loads(path.read_text())["metrics"]
    return float(m["capacity_rps"] if capacity else m["output_tokens_per_s"])


def spread_pct(xs: list[float]) -> str:
    return f"{(max(xs) / min(xs) - 1) * 100:.1f} %"


def settings(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "study.json").read_text())["settings"])


def q1_rows() -> list[tuple[str, str]]:
    out = []
    for key, name in (("c32-uniform", "results-c32-uniform"), ("c32-half", "results-c32-half"),
                      ("c32-12min", "results-c32-12min"), ("c256-a", "results-c256-12min"),
                      ("c256-b", "results-c256-12min-b")):
        f = TRUST / name
        r, v, n_c, n_d = judge(f)
        s = settings(f)
        ds, df_, cs, cf = study(f)
        out.append((f"q1-{key}", f"recipe vs defaults, {s['concurrency']} streams: {v}, "
                    f"{fmt_ratio(r)}; starts {n_c} / {n_d}; readings recipe "
                    f"{', '.join(f'{x:,.1f}' for x in cs + cf)}, defaults "
                    f"{', '.join(f'{x:,.1f}' for x in ds + df_)} out tok/s; "
                    f"--precision {s['precision']}"))
    # every 32-stream start of both configs, three studies on three machines: a summary
    c32 = [study(TRUST / n) for n in ("results-c32-uniform", "results-c32-half",
                                      "results-c32-12min")]
    rec = [x for s in c32 for x in s[2] + s[3]]
    dft = [x for s in c32 for x in s[0] + s[1]]
    per = [[*s[2], *s[3]] for s in c32] + [[*s[0], *s[1]] for s in c32]
    pooled = ratio_to_defaults(rec, dft, spread=per)
    out.append(("q1-c32-all", f"recipe vs defaults, 32 streams, all {len(rec)} / {len(dft)} "
                f"starts of the three studies (spread pooled within each study; a summary, "
                f"not a verdict): {fmt_ratio(pooled)}"))
    # the 256-stream re-measures on fresh servers (autotune bench)
    b = TRUST / "results-c256-12min-b"
    a = TRUST / "results-c256-12min"
    ra = bench(a / "bench-candidate-gpu0.json") / bench(a / "bench-defaults-gpu0.json")
    rb = bench(b / "bench-candidate-gpu0.json") / bench(b / "bench-defaults-gpu0.json")
    out.append(("q1-c256-remeasure", f"recipe / defaults on fresh servers after each 256-stream "
                f"study: {ra:.3f}x (c256-a), {rb:.3f}x (c256-b)"))
    # the recipe at 256 streams, every comparison with uniform routing
    cross = SHAPES / "results" / "cross-casestudy"
    cc = cell(cross / "recipe.json", False) / cell(cross / "defaults.json", False)
    prune = [float(r["value"]) for r in csv.DictReader((TRUST / "results-prune256" /
                                                        "trials.csv").open())]
    ratios = [judge(TRUST / "results-c256-12min")[0].median,
              judge(TRUST / "results-c256-12min-b")[0].median, ra, rb, cc,
              prune[1] / prune[0]]
    out.append(("q1-recipe-256", f"the recipe at 256 streams, six comparisons: "
                f"{', '.join(f'{x:.3f}x' for x in ratios)} (two studies, their two "
                f"re-measures, the cross cell, the pruned trial's within-run figure): "
                f"from {min(ratios):.2f}x to {max(ratios):.2f}x"))
    # cudagraph_cover_prefill at 256 streams (h200-shapes' casestudy study)
    f = SHAPES / "results" / "study-casestudy"
    r, v, n_c, n_d = judge(f)
    ds, df_, cs, cf = study(f)
    win_cell = cell(cross / "win-casestudy.json", False)
    def_cell = cell(cross / "defaults.json", False)
    three = ratio_to_defaults(cs + cf + [win_cell], ds + df_ + [def_cell])
    out.append(("q1-cudagraph-256", f"cudagraph_cover_prefill vs defaults, 256 streams: {v}, "
                f"{fmt_ratio(r)}; starts {n_c} / {n_d}; with the cross cells (3 starts each): "
                f"{fmt_ratio(three)}; the defaults' two study starts "
                f"{spread_pct(ds + df_)} apart"))
    # capacity studies
    for key in ("azure", "mooncake"):
        f = SHAPES / "results" / f"study-{key}"
        r, v, n_c, n_d = judge(f)
        out.append((f"q1-{key}", f"{key} capacity, recipe vs defaults: {v}, {fmt_ratio(r)}; "
                    f"starts {n_c} / {n_d}"))
    ds, df_, cs, cf = study(SHAPES / "results" / "study-azure")
    at_run = ratio_to_defaults(cf, df_)
    out.append(("q1-azure-at-run", f"azure under the rule in force when it ran (the fresh "
                f"starts alone): {'WINNER' if at_run.ci_low > 1 else 'defaults remain best'}, "
                f"{fmt_ratio(at_run)}"))
    return out


def spread_rows() -> list[tuple[str, str]]:
    """The defaults' start-to-start and repeat spread at 256 streams (item a)."""
    ds, df_, _, _ = study(SHAPES / "results" / "study-casestudy")
    b = TRUST / "results-c256-12min-b"
    servers = [repeats(b / n) for n in ("bench-defaults-gpu0.json", "bench-defaults-2-gpu0.json",
                                        "bench-defaults-3-gpu0.json")]
    a = study(TRUST / "results-c256-12min")
    bb = study(TRUST / "results-c256-12min-b")
    j = repeats(TRUST / "results-c256-jitter" / "bench-defaults-2-gpu0.json")
    cv = (sum((x - sum(j) / len(j)) ** 2 for x in j) / (len(j) - 1)) ** 0.5 / (sum(j) / len(j))
    return [
        ("a-defaults-256", f"the defaults' starts at 256 streams: {spread_pct(ds + df_)} apart "
         f"(casestudy study), {spread_pct(a[0] + a[1])} (c256-a), "
         f"{spread_pct(bb[0] + bb[1])} (c256-b); repeats on one server without the output "
         f"jitter {', '.join(spread_pct(s) for s in servers)}; with --output-jitter 0.1 "
         f"{spread_pct(j)} (CV {cv * 100:.1f} %, one server, 3 repeats)"),
    ]


def pruner_rows() -> list[tuple[str, str]]:
    rows = list(csv.DictReader((TRUST / "results-prune256" / "trials.csv").open()))
    full, cut = (float(rows[i]["metric.measure_s"]) for i in (0, 1))
    wall_full, wall_cut = (float(rows[i]["wall_s"]) for i in (0, 1))
    return [("q2-pruner-256", f"the recipe pruned at 256 streams after {cut:.0f} s of measuring "
             f"against the full trial's {full:.0f} s: {full - cut:.0f} s saved "
             f"({(full - cut) / full * 100:.0f} % of a trial's measuring; trial wall "
             f"{wall_cut:.0f} s against {wall_full:.0f} s)")]


def kernels_rows() -> list[tuple[str, str]]:
    out = []
    for r in csv.DictReader((H / "h200-kernels" / "results-e2e" / "e2e.csv").open()):
        out.append((f"q3-{r['streams']}-{r['base']}", f"tuned / default MoE tiles, {r['streams']} "
                    f"streams, {r['base']}: {float(r['ratio']):.3f}x [{float(r['ci_low']):.3f}, "
                    f"{float(r['ci_high']):.3f}]"))
    return out


def capacity_rows() -> list[tuple[str, str]]:
    """Every start of each config on each open-loop shape: the studies and the cross cells."""
    out = []
    for key in ("azure", "mooncake"):
        ds, df_, cs, cf = study(SHAPES / "results" / f"study-{key}")
        cross = SHAPES / "results" / f"cross-{key}"
        d_all = ds + df_ + [cell(cross / "defaults.json", True)]
        r_all = cs + cf + [cell(cross / "recipe.json", True)]
        win_cs = cell(cross / "win-casestudy.json", True)
        gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
        rec = ratio_to_defaults(r_all, d_all)
        wcs = ratio_to_defaults([win_cs], d_all)
        out.append((f"q4-{key}", f"{key} capacity (req/s within the SLOs), every start: "
                    f"defaults {', '.join(f'{x:.2f}' for x in d_all)} (geometric mean "
                    f"{gm(d_all):.2f}); recipe {', '.join(f'{x:.2f}' for x in r_all)} "
                    f"({gm(r_all):.2f}), {fmt_ratio(rec)}; the casestudy winner's one cell "
                    f"{win_cs:.2f}, {fmt_ratio(wcs)}"))
    sup = SHAPES / "superseded"
    d_old = [float(r["value"]) for r in csv.DictReader((sup / "study-mooncake-20s-levels" /
                                                        "trials.csv").open()) if r["value"]]
    old_d = cell(sup / "cross-mooncake-20s-levels" / "defaults.json", True)
    old_r = cell(sup / "cross-mooncake-20s-levels" / "recipe.json", True)
    new = SHAPES / "results" / "cross-mooncake"
    new_r = cell(new / "recipe.json", True) / cell(new / "defaults.json", True)
    out.append(("e-mooncake-set-aside", f"the set-aside mooncake run (20-s levels): defaults "
                f"{', '.join(f'{x:.2f}' for x in [*d_old, old_d])}, recipe cell {old_r:.2f}: its "
                f"cells' recipe / defaults {old_r / old_d:.3f}x, against {new_r:.3f}x in the "
                f"kept cells"))
    return out


def all_rows() -> list[tuple[str, str]]:
    return q1_rows() + spread_rows() + pruner_rows() + kernels_rows() + capacity_rows()


def main(argv: list[str]) -> int:
    for key, text in all_rows():
        if not argv or any(key.startswith(a) for a in argv):
            print(f"{key}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
