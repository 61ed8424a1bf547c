"""The A/A benchmark's records and counts (README.md holds the rule).

``summarize.py record OUT ...`` prints one JSON line for the study in OUT (its verdict,
ratio, interval, method, the spread it used, exit code, seconds, load); ``summarize.py
count RESULTS.jsonl ...`` prints, per mode, the studies, the verdicts and the false-winner
rate with its 95 % Clopper-Pearson interval, and whether the rule's bound holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scipy import stats


def record(args: argparse.Namespace) -> None:
    out = Path(args.out)
    study = json.loads((out / "study.json").read_text()) if (out / "study.json").exists() else {}
    v = study.get("verdict") or {}
    log = Path(args.log).read_text(errors="replace") if args.log else ""
    print(json.dumps({
        "mode": args.mode, "exit_code": args.exit_code, "verdict": v.get("verdict", "none"),
        "ratio": v.get("ratio_to_defaults"), "method": v.get("method"),
        "prior_spread": v.get("prior_spread"), "start_spread": v.get("start_spread"),
        "printed_winner": "verdict: WINNER" in log, "seconds": args.seconds,
        "load": args.load, "commit": args.commit, "trials": study.get("trials"),
    }))


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    a = (1 - confidence) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


#: the rule (README.md): the most winners allowed per mode, and the studies it needs
BOUND = {"recheck0": (0, 1), "capacity0": (0, 1), "default": (1, 20), "capacity": (1, 10)}


def count(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for p in args.results for line in Path(p).read_text().splitlines()
            if line.strip()]
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode]
        judged = [r for r in rs if r["verdict"] != "none"]
        n, k = len(judged), sum(r["verdict"] == "winner" for r in judged)
        by = {v: sum(r["verdict"] == v for r in judged)
              for v in sorted({r["verdict"] for r in judged})}
        lo, hi = clopper_pearson(k, n) if n else (float("nan"), float("nan"))
        most, needed = BOUND.get(mode, (0, 1))
        holds = ("holds" if k <= most and n >= needed else
                 "FAILS" if k > most else f"not judged yet ({n} of {needed} studies)")
        print(f"{mode}: {n} studies ({len(rs) - n} without a verdict), verdicts {by}; "
              f"false winners {k}/{n} = {k / n if n else float('nan'):.1%} "
              f"(95 % interval [{lo:.1%}, {hi:.1%}]); WINNER printed "
              f"{sum(r['printed_winner'] for r in rs)}; rule (at most {most} of >= "
              f"{needed}): {holds}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--mode", required=True)
    r.add_argument("--exit-code", type=int, required=True)
    r.add_argument("--seconds", type=int, default=0)
    r.add_argument("--commit", default="")
    r.add_argument("--load", default="")
    r.add_argument("--log", default="")
    r.set_defaults(func=record)
    c = sub.add_parser("count")
    c.add_argument("results", nargs="+")
    c.set_defaults(func=count)
    args = p.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
