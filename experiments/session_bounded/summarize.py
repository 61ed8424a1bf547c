"""The verdicts from results.json (README.md's rule): summary.csv and one line a check."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT_PP = 5.0
TURNS = ("1", "2", "3+")


def _median(rows: list[dict[str, object]], kind: str) -> float | None:
    v = [float(r["hit_rate_pct"]) for r in rows  # type: ignore[arg-type]
         if r["kind"] == kind and r["hit_rate_pct"] is not None]
    return statistics.median(v) if v else None


def _tables(rows: list[dict[str, object]]) -> None:
    """README's tables: a row a replay, TTFT p50 by turn with the turns counted."""
    for trace in dict.fromkeys(str(r["trace"]) for r in rows):
        print(f"\n{trace}\n\n| replay | seed | requests | prefix-cache hits / queries | "
              "hit rate | TTFT p50 turn 1 | turn 2 | turn 3+ |\n|---|---:|---:|---:|---:|---:|"
              "---:|---:|")
        for r in rows:
            if r["trace"] != trace:
                continue
            cells = [f"{r[f'turn{k}_ttft_p50_ms']} ms ({r[f'turn{k}_n']})"
                     if r[f"turn{k}_n"] else "-" for k in TURNS]
            print(f"| {r['kind']} | {r['seed']} | {r['requests']} | "
                  f"{int(float(r['prefix_cache_hits'])):,} / "  # type: ignore[arg-type]
                  f"{int(float(r['prefix_cache_queries'])):,} | "  # type: ignore[arg-type]
                  f"{r['hit_rate_pct']} % | {' | '.join(cells)} |")


def main() -> int:
    data = json.loads((HERE / "results.json").read_text())
    rows: list[dict[str, object]] = []
    for trace, t in data["traces"].items():
        for r in t["replays"]:
            row: dict[str, object] = {
                "trace": trace, "kind": r["kind"], "seed": r["seed"],
                "requests": r["requests"], "failed": r["failed"],
                "prefix_cache_queries": r["prefix_cache_queries"],
                "prefix_cache_hits": r["prefix_cache_hits"],
                "hit_rate_pct": r["hit_rate_pct"], "wall_s": r["wall_s"],
                "primed_s": r.get("primed_s", "")}
            for k in TURNS:
                g = r["ttft_by_turn"][k]
                row[f"turn{k}_n"] = g["n"]
                row[f"turn{k}_ttft_p50_ms"] = (round(1000 * g["ttft_p50_s"], 1)
                                               if g["ttft_p50_s"] is not None else "")
            rows.append(row)
    with (HERE / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if "--markdown" in sys.argv:
        _tables(rows)
    for trace in data["traces"]:
        mine = [r for r in rows if r["trace"] == trace]
        ref, bnd, exact = (_median(mine, k) for k in ("reference", "bounded", "exact"))
        for label, a, b in (("bounded vs reference", bnd, ref),
                            ("fitted vs exact", ref, exact)):
            if a is None or b is None:
                print(f"{trace}: {label}: no reading")
                continue
            gap = a - b
            verdict = "within" if abs(gap) <= LIMIT_PP else "NOT within"
            print(f"{trace}: {label}: {a:.1f} % vs {b:.1f} %: {gap:+.1f} points, "
                  f"{verdict} {LIMIT_PP:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
