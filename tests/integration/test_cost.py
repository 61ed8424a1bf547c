"""autotune.cost in the HTML report of a SQLite study (the arithmetic alone: tests/unit/test_cost.py)."""

from __future__ import annotations

from pathlib import Path

from autotune.cost import (
    Rate,
    study_cost,
)
from tests._cost import PRICES, TRAFFIC


def test_report_shows_cost_with_intervals(tmp_path: Path) -> None:
    import optuna

    from autotune.report import load_report_data, render_html
    from tests.integration.test_report import _make_study

    storage = _make_study(tmp_path / "priced", recorded=True)
    s = study_cost(best=Rate("throughput", 1000.0, 800.0, 1250.0),
                   defaults=Rate("throughput", 500.0, 450.0, 550.0), prices=PRICES,
                   traffic=TRAFFIC)
    optuna.load_study(study_name="s", storage=storage).set_user_attr("autotune.cost",
                                                                     s.to_dict())
    page = render_html(load_report_data(storage=storage, study_name="s"))
    section = page.split('<section id="cost">', 1)[1].split("</section>", 1)[0]
    assert "$0.694/M out tok ($0.556-$0.868)" in section
    assert 'id="plot-cost"' in section and '"error_y"' in section  # the chart's intervals
    bare = _make_study(tmp_path / "bare", recorded=True)
    section = render_html(load_report_data(storage=bare, study_name="s")).split(
        '<section id="cost">', 1)[1].split("</section>", 1)[0]
    assert "--gpu-hour-price" in section and "plot-cost" not in section
