"""Assemble the report: one self-contained HTML file (plotly.js inlined once), a section per
question a user brings to a study."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from autotune.credentials import redact
from autotune.engine import classifying_lines
from autotune.errors import StudyError
from autotune.measure import (
    CAPACITY_BRACKETS,
    WITHIN_RUN_ONLY,
    fmt_bracket,
    fmt_interval,
    fmt_ratio,
    fmt_value,
)
from autotune.quality import quality_figure, result_of
from autotune.report._capacity import open_search_text
from autotune.report._cost import cost_html, why_no_cost
from autotune.report._data import ReportData, TrialRow
from autotune.report._figures import FIGURES, leaders
from autotune.report._why import explain_no_winner
from autotune.trial import flat_note

__all__ = ["SECTIONS", "log_excerpt", "render_html", "write_html"]

#: section id -> heading, in page order (the browser test checks every one)
SECTIONS = {
    "verdict": "Verdict",
    "shape": "Traffic shape",
    "history": "Optimization history",
    "importance": "Parameter importances",
    "pareto": "Pareto front",
    "latency": "Latency: leaders vs defaults",
    "capacity": "Capacity: the load levels",
    "cost": "What it is worth",
    "failures": "Failures and why",
    "gpu-time": "GPU-time account",
}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222}
header{background:#1f2937;color:#fff;padding:16px 28px}
header h1{margin:0 0 6px;font-size:22px} header .meta{font-size:13px;opacity:.85}
nav{position:sticky;top:0;background:#f3f4f6;padding:8px 28px;border-bottom:1px solid #ddd;
  z-index:10} nav a{margin-right:14px;color:#1f2937;font-size:14px}
main{padding:8px 28px 40px;max-width:1200px} section{margin-top:26px}
h2{border-bottom:2px solid #e5e7eb;padding-bottom:4px;font-size:19px}
.note{color:#555;font-size:14px;background:#f9fafb;border-left:3px solid #9ca3af;
  padding:6px 10px;margin:8px 0}
.big{font-size:20px;margin:6px 0} table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #e5e7eb;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6} pre{background:#111827;color:#e5e7eb;padding:8px;font-size:12px;
  overflow-x:auto;white-space:pre-wrap;margin:4px 0;max-width:760px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _note(text: str) -> str:
    return f'<p class="note">{_e(text)}</p>'


def _fmt(x: float | None, spec: str = ",.1f") -> str:
    return "-" if x is None else format(x, spec)


def _num(x: float | None) -> str:
    """A rate, capacity or count (:func:`autotune.measure.fmt_value`); "-" when unknown."""
    return "-" if x is None else fmt_value(x)


def _table(head: list[str], rows: list[list[str]]) -> str:
    """``rows`` cells are already HTML."""
    h = "".join(f"<th>{_e(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _verdict_html(d: ReportData) -> str:
    v = d.verdict
    if v is None:
        return f'<p class="big">No verdict: no trial met the constraints.</p>' \
               f"<p>{_e(explain_no_winner(d.trials, d.settings))}</p>"
    r = v.get("ratio_to_defaults") or {}
    bound = v.get("ratio_bound") or {}
    win = v.get("winner_number")
    what = ("vLLM's defaults are the best config found" if v.get("verdict") == "defaults_best"
            else f"trial #{win} beats vLLM's defaults" if v.get("verdict") == "winner"
            else f"trial #{v.get('candidate_number')} leads, unconfirmed: one server start "
                 f"each (confirm it: {v.get('confirm_command') or '--resume --recheck 1'})"
            if v.get("verdict") == "unconfirmed"
            else f"trial #{win} is the best config found, not shown to beat vLLM's defaults: "
                 f"{v.get('reason', '')}")
    parts = [f'<p class="big">{_e(what)}</p>']
    if r.get("median") is not None:
        label = ("the range the brackets allow" if v.get("method") == CAPACITY_BRACKETS
                 else "95 % within-run interval" if v.get("method") == WITHIN_RUN_ONLY
                 else "95 % interval")
        ci = (f" ({label} {fmt_interval(r['ci_low'], r['ci_high'], '.3f')})"
              if r.get("ci_low") is not None and r.get("ci_high") is not None
              else " (no interval: a single reading on one side)")
        parts.append(f"<p>ratio to vLLM's defaults: <b>{_e(fmt_ratio(r['median']))}</b>"
                     f"{_e(ci)}</p>")
        if v.get("method"):
            parts.append(_note(f"how: {v['method']}"))
        need = v.get("starts_needed") or {}
        if need.get("per_config") is not None and v.get("start_spread") is not None:
            parts.append(_note(
                f"not shown either way: at the measured start-to-start SD of "
                f"{v['start_spread'] * 100:.1f} %, showing {fmt_ratio(r['median'])} would take "
                f"about {need['per_config']} server starts of each config (rerun the study with "
                f"--resume --recheck-starts {need['recheck_starts']})"))
    elif bound.get("value") is not None:
        parts.append(f"<p>ratio to vLLM's defaults: <b>{_e(bound['kind'].replace('_', ' '))} "
                     f"{_e(fmt_ratio(bound['value']))}</b> (a bound, not a ratio)</p>")
        parts.append(_note(str(v.get("reason") or "")))
    elif v.get("candidate_number") is not None and v.get("reason"):
        parts.append(_note(str(v["reason"])))  # e.g. both capacities lower bounds
    else:
        parts.append(_note("no ratio to the defaults: vLLM's defaults were not measured "
                           "(--no-baseline) or did not meet the constraints"))
    row = next((t for t in d.trials if t.number == win), None)
    if row is not None:
        params = ", ".join(f"{k}={v}" for k, v in row.params.items()) or "vLLM defaults"
        n = row.server_gpus
        per = ("per server" if d.unit == "server" else  # a CPU server: no GPU to count
               f"per GPU (one server uses {n} GPU{'s' if n > 1 else ''})")
        parts.append(f"<p>winner: {_e(row.label)}: {_e(params)}; {_e(d.metric)} {per}: "
                     f"{_num(v.get('winner_value', row.value))}</p>")
    q = v.get("quality") or {}
    if q:
        knobs = ", ".join(f"{k}={x}" for k, x in (q.get("lossy_knobs") or {}).items())
        figure = quality_figure(q.get("figures"))
        parts.append(_note(f"lossy knobs ({knobs}): quality judged: {q.get('reason')}"
                           + (f"; {figure}" if figure else "") if q.get("judged") else
                           f"quality NOT judged: {q.get('subject') or 'the winner'} sets lossy "
                           f"knobs ({knobs}) and {q.get('reason')}"
                           + (f"; its probe: {figure}" if figure else "")
                           + f". Its figure is {result_of(q)}, not a "
                           f"recommendation: {q.get('check')}"))
    if d.verdict_source == "computed":
        parts.append(_note("computed by this report from the stored readings (median of each "
                           "config's readings; interval: bootstrap of both medians): the "
                           "study did not record autotune.verdict"))
    return "".join(parts)


def _shape_html(d: ReportData) -> str:
    s = d.shape
    if not s:
        return _note(d.shape_note)
    rows = []
    for key in ("input_tokens", "output_tokens"):
        x = s.get(key) or {}
        rows.append([_e(key.replace("_", " "))] + [_e(_fmt(x.get(k), ",.0f"))
                                                   for k in ("mean", "p50", "p90", "p99", "max")])
    arr = s.get("arrivals") or {}
    extra = (f"<p>{_fmt(s.get('requests'), ',.0f')} requests over "
             f"{_fmt(s.get('duration_s'), ',.0f')} s recorded ({_num(s.get('rate_rps'))} "
             f"req/s, peak {_num(arr.get('peak_rate_rps'))}, inter-arrival CV "
             f"{_fmt(arr.get('interarrival_cv'), '.2f')}); {_e(replay_text(s))}.</p>")
    return (_table(["tokens", "mean", "p50", "p90", "p99", "max"], rows) + extra
            + (_note(d.shape_note) if d.shape_note else ""))


def replay_text(shape: dict[str, Any]) -> str:
    """How a shape's load replays, in words: "replayed as open loop at the recorded 5.53
    req/s, 1,000 requests", "replayed as closed loop, 64 streams, 500 requests"."""
    load = shape.get("load") or {}
    n = load.get("requests")
    reqs = f", {n:,} requests" if isinstance(n, int) else ""
    if load.get("mode") == "closed":
        c = load.get("concurrency")
        return (f"replayed as closed loop, {c} streams{reqs}" if c is not None else
                f"replayed as closed loop (its streams not recorded){reqs}")
    if load.get("mode") != "open":
        return "its replay (open or closed loop) is not recorded in the shape"
    scale = float(load.get("time_scale") or 1.0)
    rate, recorded = load.get("rate_rps"), shape.get("rate_rps")
    if rate:
        at = f"at {fmt_value(float(rate) / scale)} req/s"
    elif recorded:
        at = (f"at the recorded {fmt_value(recorded)} req/s" if scale == 1.0 else
              f"at {fmt_value(float(recorded) / scale)} req/s (the recorded "
              f"{fmt_value(recorded)} req/s, time scale {scale:g})")
    else:
        at = "at its recorded arrival times (the shape records no mean rate)"
    return f"replayed as open loop {at}{reqs}"


