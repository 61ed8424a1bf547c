"""The report's "What it is worth" section: best.json's ``cost`` (autotune.cost) in words
and a chart with intervals."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from autotune.cost import cost_line, no_price_line
from autotune.report._data import ReportData

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["cost_figure", "cost_html", "why_no_cost"]

_ATTR = "autotune.cost"  # autotune.store.A.COST


def _cost(d: ReportData) -> dict[str, Any] | None:
    c = d.attrs.get(_ATTR)
    return c if isinstance(c, dict) and c.get("best") else None


def why_no_cost(d: ReportData) -> str:
    if _cost(d) is not None:
        return ""
    return no_price_line()


def cost_html(d: ReportData) -> str:
    c = _cost(d)
    if c is None:
        return ""
    lines = cost_line(c).splitlines()
    return "".join(f"<p>{html.escape(line.strip())}</p>" for line in lines)


def _bar(c: dict[str, Any], key: str) -> tuple[float | None, float, float]:
    v, lo, hi = (c.get(key), c.get(f"{key}_low"), c.get(f"{key}_high"))
    if v is None:
        return None, 0.0, 0.0
    return v, (hi - v) if hi is not None else 0.0, (v - lo) if lo is not None else 0.0


def cost_figure(d: ReportData) -> go.Figure | None:
    """USD per million output tokens of the declared config and the defaults (95 % and
    start-to-start interval as error bars; the API's price of the traffic as a line), and
    the whole GPUs each needs at the traffic's peak, now and with growth."""
    c = _cost(d)
    if c is None:
        return None
    from plotly.subplots import make_subplots

    who = [("declared config", c["best"])] + ([("vLLM defaults", c["defaults"])]
                                              if c.get("defaults") else [])
    unit = str(c.get("unit") or "GPU")  # "server" on the CPU build
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "USD per million output tokens (full use)", f"{unit}s for the traffic at its peak"))
    ys = [_bar(x, "usd_per_m_output_tokens") for _, x in who]
    fig.add_bar(x=[n for n, _ in who], y=[y[0] for y in ys], name="USD / M out tok",
                error_y={"type": "data", "array": [y[1] for y in ys],
                         "arrayminus": [y[2] for y in ys], "symmetric": False},
                marker_color=["#d62728", "#2ca02c"][:len(who)], row=1, col=1)
    api = (c.get("api") or {}).get("usd_per_m_output_tokens")
    if api is not None:
        fig.add_hline(y=api, line_dash="dash", line_color="#555", row=1, col=1,
                      annotation_text=f"API: ${api:.3g}/M out tok")
    for when, color in (("now", "#1f77b4"), ("growth", "#ff7f0e")):
        needs = [x.get("gpus", {}).get("peak", {}).get(when) for _, x in who]
        if not any(needs):
            continue
        fig.add_bar(x=[n for n, _ in who], y=[n["whole"] if n else None for n in needs],
                    name=("now" if when == "now" else f"growth x{c['prices']['growth']:g}"),
                    error_y={"type": "data", "symmetric": False,
                             "array": [n["whole_high"] - n["whole"] if n else 0 for n in needs],
                             "arrayminus": [n["whole"] - n["whole_low"] if n else 0
                                            for n in needs]},
                    marker_color=color, row=1, col=2)
    fig.update_yaxes(title_text="USD", row=1, col=1)
    fig.update_yaxes(title_text=f"whole {unit}s", row=1, col=2)
    fig.update_layout(barmode="group", height=380, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": 60, "b": 50},
                      legend={"orientation": "h", "y": -0.18})
    return fig
