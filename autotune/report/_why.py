"""Why a study has no winner, in one paragraph a person can act on (the console summary,
study.json and the report all say the same)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from autotune.engine import classifying_lines

__all__ = ["explain_no_winner", "failure_summary", "one_line_message"]

#: what the study appends to a failed trial's message (the server log's tail)
LOG_TAIL_MARK = "\n--- server log tail ---"

_ERROR_HINTS = {
    "stalled": "requests got no bytes for many seconds: the server is saturated",
    "timeout": "requests ran past --request-timeout",
    "http_4xx": "the server refused requests (too long for --max-model-len, or 429)",
    "http_5xx": "the server answered with internal errors",
    "connection_refused": "the server stopped listening",
    "disconnected": "streams were cut mid-way",
}


def failure_summary(message: str, reason: str, limit: int = 300) -> str:
    """A failed trial's message in one line: its first line, plus the log line that named
    the failure (``error: unrecognized arguments: --x``), else the log's last line."""

    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines:
        return ""
    named = classifying_lines("\n".join(lines[1:]), reason, context=0, tail=False)
    key = named[0].strip() if named else (lines[-1] if len(lines) > 1 else "")
    head = lines[0]
    return (head if not key or key in head else f"{head.rstrip(':;,. ')}: {key}")[:limit]


def one_line_message(message: str, reason: str | None, limit: int) -> str:
    """A trial's message on one line for the console, trials.csv and MLflow tags: the log
    tail appended to failures left out, the log line that named the failure kept."""
    return failure_summary(message.split(LOG_TAIL_MARK, 1)[0], reason or "", limit)


class _Trial(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def request_errors(self) -> Mapping[str, int]: ...


def _span(xs: list[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else \
        f"{format(lo, fmt)}-{format(hi, fmt)}"


def _load(settings: Mapping[str, Any]) -> str:
    c = settings.get("concurrency")
    return f"--concurrency {c}" if c else "the shape's replay load (its 'load' section)"


def _errors_sentence(trials: list[_Trial], settings: Mapping[str, Any]) -> str:
    rates = [t.metrics["error_rate"] * 100 for t in trials if "error_rate" in t.metrics]
    kinds: Counter[str] = Counter()
    for t in trials:
        kinds.update({str(k): int(v) for k, v in t.request_errors.items() if isinstance(v, int)})
    limit = float(settings.get("max_error_rate", 0.05)) * 100
    out = (f"{_span(rates, '.0f')} % of requests failed (limit --max-error-rate "
           f"{limit:g} %)" if rates else "too many requests failed")
    if kinds:
        top, n = kinds.most_common(1)[0]
        total = sum(kinds.values())
        out += f", mostly {top} ({n / total:.0%} of the failures"
        out += f": {_ERROR_HINTS[top]})" if top in _ERROR_HINTS else ")"
    return (out + f". The offered load ({_load(settings)}) is beyond what these servers "
            "serve: try a lower --concurrency (or a shape with a lower --rate), a longer "
            "--request-timeout, or a bigger --max-error-rate if failures are acceptable")


def _slo_sentence(trials: list[_Trial], settings: Mapping[str, Any]) -> str:
    slo = settings.get("slo") or {}
    parts = []
    for key, limit in slo.items():
        got = [t.metrics[f"{key}_s"] for t in trials if f"{key}_s" in t.metrics]
        if got and max(got) > limit:
            parts.append(f"{key} {_span(got, '.3g')} s against --slo {key}={limit:g}")
    what = "; ".join(parts) or "the latency SLOs were missed"
    return (f"{what}. Loosen --slo, or lower the load ({_load(settings)}) so that requests "
            "queue less")


def explain_no_winner(trials: Iterable[_Trial], settings: Mapping[str, Any] | None = None
                      ) -> str:
    """One paragraph: what every trial ran into and what to try. ``trials`` are the study's
    own trials (the report's ``TrialRow``, or anything with state, reason, message, metrics
    and request_errors: failed requests by kind)."""
    settings = settings or {}
    trials = [t for t in trials if t.state != "running"]
    if not trials:
        return "no trial has finished yet"
    stopped = [t for t in trials if t.state in ("interrupted", "tuner_died", "stale")]
    counted = [t for t in trials if t not in stopped and t.state != "rejected"]
    if not counted:
        return (f"no trial finished: {len(stopped)} were stopped by the tuner's end and "
                f"{len(trials) - len(stopped)} samples broke the space's rules; continue with "
                "--resume")
    by_reason = Counter(t.reason or t.state for t in counted)
    n = len(counted)
    kinds = ", ".join(f"{r} ({c})" for r, c in by_reason.most_common())
    head = (f"all {n} trial{'s' if n != 1 else ''} "
            + ("infeasible" if all(t.state == "infeasible" for t in counted) else
               "failed or infeasible") + f" ({kinds}): ")
    top = by_reason.most_common(1)[0][0]
    group = [t for t in counted if (t.reason or t.state) == top]
    if top == "errors":
        return head + _errors_sentence(group, settings) + "."
    if top == "slo":
        return head + _slo_sentence(group, settings) + "."
    if top == "quality":
        return head + (f"{group[0].message}. Lossy knobs cost more accuracy than --quality "
                       f"{settings.get('quality')} allows: relax it, or fix those knobs to "
                       "their full-precision values in the space.")
    first = one_line_message(group[0].message, top, 300)
    fixes = {
        "invalid_config": "vLLM rejected the flags: check the space's fixed flags and knob "
                          "ranges against this vLLM version",
        "oom": "the server ran out of memory: lower --max-model-len/--max-num-seqs in the "
               "space, or raise --cpu-kv-cache-gib on a CPU host",
        "start_timeout": "servers did not answer /health in time: raise --start-timeout",
        "crash": "servers exited: read the log excerpt in report.html or OUT/logs/",
        "aborted": "the replay was stopped once most requests failed; the line says why "
                   "and what to change",
    }
    return head + f"the first says \"{first}\"; " + fixes.get(
        top, "see report.html (failures) or the server logs under OUT/logs/") + "."