def _read_tail(path: str | None, limit: int = 400_000) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def log_excerpt(t: TrialRow) -> str:
    """The lines of the trial's server log that named its failure (else its last lines)."""

    text = _read_tail(t.log_path)
    if not text and "--- server log tail ---" in t.message:
        text = t.message.split("--- server log tail ---", 1)[1]
    return "\n".join(classifying_lines(text, t.reason)) if text else ""


def _failures_html(d: ReportData) -> str:
    bad = d.failed + d.pruned + d.infeasible
    if not bad:
        return _note("every trial was measured and met the constraints")
    # the server log says nothing of why a trial was infeasible, rejected or pruned (a
    # pruned one's tail is its server stopping): the message is the reason
    no_log = ("infeasible", "rejected", "pruned", "screened")
    rows = []
    for t in sorted(bad, key=lambda t: t.number):
        msg = t.message.split("\n--- server log tail ---", 1)[0]
        excerpt = log_excerpt(t) if t.state not in no_log else ""
        rows.append([_e(t.label), _e(t.reason or t.state), _e(msg[:600]),
                     f"<pre>{_e(excerpt)}</pre>" if excerpt else
                     ("" if t.state in no_log
                      else _e(f"log not readable here ({t.log_path or 'no log'})"))])
    return _table(["trial", "reason", "message", "server log (the lines that classified it)"],
                  rows)


