"""The stub server's config, counters and faults: a request asks for a fault by a token
of its prompt (``fault_token``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

logger = logging.getLogger(__name__)
FAULTS: tuple[str, ...] = (
    "ok",
    "http_400",
    "http_500",
    "disconnect",
    "stall",
    "slow",
    "malformed",
    "garbage",
    "error_event",
    "no_done",
    "no_usage",
)
FAULT_TOKEN_BASE = 900_000


def fault_token(name: str) -> int:
    """The prompt token id that makes the stub apply fault ``name`` to that request."""
    try:
        return FAULT_TOKEN_BASE + FAULTS.index(name)
    except ValueError:
        raise ValueError(f"unknown stub fault {name!r}; choose one of {FAULTS}") from None


@dataclass(frozen=True, slots=True)
class StubConfig:
    """How the stub streams. Zero delays mean "as fast as the client reads"."""

    model: str = "tiny"
    tokens_per_chunk: int = 1  # >1 emulates speculative decoding (several tokens a chunk)
    chunks_per_write: int = 1  # SSE events (HTTP chunks) coalesced into one socket write
    chunk_interval_s: float = 0.0  # time from one write to the next (paced on the clock)
    ttft_s: float = 0.0  # pause before the first token
    stall_s: float = 30.0  # how long a "stall" fault stays silent
    slow_interval_s: float = 0.05  # chunk interval of the "slow" fault
    interleave: bool = False  # yield after every write, as an engine step serves every stream
    # A known capacity (issue 15): at most this many requests stream at once, the rest wait
    # in a FIFO queue (as vLLM's --max-num-seqs); 0 = no limit. A request then takes
    # ttft_s + max_tokens x chunk_interval_s, so the stub serves at most
    # max_running / that many requests/s (:meth:`capacity_rps`); above it the queue, and
    # every request's time to first token, grows without bound.
    max_running: int = 0

    def capacity_rps(self, max_tokens: int) -> float:
        """Requests/s the stub sustains for requests of ``max_tokens`` tokens (inf: no limit)."""
        service_s = self.ttft_s + max_tokens * self.chunk_interval_s
        if self.max_running <= 0 or service_s <= 0:
            return float("inf")
        return self.max_running / service_s


@dataclass
class _Counters:
    generation_tokens: int = 0
    prompt_tokens: int = 0
    requests_success: int = 0
    running: int = 0
    waiting: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class _Msg(msgspec.Struct):
    content: str | None = None


class _Req(msgspec.Struct):
    model: str | None = None
    prompt: list[int] | str | None = None
    messages: list[_Msg] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, object] | None = None


_REQ_DECODER = msgspec.json.Decoder(_Req)


def _health_status() -> int:
    """The status ``/health`` answers (200; the fault suite's fake engine patches it to
    stand for an engine that died behind a live API server)."""
    return 200


def _fault_of(req: _Req) -> str:
    first: int | None = None
    if isinstance(req.prompt, list) and req.prompt:
        first = req.prompt[0]
    elif req.messages:
        words = (req.messages[0].content or "").split(maxsplit=1)
        if words and words[0].startswith("t") and words[0][1:].isdigit():
            first = int(words[0][1:])
    if first is not None and FAULT_TOKEN_BASE <= first < FAULT_TOKEN_BASE + len(FAULTS):
        return FAULTS[first - FAULT_TOKEN_BASE]
    return "ok"


def _prompt_len(req: _Req) -> int:
    if isinstance(req.prompt, list):
        return len(req.prompt)
    if isinstance(req.prompt, str):
        return len(req.prompt.split())
    return sum(len((m.content or "").split()) for m in req.messages or ())
