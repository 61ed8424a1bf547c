"""What the load generator records: one record per request, a run's result, the
failure classes of a request and the abort rule that ends a run that only fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from autotune.errors import clip_command
from autotune.load._server_metrics import ServerSnapshot

if TYPE_CHECKING:

    from autotune.traffic import RequestSpec

logger = logging.getLogger(__name__)
ERROR_REASONS: tuple[str, ...] = (
    "http_4xx",  # the server answered 4xx (bad request, model unknown, context too long, 429)
    "http_5xx",  # the server answered 5xx
    "http_other",  # any other non-200 status
    "connection_refused",  # nothing listens on the port (server down or crashed)
    "connect_error",  # any other failure to connect
    "disconnected",  # the connection dropped mid-stream, or the stream ended before [DONE]
    "timeout",  # the whole request took longer than request_timeout_s
    "stalled",  # no bytes for stall_timeout_s (before the headers or between chunks)
    "malformed_sse",  # a line that is not SSE, or a data event that is not a valid chunk
    "server_error",  # the server sent an in-stream error object (vLLM: data: {"error": ...})
    "client_error",  # any other HTTP client failure
)
Api = Literal["completions", "chat"]
_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "text/event-stream",
    "User-Agent": "autotune-loadgen",
}
_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds from the run's start (monotonic)."""

    index: int
    send_s: float
    first_token_s: float | None
    end_s: float | None
    chunk_times_s: tuple[float, ...]
    chunk_tokens: tuple[int, ...]
    prompt_tokens: int | None
    output_tokens: int
    ok: bool
    error: str | None
    detail: str | None
    status: int | None
    sent_prompt_tokens: int = 0  # the prompt length the schedule asked for (its token ids)
    session: int | None = None  # a session replay: the session and the turn (0 = first)
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class RunResult:
    """All records of one run, in schedule order, plus how the run was driven."""

    records: tuple[RequestRecord, ...]
    started_at: float  # time.time() at the run's start
    wall_s: float
    mode: Literal["open", "closed"] = "closed"
    concurrency: int | None = None
    api: Api = "completions"
    snapshots: tuple[ServerSnapshot, ...] = ()  # /metrics samples taken during the run
    stopped_at_s: float | None = None  # a SegmentControl stopped the sends at this time
    aborted: str | None = None  # why the run was stopped early (the abort hook's line)
    # ``interrupt`` was set at this time: the sends stopped and the requests in flight were
    # cancelled (their records are missing); every token that arrived before
    # ``complete_before_s`` (the earliest send among them) belongs to a recorded request
    interrupted_at_s: float | None = None
    complete_before_s: float | None = None


class SegmentControl(Protocol):
    """Watches a closed-loop run in segments and decides when to stop sending.

    ``on_segment(t_s, tokens, failed)`` is called on the event loop (keep it quick) each
    time ``segment_requests`` more requests have finished: ``t_s`` is the time from the
    run's start, ``tokens`` the output tokens received so far by successful or in-flight
    requests, ``failed`` the requests failed so far. Returning True stops the sends;
    requests in flight finish (their latencies count) and the run ends.
    """

    segment_requests: int

    def on_segment(self, t_s: float, tokens: int, failed: int) -> bool: ...


def staggered(first: Sequence[RequestSpec], streams: int) -> list[RequestSpec]:
    """The first request of each closed-loop stream with its output shortened to
    (k + 1) / streams of its length, so that streams that start together do not end
    together: with equal lengths they would stay in lockstep (waves of prefills, then
    decodes), and throughput would oscillate with the waves. Only the first request of a
    stream changes; what follows is the shape's own traffic."""
    n = max(1, min(streams, len(first)))
    return [replace(s, max_tokens=max(1, round(s.max_tokens * (k + 1) / n))) if k < n else s
            for k, s in enumerate(first)]


#: An abort condition: called after each finished request with that record and the counts
#: of finished and failed requests so far; a returned line stops the run (requests not yet
#: finished are cancelled and left out of the records). A hook with a ``tick(now)`` method
#: is also asked about once a second (``now``: seconds of run time), so that a time cap
#: holds while no request finishes (a server far behind its arrivals).
Abort = Callable[[RequestRecord, int, int], str | None]


_CONTEXT_HINT = ("maximum context length", "max_model_len", "max-model-len",
                 "context length", "too long")


def _context_of(detail: str) -> int | None:
    """The context length a server's 4xx names ("maximum context length is 1024 tokens")."""
    import re

    m = re.search(r"(?:context length|max_model_len)\D{0,20}(\d+)", detail)
    return int(m.group(1)) if m else None


def served_scale(done: int, failed: int) -> float:
    """A rate scale the server would likely serve, from a run where ``failed`` of ``done``
    requests failed: the share it served, less a fifth, at 2 significant figures (at
    least 0.01)."""
    share = max(0.0, (done - failed) / done) if done > 0 else 0.0
    return max(0.01, float(f"{share * 0.8:.2g}"))


def failure_abort(*, min_requests: int = 20, max_failed_fraction: float = 0.5,
                  shape_path: str | Path | None = None,
                  context: int | None = None) -> Abort:
    """Stop a run once more than ``max_failed_fraction`` of at least ``min_requests``
    finished requests failed, with the likely cause in one line: prompts beyond the
    context (4xx naming it), or an offered load beyond what the server serves.
    ``shape_path``: the replayed shape's file and ``context``: the server's context
    length (when the 4xx does not name it), so that the clip command the line suggests
    runs as printed (:func:`clip_command`)."""
    errors: dict[str, int] = {}
    hits = [0]  # failures whose 4xx names the context
    ctx_at = [context]  # the context length, as the 4xx names it

    def check(rec: RequestRecord, done: int, failed: int) -> str | None:
        if rec.error is not None:
            errors[rec.error] = errors.get(rec.error, 0) + 1
            if rec.error == "http_4xx" and rec.detail and any(
                h in rec.detail.lower() for h in _CONTEXT_HINT
            ):
                hits[0] += 1
                ctx_at[0] = _context_of(rec.detail) or ctx_at[0]
        if done < min_requests or failed <= max_failed_fraction * done:
            return None
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(errors.items(), key=lambda kv: -kv[1]))
        head = f"stopped after {failed} of {done} requests failed ({kinds})"
        if hits[0] * 2 >= failed:
            ctx = ctx_at[0]
            clip = (f"({clip_command(shape_path, context=ctx)})"
                    if shape_path is not None and ctx is not None
                    else "(clip the shape's file with 'autotune shape clip' and "
                         "--max-total-tokens set to the server's context)")
            return (f"{head}: prompts + outputs beyond the server's "
                    f"{f'{ctx}-token ' if ctx is not None else ''}context; raise "
                    "--max-model-len in the space (up to the model's max_position_embeddings) "
                    f"or clip the shape's lengths {clip}")
        gone = sum(errors.get(k, 0) for k in ("connection_refused", "connect_error",
                                               "disconnected"))
        if gone >= failed / 2:
            return f"{head}: the server stopped answering"
        if errors.get("timeout", 0) + errors.get("stalled", 0) < failed / 2:
            return (f"{head}: the server rejects or fails the requests; its log says why "
                    "(the trial's server log)")
        scale = served_scale(done, failed)
        lower = (clip_command(shape_path, rate_scale=scale) if shape_path is not None
                 else f"'autotune shape clip' of the shape's file with --rate-scale {scale:g}")
        return (f"{head}: the offered load is beyond what this server serves; lower the rate "
                f"({lower}: {done - failed} of {done} were served) or cap the requests in "
                "flight (--concurrency, a closed loop of that many streams)")

    return check
