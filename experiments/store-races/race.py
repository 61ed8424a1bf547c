"""How often do processes opening a fresh store at the same moment fail?

    python experiments/store-races/race.py optuna --processes 4 --rounds 20
    python experiments/store-races/race.py mlflow --processes 3 --rounds 6
    python experiments/store-races/race.py optuna --repo /path/to/an/older/checkout

Each round makes a fresh SQLite file and releases ``--processes`` forked processes at once
(a barrier) to open it: ``optuna`` through ``autotune.schema.open_storage`` (an Optuna
RDBStorage creates its schema), ``mlflow`` through ``autotune.tracking.MlflowTracker``
(MLflow creates and migrates its store, then the experiment). Prints the rounds in which
any process failed, with the first error, and the count. ``--repo`` imports autotune from
another checkout (to measure the code before a fix).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
from typing import Any


def _open(kind: str, url: str, barrier: Any, results: Any) -> None:
    if kind == "optuna":
        from autotune.schema import open_storage as opener
    else:
        from autotune.tracking import MlflowTracker as opener
    barrier.wait()
    try:
        opener(url)
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 (every failure is what is counted)
        results.put(f"{type(exc).__name__}: {exc}".splitlines()[0][:200])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("optuna", "mlflow"))
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repo", help="import autotune from this checkout")
    args = ap.parse_args()
    if args.repo:
        sys.path.insert(0, args.repo)
    import autotune

    print(f"autotune from {autotune.__file__}", flush=True)
    if args.kind == "mlflow":
        import mlflow  # noqa: F401  (imported once, before the forks)
    ctx = mp.get_context("fork")
    failed = 0
    for r in range(args.rounds):
        url = f"sqlite:///{tempfile.mkdtemp()}/{args.kind}.db"
        barrier, results = ctx.Barrier(args.processes), ctx.Queue()
        procs = [ctx.Process(target=_open, args=(args.kind, url, barrier, results))
                 for _ in range(args.processes)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        errors = [e for e in (results.get(timeout=10) for _ in procs) if e != "ok"]
        if errors:
            failed += 1
            print(f"round {r + 1}: {len(errors)} of {args.processes} failed: {errors[0]}",
                  flush=True)
    print(f"{args.kind}: rounds with a failure: {failed} of {args.rounds} "
          f"({args.processes} processes at once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
