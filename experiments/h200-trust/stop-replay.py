"""Replay the adaptive stop on every H200 run measured long enough to judge it.

Reads the segment rates (Optuna intermediate values) of every trial with at least 8
measured segments in the committed H200 stores, replays `SegmentRule.measure` on them for
each --precision and min_segments, and reports how often the run would have stopped early
and how far such a stopped reading lies from the whole run's mean (the best estimate the
run has). Chose min_segments' default (5, was 3).

    .venv/bin/python experiments/h200-trust/stop-replay.py > experiments/h200-trust/stop-replay.txt
"""

from __future__ import annotations

import statistics as st
from pathlib import Path

import optuna

from autotune.measure import SegmentRule

ROOT = Path(__file__).resolve().parents[2]
STORES = sorted(p for p in (ROOT / "experiments").glob("h200*/**/autotune.db"))


def sequences() -> list[tuple[str, int, list[float]]]:
    out = []
    for db in STORES:
        url = f"sqlite:///{db}"
        for summary in optuna.get_all_study_summaries(url):
            study = optuna.load_study(study_name=summary.study_name, storage=url)
            for t in study.trials:
                rates = [v for _, v in sorted(t.intermediate_values.items())]
                if len(rates) >= 8 and all(v > 100 for v in rates):  # throughput segments
                    out.append((f"{db.parent.relative_to(ROOT)}:{summary.study_name}",
                                t.number, rates))
    return out


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seqs = sequences()
    print(f"{len(seqs)} runs of >= 8 measured segments from {len(STORES)} stores:")
    for name, number, rates in seqs:
        print(f"  {name} trial {number}: {len(rates)} segments, mean {st.mean(rates):,.0f}")
    print()
    print("precision | min_segments | stopped early | mean segments | off the run's mean: "
          "median / p90 / max")
    for precision in (0.02, 0.01):
        for k in (3, 4, 5, 6):
            rule = SegmentRule(precision=precision, min_segments=k,
                               measure_max_segments=10_000, measure_max_s=1e12)
            errs, used, early = [], [], 0
            for _, _, rates in seqs:
                n = next((i for i in range(1, len(rates) + 1)
                          if rule.measure(rates[:i], 0.0) == "stop_precise"), len(rates))
                early += n < len(rates)
                used.append(n)
                errs.append(abs(st.mean(rates[:n]) / st.mean(rates) - 1))
            errs.sort()
            p90 = errs[int(0.9 * len(errs))]
            print(f"{precision:9.2f} | {k:12d} | {early:6d} of {len(seqs):2d} | "
                  f"{st.mean(used):13.1f} | {st.median(errs):.2%} / {p90:.2%} / {errs[-1]:.2%}")


if __name__ == "__main__":
    main()
