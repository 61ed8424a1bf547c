"""experiments/README.md, the results page: every ratio and interval that
experiments/results.py computes from the committed raw data is on the page as printed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "experiments" / "README.md"


def _rows() -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("results", REPO / "experiments" / "results.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.all_rows())


def test_every_computed_ratio_and_interval_is_on_the_results_page() -> None:
    page = PAGE.read_text()
    missing = []
    for key, text in _rows():
        assert key in page, f"row {key} is not on experiments/README.md"
        for figure in re.findall(r"\d+\.\d{3}x|\[\d+\.\d{3}, \d+\.\d{3}\]", text):
            if figure not in page:
                missing.append(f"{key}: {figure}")
    assert not missing, "figures results.py computes but the page lacks: " + "; ".join(missing)


def test_the_page_states_both_verdicts_where_the_rule_changed() -> None:
    rows = dict(_rows())
    assert "defaults remain best" in rows["q1-azure-at-run"]
    assert "WINNER" in rows["q1-azure"]