def _latency_html(d: ReportData) -> str:
    rows = leaders(d)
    if not rows:
        return ""
    head = ["config", d.metric] + [f"{m} {p}" for m in ("TTFT", "TPOT", "E2E")
                                   for p in ("p50", "p99")]
    body = [[_e(t.label), _e(_num(t.value))] +
            [_e(_fmt(t.metrics.get(f"{m}_{p}_s"), ".4f")) for m in ("ttft", "tpot", "e2e")
             for p in ("p50", "p99")] for t in rows]
    return _table(head, body)


def _capacity_html(d: ReportData) -> str:
    """--objective capacity: each leader's load levels in the order they ran, with which SLO
    their misses exceeded (the figures behind the bracket, and behind a flat-misses note)."""

    out = []
    for t in leaders(d):
        cap = t.capacity
        if not cap.get("levels"):
            continue
        rec = float(cap.get("recorded_rps") or 0.0)
        lo, hi = cap.get("low"), cap.get("high")
        bracket = fmt_bracket(lo * rec if lo is not None else None,
                              hi * rec if hi is not None else None)
        status = cap.get("status")
        how = (open_search_text(status) if lo is not None and hi is None
               else _STATUS.get(str(status), f"search status {status}") if status
               else "search status not recorded")
        length = (f"; levels of {cap['level_s']:g} s of arrivals"
                  + (f" (asked {cap['level_s_asked']:g})"
                     if cap.get("level_s_asked") not in (None, cap["level_s"]) else "")
                  if cap.get("level_s") else "")
        out.append(f"<h3>{_e(t.label)}: bracket {_e(bracket)}, {_e(how)}{_e(length)}</h3>")
        if cap.get("flat_misses_rps"):
            out.append(_note(flat_note(cap["flat_misses_rps"])))
        rows = []
        for i, lv in enumerate(cap["levels"], 1):
            ended = lv.get("finished")
            over = ", ".join(f"{k} {n}" for k, n in (lv.get("missed_by") or {}).items())
            notes = "; ".join(x for x in (
                "stopped early" if lv.get("stopped_early") else "",
                "a kernel compiled during it" if lv.get("jit_compiled") else "",
                "run again (failed while a kernel compiled)" if lv.get("reruns") else "") if x)
            rows.append([str(i), _e(_num(lv.get("offered_rps"))),
                         _e(_num(lv.get("busiest_rps")) if lv.get("busiest_rps") is not None
                            else "not recorded"),
                         "pass" if lv.get("passed") else "<b>fail</b>",
                         _e(_fmt(100 * (lv.get("goodput_fraction") or 0.0), ".1f") + " %"),
                         _e(_ended(ended, lv.get("offered"))),
                         _e(over or ("-" if ended is not None else "not recorded")),
                         _e(_fmt(lv.get("ttft_p99_s"), ".3f")),
                         _e(_fmt(lv.get("tpot_p99_s"), ".3f")),
                         _e(_fmt(lv.get("seconds"), ".0f")), _e(notes)])
        out.append(_table(["level", "req/s mean (scale x recorded)",
                           "req/s sent (busiest stretch)", "result", "within SLOs",
                           "ended / offered", "misses over", "TTFT p99 s", "TPOT p99 s",
                           "seconds", "note"],
                          rows))
    return "".join(out)


