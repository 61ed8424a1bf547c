"""The per-run table and the verdict of README.md's rule, from results/run-*.json."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT_S = 300.0  # the bracket closes within the tolerance (1.25x) when status is found


def main() -> int:
    rows = []
    for path in sorted((HERE / "results").glob("run-*.json")):
        r = json.loads(path.read_text())
        trial = (r.get("start_s") or 0.0) + (r.get("warmup", {}) or {}).get("seconds", 0.0) \
            + (r.get("measure_s") or 0.0)
        cap = r.get("capacity") or {}
        levels = cap.get("levels", [])
        low, high = cap.get("low"), cap.get("high")
        ok = cap.get("status") == "found" and trial <= LIMIT_S
        rows.append((path.stem, trial, r.get("command_wall_s"), low, high, cap.get("status"),
                     len(levels), [round(lv["seconds"] + lv.get("warmup_s", 0.0), 1)
                                   for lv in levels], ok))
        print(f"{path.stem}: trial {trial:.0f} s (start {r.get('start_s') or 0:.0f}, warm-up "
              f"{(r.get('warmup') or {}).get('seconds', 0):.0f}, levels "
              f"{r.get('measure_s') or 0:.0f}); command {r.get('command_wall_s')} s; bracket "
              f"[{low}, {high}] x the recorded rate, {cap.get('status')}; {len(levels)} "
              f"levels, seconds (window + warm-up) {rows[-1][7]}; "
              f"{'pass' if ok else 'FAIL'}")
    if not rows:
        print("no results", file=sys.stderr)
        return 1
    times = [r[1] for r in rows]
    print(f"trial time median {statistics.median(times):.0f} s, range {min(times):.0f}-"
          f"{max(times):.0f} s over {len(rows)} runs; rule "
          f"{'PASSED' if all(r[8] for r in rows) else 'FAILED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
