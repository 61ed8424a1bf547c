"""The study report: one self-contained HTML page (interactive Plotly figures, plotly.js
inlined, no network needed to open it) that answers what a study found for a traffic shape,
how sure it is, what failed and why, and what it cost.

``autotune report`` writes it for any study in a storage; every study writes
``OUT/report.html`` at its end and logs it to its MLflow run. The report reads the Optuna
storage (and the study's out dir when it is there), nothing else.
"""

from __future__ import annotations

from pathlib import Path

from autotune.report._capacity import capacity_line, level_rate, needed_text, open_search_text
from autotune.report._data import ReportData, TrialRow, load_report_data, trial_row
from autotune.report._html import SECTIONS, log_excerpt, render_html, write_html
from autotune.report._importance import MIN_IMPORTANCE_TRIALS, param_importances
from autotune.report._why import explain_no_winner, failure_summary, one_line_message

__all__ = [
    "MIN_IMPORTANCE_TRIALS",
    "SECTIONS",
    "ReportData",
    "TrialRow",
    "capacity_line",
    "explain_no_winner",
    "failure_summary",
    "level_rate",
    "load_report_data",
    "log_excerpt",
    "needed_text",
    "one_line_message",
    "open_search_text",
    "param_importances",
    "render_html",
    "trial_row",
    "write_report",
]


def write_report(path: str | Path, *, storage: str, study_name: str | None = None,
                 out_dir: Path | None = None) -> Path:
    """Write the report of ``study_name`` (default: the newest study in ``storage``) to
    ``path`` and return it."""
    data = load_report_data(storage=storage, study_name=study_name, out_dir=out_dir)
    return write_html(data, Path(path))