#: a capacity search's status, in words (the open ones: ``open_search_text``)
_STATUS = {"found": "within the tolerance", "levels": "its level budget spent",
           "time": "its time cap reached", "capped": "passed at its top scale",
           "none": "failed at its lowest scale"}


def _ended(ended: int | None, offered: int | None) -> str:
    """A level's "ended / offered" cell; levels stored before ``finished`` say so."""
    if offered is None:
        return "not recorded"
    return f"{ended} / {offered}" if ended is not None else f"not recorded / {offered}"


def _gpu_html(d: ReportData) -> str:
    if not d.gpu_time:
        return _note("not recorded: no trial recorded its times")
    total = sum(sum(x for k, x in v.items() if k != "compile_s") for v in d.gpu_time.values())
    start = sum(v.get("start_s", 0.0) for v in d.gpu_time.values())
    comp = sum(v.get("compile_s", 0.0) for v in d.gpu_time.values())
    what = ("of server time in all" if d.unit == "server" else
            "of GPU time in all (GPU-seconds: a trial on four GPUs counts four times its wall "
            "time)")
    text = (f"<p>{_dur(total)} {what}; server starts took "
            f"{_dur(start)} ({start / total:.0%})"
            + (f", of which vLLM compiling {_dur(comp)}" if comp else "")
            + ".</p>" if total > 0 else "")
    if d.gpu_time_source == "computed":
        text += _note("computed from each trial's start and wall times (start = server "
                      "start; measure = the rest of a measured trial, warm-up included; "
                      "other = the rest of a failed one): the study did not record "
                      "autotune.gpu_time")
    return text


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _header(d: ReportData) -> str:
    a = d.attrs
    meta = " | ".join(_e(x) for x in (
        f"model {a.get('autotune.model', 'not recorded')}",
        f"space {a.get('autotune.space', 'not recorded')}",
        f"{a.get('autotune.engine_version', 'engine version not recorded')} on "
        f"{a.get('autotune.gpu_type', 'a GPU not recorded')}",
        f"{len(d.trials)} trials ({len(d.feasible)} feasible, {len(d.infeasible)} infeasible, "
        f"{len(d.failed)} failed" + (f", {len(d.pruned)} pruned or screened" if d.pruned
                                      else "") + ")"
        + (f", {d.priors} prior" if d.priors else ""),
        f"storage {redact(d.storage)}",
        f"report written {datetime.now(UTC).isoformat(timespec='seconds')}",
    ))
    return (f"<header><h1>autotune study {_e(d.study_name)}</h1>"
            f'<div class="meta">{meta}</div></header>')


