"""Plotly figures of a study report, one function per section; each takes a
:class:`ReportData` and returns a figure or None (the section then says why in words)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.report._cost import cost_figure
from autotune.report._data import ReportData, TrialRow
from autotune.store import pareto_front

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["FIGURES"]

_COLORS = {"ok": "#1f77b4", "infeasible": "#ff7f0e", "defaults": "#2ca02c", "best": "#d62728"}
_FAIL = ("#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#333333")
_PCTS = ("p50", "p90", "p99")


def _layout(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(title=title, height=height, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": 60, "b": 50}, hovermode="closest",
                      legend={"orientation": "h", "y": -0.18})
    return fig


def shape_figure(d: ReportData) -> go.Figure | None:
    from plotly.subplots import make_subplots

    s = d.shape
    if not s:
        return None
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "input tokens (CDF)", "output tokens (CDF)", "arrivals (requests/s per window)"))
    for col, key in ((1, "input_tokens"), (2, "output_tokens")):
        q = (s.get(key) or {}).get("quantiles") or []
        if len(q) > 1:
            fig.add_scatter(x=q, y=[i / (len(q) - 1) for i in range(len(q))], mode="lines",
                            name=key.replace("_", " "), row=1, col=col,
                            hovertemplate="%{x:.0f} tokens: %{y:.0%} of requests<extra></extra>")
    arr = s.get("arrivals") or {}
    prof = arr.get("rate_profile") or []
    win = float(arr.get("window_s") or 60.0)
    if prof:
        fig.add_bar(x=[i * win / 60.0 for i in range(len(prof))], y=prof, name="arrival rate",
                    row=1, col=3, marker_color="#7f7f7f",
                    hovertemplate="minute %{x:.0f}: %{y:.2f} req/s<extra></extra>")
    fig.update_xaxes(title_text="tokens", row=1, col=1)
    fig.update_xaxes(title_text="tokens", row=1, col=2)
    fig.update_xaxes(title_text="minutes into the recording", row=1, col=3)
    return _layout(fig, f"traffic shape {s.get('name', '')} ({s.get('fingerprint', '')})", 380)


def _hover(t: TrialRow) -> str:
    items = [f"{k}={v}" for k, v in t.params.items()]
    params = "<br>".join(", ".join(items[i:i + 3]) for i in range(0, len(items), 3))
    msg = t.message.split("\n", 1)[0][:100]
    return f"{t.label}: {t.state}{': ' + msg if msg else ''}<br>{params or 'vLLM defaults'}"


def history_figure(d: ReportData) -> go.Figure | None:
    from plotly.subplots import make_subplots

    if not d.trials:
        return None
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.8, 0.2],
                        vertical_spacing=0.04)
    for kind, color, symbol in (("ok", _COLORS["ok"], "circle"),
                                ("infeasible", _COLORS["infeasible"], "x")):
        pts = [t for t in d.measured if t.state == kind and not t.baseline]
        if not pts:
            continue
        err = None
        if any(t.interval for t in pts):
            err = {"type": "data", "symmetric": False,
                   "array": [(t.interval[1] - t.value) if t.interval and t.value else 0
                             for t in pts],
                   "arrayminus": [(t.value - t.interval[0]) if t.interval and t.value else 0
                                  for t in pts]}
        fig.add_scatter(x=[t.number for t in pts], y=[t.value for t in pts], mode="markers",
                        name="feasible" if kind == "ok" else "infeasible (SLO / errors / quality)",
                        marker={"color": color, "symbol": symbol, "size": 9}, error_y=err,
                        text=[_hover(t) for t in pts], row=1, col=1,
                        hovertemplate="%{text}<br>%{y:,.1f}<extra></extra>")
    base = [t for t in d.measured if t.baseline]
    if base:
        fig.add_scatter(x=[t.number for t in base], y=[t.value for t in base], mode="markers",
                        name="vLLM defaults", text=[_hover(t) for t in base], row=1, col=1,
                        marker={"color": _COLORS["defaults"], "symbol": "star", "size": 14},
                        error_y={"type": "data", "symmetric": False,
                                 "array": [(t.interval[1] - t.value) if t.interval and t.value
                                           else 0 for t in base],
                                 "arrayminus": [(t.value - t.interval[0]) if t.interval
                                                and t.value else 0 for t in base]},
                        hovertemplate="%{text}<br>%{y:,.1f}<extra></extra>")
    ok = sorted(d.feasible, key=lambda t: t.number)
    if ok:
        xs, ys, best = [], [], float("-inf")
        for t in ok:
            best = max(best, float(t.value or 0.0))
            xs.append(t.number)
            ys.append(best)
        last = max(t.number for t in d.trials)
        if xs[-1] < last:
            xs.append(last)
            ys.append(ys[-1])
        fig.add_scatter(x=xs, y=ys, mode="lines", line={"shape": "hv", "color": _COLORS["best"]},
                        name="best so far", row=1, col=1, hoverinfo="skip")
    failed = d.failed + d.pruned
    reasons = sorted({t.reason or t.state for t in failed})
    for i, reason in enumerate(reasons):
        pts = [t for t in failed if (t.reason or t.state) == reason]
        what = reason if reason == "pruned" else f"failed: {reason}"  # pruned: no failure
        fig.add_scatter(x=[t.number for t in pts], y=[reason] * len(pts), mode="markers",
                        name=f"{what} ({len(pts)})", text=[_hover(t) for t in pts],
                        marker={"symbol": "triangle-down", "size": 11,
                                "color": "#aaaaaa" if reason == "rejected"
                                else _FAIL[i % len(_FAIL)]},
                        row=2, col=1, hovertemplate="%{text}<extra></extra>")
    fig.update_yaxes(title_text=d.metric, row=1, col=1)
    fig.update_yaxes(title_text="failed or pruned", row=2, col=1, type="category")
    fig.update_xaxes(title_text="trial number", row=2, col=1)
    ci = " with intervals" if any(t.interval for t in d.measured) else ""
    return _layout(fig, f"optimization history{ci} ({len(d.trials)} trials, "
                        f"{len(d.feasible)} feasible)", 520)


def importance_figure(d: ReportData) -> go.Figure | None:
    import plotly.graph_objects as go

    if not d.importances:
        return None
    items = sorted(d.importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h",
                           marker_color=_COLORS["ok"],
                           hovertemplate="%{y}: %{x:.2f}<extra></extra>"))
    fig.update_xaxes(title_text="share of the objective's variance (fANOVA)")
    return _layout(fig, f"parameter importances ({len(d.measured)} measured trials)",
                   max(260, 60 + 28 * len(items)))


def pareto_figure(d: ReportData) -> go.Figure | None:
    import plotly.graph_objects as go

    pts = [t for t in d.feasible if len(t.values) == 2]
    if d.n_objectives != 2 or not pts:
        return None
    front_idx = set(pareto_front([(t.values[0], t.values[1]) for t in pts]))
    front = sorted((pts[i] for i in front_idx), key=lambda t: t.values[1])
    rest = [t for i, t in enumerate(pts) if i not in front_idx]
    lat = str(d.settings.get("pareto_latency", "latency"))
    fig = go.Figure()
    fig.add_scatter(x=[t.values[1] for t in rest], y=[t.values[0] for t in rest],
                    mode="markers", name="dominated", marker={"color": "#aaaaaa", "size": 9},
                    text=[_hover(t) for t in rest], hovertemplate="%{text}<extra></extra>")
    fig.add_scatter(x=[t.values[1] for t in front], y=[t.values[0] for t in front],
                    mode="lines+markers", name="Pareto front", text=[_hover(t) for t in front],
                    marker={"color": _COLORS["best"], "size": 11},
                    hovertemplate="%{text}<br>%{x:.3f}s, %{y:,.1f}<extra></extra>")
    fig.update_xaxes(title_text=f"{lat} (s, lower is better)")
    fig.update_yaxes(title_text="output tokens/s")
    return _layout(fig, f"Pareto front: throughput vs {lat}")


def leaders(d: ReportData, k: int = 3) -> list[TrialRow]:
    """The top ``k`` feasible trials (one per config) and the defaults' first reading."""
    seen: set[str] = set()
    out: list[TrialRow] = []
    for t in sorted(d.feasible, key=lambda t: -(t.value or 0.0)):
        key = repr(sorted(t.params.items())) + str(t.baseline)
        if key in seen or t.baseline:
            continue
        seen.add(key)
        out.append(t)
        if len(out) == k:
            break
    base = next((t for t in d.measured if t.baseline), None)
    return out + ([base] if base is not None else [])


