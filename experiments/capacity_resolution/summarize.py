"""Each trial's wall time and capacity bracket from a study's trials.csv, for
experiments/capacity_resolution (run.sh calls it).

    python summarize.py TRIALS_CSV DEST --study-s S --load LOADFILE --trace T --commit C

writes DEST/trials.csv (one row a trial: wall_s, start_s, warmup_s, levels_s, levels,
capacity_rps, ci_low_rps, ci_high_rps, width, closed) and DEST/summary.json (the study:
trials, the median and largest wall time and width, whether every bracket closed within
1.25x, the load average while it ran), and prints them.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

#: the goal (README.md): every trial at most 5 minutes, its bracket at most 1.25x wide
GOAL_WALL_S, GOAL_WIDTH = 300.0, 1.25


def _f(row: dict[str, str], key: str) -> float | None:
    v = row.get(key) or ""
    return float(v) if v not in ("", "None", "nan") else None


def trial_rows(path: Path) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for r in csv.DictReader(path.open()):
        low, high = _f(r, "metric.capacity_rps_ci_low"), _f(r, "metric.capacity_rps_ci_high")
        width = high / low if low and high else None
        params = {k[6:]: v for k, v in r.items() if k.startswith("param.") and v}
        out.append({
            "number": int(r["number"]), "state": r["state"], "baseline": r["baseline"] == "True",
            "params": json.dumps(params, sort_keys=True),
            "wall_s": _f(r, "wall_s"), "start_s": _f(r, "start_s"),
            "warmup_s": _f(r, "metric.warmup_s"), "levels_s": _f(r, "metric.measure_s"),
            "levels": int(_f(r, "metric.capacity_levels") or 0),
            "capacity_rps": _f(r, "metric.capacity_rps"), "ci_low_rps": low,
            "ci_high_rps": high, "width": None if width is None else round(width, 4),
            "closed": width is not None and width <= GOAL_WIDTH + 1e-9,
        })
    return out


def summary(rows: list[dict[str, object]], *, study_s: float, load: list[float],
            trace: str, commit: str, exit_code: int) -> dict[str, object]:
    ours = [r for r in rows if r["state"] in ("ok", "infeasible")]
    walls = [float(r["wall_s"]) for r in ours if r["wall_s"] is not None]  # type: ignore[arg-type]
    widths = [float(r["width"]) for r in ours if r["width"] is not None]  # type: ignore[arg-type]
    return {
        "trace": trace, "commit": commit, "exit_code": exit_code, "study_s": study_s,
        "trials": len(ours), "closed_within_1.25": sum(bool(r["closed"]) for r in ours),
        "wall_s_median": statistics.median(walls) if walls else None,
        "wall_s_max": max(walls) if walls else None,
        "width_median": statistics.median(widths) if widths else None,
        "width_max": max(widths) if widths else None,
        "capacities_rps": [r["capacity_rps"] for r in ours],
        "goal_met": bool(ours) and all(r["closed"] for r in ours)
        and all(w <= GOAL_WALL_S for w in walls),
        "load_1min_median": statistics.median(load) if load else None,
        "load_1min_max": max(load) if load else None,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trials_csv", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--study-s", type=float, required=True)
    p.add_argument("--load", type=Path, required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--exit-code", type=int, default=0)
    a = p.parse_args(argv)
    rows = trial_rows(a.trials_csv)
    load = [float(x) for x in a.load.read_text().split()] if a.load.exists() else []
    s = summary(rows, study_s=a.study_s, load=load, trace=a.trace, commit=a.commit,
                exit_code=a.exit_code)
    a.dest.mkdir(parents=True, exist_ok=True)
    with (a.dest / "trials.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["number"])
        w.writeheader()
        w.writerows(rows)
    (a.dest / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    for r in rows:
        print(f"trial {r['number']}: {r['wall_s']} s (start {r['start_s']}, warm-up "
              f"{r['warmup_s']}, levels {r['levels_s']}), {r['levels']} levels, bracket "
              f"[{r['ci_low_rps']}, {r['ci_high_rps']}] req/s, width {r['width']}")
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
