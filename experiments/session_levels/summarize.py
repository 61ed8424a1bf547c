"""The per-run table and the verdict of README.md's rule, from results/run-*.json (what
``autotune bench --capacity --json`` printed, and the command's wall time)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT_S = 300.0  # the bracket closes within the tolerance (1.25x) when the stop is found


def main() -> int:
    times: list[float] = []
    passed: list[bool] = []
    for path in sorted((HERE / "results").glob("run-*.json")):
        r = json.loads(path.read_text())
        m = r.get("metrics") or {}
        warm = (r.get("warmup") or {}).get("seconds", 0.0)
        trial = (r.get("start_s") or 0.0) + warm + (r.get("measure_s") or 0.0)
        low, high = m.get("capacity_rps"), m.get("capacity_rps_ci_high")
        width = high / low if low and high else None
        ok = r.get("stop") == "capacity_found" and trial <= LIMIT_S
        times.append(trial)
        passed.append(ok)
        print(f"{path.stem}: trial {trial:.0f} s (start {r.get('start_s') or 0:.0f}, warm-up "
              f"{warm:.0f}, levels {r.get('measure_s') or 0:.0f}); command "
              f"{r.get('command_wall_s')} s; {r.get('stop')}, "
              f"{int(m.get('capacity_levels', 0))} levels; capacity "
              f"{m.get('capacity_sps', 0):.3g} sessions/s ({low or 0:.3g} req/s, "
              f"{m.get('capacity_scale', 0):.3g}x the recorded rate), bracket "
              f"{width or float('nan'):.3g}x wide; prefix-cache hit rate at capacity "
              f"{m.get('server_prefix_cache_hit_rate', float('nan')):.1%}; "
              f"{'pass' if ok else 'FAIL'}")
    if not times:
        print("no results", file=sys.stderr)
        return 1
    print(f"trial time median {statistics.median(times):.0f} s, range {min(times):.0f}-"
          f"{max(times):.0f} s over {len(times)} runs; rule "
          f"{'PASSED' if all(passed) else 'FAILED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