def latency_figure(d: ReportData) -> go.Figure | None:
    from plotly.subplots import make_subplots

    rows = [t for t in leaders(d) if any(f"ttft_{p}_s" in t.metrics for p in _PCTS)]
    if not rows:
        return None
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (s)", "TPOT (s)", "E2E (s)"))
    for i, t in enumerate(rows):
        color = _COLORS["defaults"] if t.baseline else _FAIL[i % len(_FAIL)]
        for col, lat in enumerate(("ttft", "tpot", "e2e"), start=1):
            fig.add_bar(x=list(_PCTS), y=[t.metrics.get(f"{lat}_{p}_s") for p in _PCTS],
                        name=t.label, legendgroup=t.label, showlegend=col == 1,
                        marker_color=color, row=1, col=col,
                        hovertemplate=f"{t.label} {lat.upper()} " + "%{x}: %{y:.4f}s"
                                      "<extra></extra>")
    fig.update_layout(barmode="group")
    return _layout(fig, "latency percentiles: the leaders against vLLM's defaults", 400)


def failures_figure(d: ReportData) -> go.Figure | None:
    import plotly.graph_objects as go

    counts: dict[str, int] = {}
    for t in d.failed + d.pruned + d.infeasible:
        r = t.reason or t.state
        counts[r] = counts.get(r, 0) + 1
    if not counts:
        return None
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    fig = go.Figure(go.Bar(x=[k for k, _ in items], y=[v for _, v in items],
                           marker_color=_FAIL[0],
                           hovertemplate="%{x}: %{y} trial(s)<extra></extra>"))
    fig.update_yaxes(title_text="trials", dtick=1)
    return _layout(fig, "failed, pruned and infeasible trials by reason", 320)


