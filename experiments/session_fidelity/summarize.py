"""The fidelity verdict from results.json (README.md's rule): summary.csv and one line."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT_PP = 5.0


def main() -> int:
    data = json.loads((HERE / "results.json").read_text())
    rows = []
    for r in data["replays"]:
        s = r["server"]
        rows.append({"kind": r["kind"], "seed": r["seed"], "requests": r["requests"],
                     "failed": r["failed"], "prompt_tokens": s["prompt_tokens"],
                     "prefix_cache_queries": s["prefix_cache_queries"],
                     "prefix_cache_hits": s["prefix_cache_hits"],
                     "hit_rate_pct": round(100 * (s["prefix_cache_hit_rate"] or 0.0), 2),
                     "wall_s": r["wall_s"]})
    with (HERE / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    exact = next(r["hit_rate_pct"] for r in rows if r["kind"] == "exact")
    fitted = statistics.median(r["hit_rate_pct"] for r in rows if r["kind"] == "fitted")
    gap = fitted - exact
    verdict = "within" if abs(gap) <= LIMIT_PP else "NOT within"
    print(f"prefix-cache hit rate: exact {exact:.1f} %, fitted (median of "
          f"{sum(r['kind'] == 'fitted' for r in rows)}) {fitted:.1f} %: {gap:+.1f} points, "
          f"{verdict} {LIMIT_PP:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
