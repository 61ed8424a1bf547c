"""``autotune report``: a study's report as one self-contained HTML file."""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.config import DEFAULT_STORAGE, folder_storage, storage_url


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "report",
        help="write a study's report: one HTML page that opens offline in any browser",
        description=(
            "Write one self-contained HTML file (interactive Plotly figures, no network "
            "needed to open it) for a study: its traffic shape, the verdict and the ratio to "
            "vLLM's defaults with its interval, the optimization history, parameter "
            "importances, the Pareto front (Pareto studies), latency percentiles of the "
            "leaders against the defaults, failures by reason with the server-log lines that "
            "classified each, and where the (GPU) time went. Every study also writes "
            "OUT/report.html at its end."
        ),
    )
    p.add_argument("--study-name", default=None,
                   help="the study (default: the newest study in --storage)")
    p.add_argument("--storage", default=None,
                   help="the Optuna storage URL the study used, or its output folder "
                        f"(default: --out's, else {DEFAULT_STORAGE})")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="the study's out dir: its stores (unless --storage says otherwise) "
                        "and server logs (default: the one the study recorded, when it is "
                        "there)")
    p.add_argument("-o", "--output", type=Path, default=Path("report.html"),
                   help="where to write the report (default report.html)")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from autotune.report import write_report

    storage = (storage_url(args.storage) if args.storage is not None
               else folder_storage(args.out) if args.out is not None else DEFAULT_STORAGE)
    path = write_report(args.output, storage=storage, study_name=args.study_name,
                        out_dir=args.out)
    print(f"written: {path} ({path.stat().st_size / 1e6:.1f} MB; opens offline in a browser)")
    return 0