def gpu_time_figure(d: ReportData) -> go.Figure | None:
    import plotly.graph_objects as go

    if not d.gpu_time:
        return None
    labels = list(d.gpu_time)
    parts = sorted({p for v in d.gpu_time.values() for p in v} - {"compile_s"})  # in start_s
    order: list[str] = [p for p in ("start_s", "warmup_s", "measure_s", "idle_s", "other_s")
                        if p in parts]
    order += [p for p in parts if p not in order]
    fig = go.Figure()
    for i, p in enumerate(order):
        fig.add_bar(x=labels, y=[d.gpu_time[k].get(p, 0.0) / 60.0 for k in labels],
                    name=p.removesuffix("_s").replace("_", " "),
                    marker_color=(_COLORS["ok"], _COLORS["infeasible"], _COLORS["defaults"],
                                  "#aaaaaa", _FAIL[0], _FAIL[1])[i % 6],
                    hovertemplate="%{x} " + p.removesuffix("_s") + ": %{y:.1f} min"
                                  "<extra></extra>")
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="minutes")
    return _layout(fig, "where the server time went" if d.unit == "server" else
                   "where the (GPU) time went", 340)


FIGURES = {
    "shape": shape_figure, "history": history_figure, "importance": importance_figure,
    "pareto": pareto_figure, "latency": latency_figure, "failures": failures_figure,
    "gpu-time": gpu_time_figure, "cost": cost_figure,
}
