"""``autotune sync``: log to MLflow what a study could not log while its store was away."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_INCOMPLETE = 1  # the store failed again: some of it is still missing


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "sync",
        help="log to MLflow the trial runs and study results a study could not log",
        description=(
            "When the MLflow tracking server was down during a study, the study finishes "
            "anyway (the Optuna storage keeps every trial) and its summary names what was "
            "not logged. Once the server answers, 'autotune sync OUT' logs it: a run for "
            "each finished trial that has none (a run half written is replaced), then the "
            "study run's best config, verdict and files from OUT, and closes it. Running it "
            "again writes nothing new. Exits 1 when the store failed again. See docs/team.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("out", type=Path, metavar="OUT",
                   help="the study's output folder (its study.json names the study and stores)")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (default: the study's, from OUT/study.json)")
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="MLflow tracking URI (default: the study's, from OUT/study.json)")
    p.add_argument("--experiment", default=None,
                   help="MLflow experiment (default: the study's, else autotune)")
    p.set_defaults(func=_sync)


def _sync(args: argparse.Namespace) -> int:
    from autotune.results import sync_study

    res = sync_study(args.out, storage=args.storage, tracking_uri=args.tracking_uri,
                     experiment=args.experiment)
    logged = ", ".join(map(str, res.logged)) or "none"
    print(f"study {res.study_name}: trial runs logged now: {logged}; already logged: "
          f"{len(res.already)}; study run "
          f"{'closed with its results' if res.study_run_closed else 'already closed'}")
    if res.failures:
        print(f"MLflow failed again ({res.failures[0]}); run autotune sync again once it "
              "answers", file=sys.stderr)
        return EXIT_INCOMPLETE
    return EXIT_OK