_TEXT: dict[str, Callable[[ReportData], str]] = {
    "verdict": _verdict_html, "shape": _shape_html, "failures": _failures_html,
    "latency": _latency_html, "capacity": _capacity_html, "gpu-time": _gpu_html,
    "cost": cost_html,
}

_WHY_NO_FIGURE = {
    "shape": lambda d: "",
    "history": lambda d: "no finished trials yet",
    "importance": lambda d: d.importance_note or "not available",
    "pareto": lambda d: ("not a Pareto study (--objective pareto gives one)"
                         if d.n_objectives != 2 else "no feasible trial: no front"),
    "latency": lambda d: "no measured trial: no latencies",
    "capacity": lambda d: ("" if any(t.capacity.get("levels") for t in d.trials) else
                           "not a capacity study (--objective capacity measures load levels)"),
    "failures": lambda d: "",
    "gpu-time": lambda d: "",
    "cost": why_no_cost,
}


def _titles(d: ReportData) -> dict[str, str]:
    """:data:`SECTIONS`, in the words of the study's hardware (the CPU build: no GPU)."""
    if d.unit == "server":
        return {**SECTIONS, "gpu-time": "Server-time account"}
    return dict(SECTIONS)


def render_html(d: ReportData) -> str:
    """The whole page as one string (plotly.js inlined in the first figure)."""
    import plotly.io as pio

    first = True
    body = []
    titles = _titles(d)
    for key, title in titles.items():
        parts = [f'<section id="{key}"><h2>{_e(title)}</h2>']
        if key in _TEXT:
            parts.append(_TEXT[key](d))
        make = FIGURES.get(key)
        fig = make(d) if make else None
        if fig is not None:
            parts.append(pio.to_html(fig, full_html=False, include_plotlyjs=first,
                                     div_id=f"plot-{key}",
                                     config={"displaylogo": False, "responsive": True}))
            first = False
        elif key in _WHY_NO_FIGURE and _WHY_NO_FIGURE[key](d):
            parts.append(_note(_WHY_NO_FIGURE[key](d)))
        parts.append("</section>")
        body.append("".join(parts))
    settings = json.dumps(d.settings, indent=2, sort_keys=True, default=str)
    nav = "".join(f'<a href="#{k}">{_e(v)}</a>' for k, v in titles.items())
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>autotune report: {_e(d.study_name)}</title><style>{_CSS}</style></head>"
        f"<body>{_header(d)}<nav>{nav}</nav><main>{''.join(body)}"
        f'<section id="config"><h2>Study config</h2><details><summary>the resolved '
        f"settings this study ran with</summary><pre>{_e(settings)}</pre></details></section>"
        "</main></body></html>\n"
    )


def write_html(d: ReportData, path: Path) -> Path:
    """Write the report atomically (temp file, then ``os.replace``); returns ``path``.
    Raises :class:`StudyError` when it cannot be written."""
    import os

    text = render_html(d)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise StudyError(f"cannot write the report {path}: {exc.strerror or exc}; free "
                         "space or choose another -o") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
