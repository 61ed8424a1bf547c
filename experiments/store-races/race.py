"""How often do processes opening a fresh store at the same moment fail?

    python experiments/store-races/race.py optuna --processes 4 --rounds 20
    python experiments/store-races/race.py mlflow --processes 3 --rounds 6
    python experiments/store-races/race.py optuna --repo /path/to/an/older/checkout
    python experiments/store-races/race.py optuna --postgres   # the same on PostgreSQL

Each round makes a fresh SQLite file and releases ``--processes`` forked processes at once
(a barrier) to open it: ``optuna`` through ``autotune.store.open_storage`` (an Optuna
RDBStorage creates its schema), ``mlflow`` through ``autotune.results.MlflowTracker``
(MLflow creates and migrates its store, then the experiment). Prints the rounds in which
any process failed, with the first error, and the count. ``--repo`` imports autotune from
another checkout (to measure the code before a fix). ``--postgres`` starts a throw-away
PostgreSQL cluster (``tests/_postgres.py``) and gives each round a fresh database instead
of a fresh SQLite file.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
from typing import Any


def _open(kind: str, url: str, barrier: Any, results: Any) -> None:
    if kind == "optuna":
        from autotune.store import open_storage as opener
    else:
        from autotune.results import MlflowTracker as opener
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
    ap.add_argument("--postgres", action="store_true",
                    help="a fresh PostgreSQL database each round (a throw-away cluster)")
    args = ap.parse_args()
    if args.repo:
        sys.path.insert(0, args.repo)
    import autotune

    print(f"autotune from {autotune.__file__}", flush=True)
    if args.kind == "mlflow":
        import mlflow  # noqa: F401  (imported once, before the forks)
    ctx = mp.get_context("fork")
    failed = 0
    pg = None
    if args.postgres:
        import os
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests._postgres import PgCluster, pg_binaries

        bindir = pg_binaries()
        if bindir is None:
            sys.exit("no PostgreSQL here: bash scripts/setup-postgres.sh")
        pg = PgCluster(bindir)
        pg.start()
        os.environ["PGPASSWORD"] = pg.password
    try:
        failed = _rounds(args, ctx, pg)
    finally:
        if pg is not None:
            pg.remove()
    print(f"{args.kind}: rounds with a failure: {failed} of {args.rounds} "
          f"({args.processes} processes at once{', PostgreSQL' if pg else ''})")
    return 0


def _rounds(args: Any, ctx: Any, pg: Any) -> int:
    failed = 0
    for r in range(args.rounds):
        url = (pg.create_db(f"race_{r}") if pg is not None
               else f"sqlite:///{tempfile.mkdtemp()}/{args.kind}.db")
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
    return failed


if __name__ == "__main__":
    sys.exit(main())
