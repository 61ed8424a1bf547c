"""The traffic-shape file format: pydantic models, frozen, unknown keys rejected.

A shape holds statistics of recorded traffic (lengths, arrivals, prefixes, sessions) plus a
``load`` section, the default way to replay it. The fingerprint covers the statistics only (see
:func:`compute_fingerprint` and docs/traffic.md). New fields are optional so old files load.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from itertools import pairwise
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "SHAPE_VERSION",
    "ArrivalStats",
    "ConcurrencyEstimate",
    "Correlation",
    "LengthDist",
    "LoadSpec",
    "Precision",
    "PrefixStats",
    "PrometheusRange",
    "SessionStats",
    "SourceInfo",
    "TrafficShape",
    "compute_fingerprint",
]

SHAPE_VERSION: Final = 1
N_QUANTILES: Final = 101
_FINGERPRINT_DIGITS: Final = 4
# the statistics the fingerprint covers; not name, load, source or version
_FINGERPRINT_FIELDS: Final = (
    "requests",
    "duration_s",
    "rate_rps",
    "input_tokens",
    "output_tokens",
    "correlation",
    "arrivals",
    "concurrency",
    "prefix",
)
# fingerprinted only when present, so that a shape without sessions keeps its fingerprint
_OPTIONAL_FINGERPRINT_FIELDS: Final = ("sessions",)
# keys of ``sessions`` added after it, fingerprinted only when set
_LATER_SESSION_KEYS: Final = ("shared_prefix",)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class LengthDist(_Model):
    """A token-length distribution: a compact summary plus 101 quantiles q0..q100 for sampling."""

    mean: float = Field(ge=0)
    std: float = Field(ge=0)
    min: float = Field(ge=0)
    p50: float = Field(ge=0)
    p90: float = Field(ge=0)
    p99: float = Field(ge=0)
    max: float = Field(ge=0)
    quantiles: list[float] = Field(min_length=N_QUANTILES, max_length=N_QUANTILES)

    @field_validator("quantiles")
    @classmethod
    def _non_decreasing(cls, q: list[float]) -> list[float]:
        if any(b < a for a, b in pairwise(q)):
            raise ValueError("quantiles must be non-decreasing (q0 <= q1 <= ... <= q100)")
        if q[0] < 0:
            raise ValueError("quantiles must be >= 0")
        return q

    @model_validator(mode="after")
    def _consistent(self) -> LengthDist:
        if not self.min <= self.p50 <= self.p90 <= self.p99 <= self.max:
            raise ValueError("need min <= p50 <= p90 <= p99 <= max")
        return self

    def summary(self) -> dict[str, float]:
        """mean, p50, p90, p99 and max, for ``show``."""
        return {k: getattr(self, k) for k in ("mean", "p50", "p90", "p99", "max")}


class LoadSpec(_Model):
    """How to replay a shape: closed loop (``concurrency`` streams) or open loop (a rate).

    ``rate_rps`` None = the recorded rate. ``time_scale`` multiplies open-loop send times
    (0.5 = twice as fast). ``requests`` is how many requests a replay sends; ``duration_s``
    optionally caps an open-loop schedule (a closed loop's cap is the load generator's job).
    """

    mode: Literal["closed", "open"] = "closed"
    concurrency: int | None = Field(default=None, ge=1)
    rate_rps: float | None = Field(default=None, gt=0)
    time_scale: float = Field(default=1.0, gt=0)
    requests: int = Field(default=100, ge=1)
    duration_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _closed_needs_streams(self) -> LoadSpec:
        if self.mode == "closed" and self.concurrency is None:
            raise ValueError("a closed-loop load needs 'concurrency' (the number of streams)")
        return self


class Correlation(_Model):
    """How input and output lengths move together (None when undefined, e.g. constant)."""

    spearman: float | None = Field(default=None, ge=-1, le=1)
    pearson_log: float | None = Field(default=None, ge=-1, le=1)


class ArrivalStats(_Model):
    """The arrival process: rate over time and burstiness.

    ``interarrival_cv``: std/mean of the gaps between arrivals (1 = Poisson); it is
    dominated by rounding when timestamps are quantised (see ``zero_gap_fraction``).
    ``dispersion_60s``: var/mean of the counts per 60 s window (1 = Poisson), honest on
    quantised timestamps. ``rate_profile``: requests/s in consecutive ``window_s`` windows.
    """

    interarrival_cv: float | None = Field(default=None, ge=0)
    dispersion_60s: float | None = Field(default=None, ge=0)
    zero_gap_fraction: float = Field(default=0.0, ge=0, le=1)
    peak_rate_rps: float = Field(default=0.0, ge=0)
    window_s: float = Field(default=60.0, gt=0)
    rate_profile: list[float] = Field(default_factory=list)

    @field_validator("rate_profile")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        if any(x < 0 for x in v):
            raise ValueError("rate_profile values must be >= 0")
        return v


class ConcurrencyEstimate(_Model):
    """Requests in flight on average. ``method``: 'latency' (Little's law with the logged
    latencies) or 'assumed_latency' (Little's law with latency = input/assumed_prefill_tps
    + output * assumed_tpot_s, a reference server; see docs/traffic.md)."""

    mean: float = Field(ge=0)
    method: Literal["latency", "assumed_latency"]
    mean_latency_s: float = Field(ge=0)
    assumed_tpot_s: float | None = Field(default=None, gt=0)
    assumed_prefill_tps: float | None = Field(default=None, gt=0)


class PrefixStats(_Model):
    """Prefix sharing. ``shared_token_fraction``: share of all prompt tokens a perfect prefix
    cache would serve (order-independent). ``sharing_request_fraction``: share of requests
    whose prompt starts with tokens another request has too. ``shared_prefix_ratio``:
    distribution of (shared leading tokens / prompt tokens) among those requests."""

    source: Literal["hash_ids", "session", "prefix_id", "server_cache"]
    block_tokens: int | None = Field(default=None, ge=1)
    shared_token_fraction: float = Field(ge=0, le=1)
    sharing_request_fraction: float = Field(ge=0, le=1)
    groups: int = Field(ge=0)
    mean_group_size: float = Field(ge=0)
    shared_prefix_tokens: LengthDist | None = None
    shared_prefix_ratio: list[float] | None = Field(
        default=None, min_length=N_QUANTILES, max_length=N_QUANTILES
    )


class SessionStats(_Model):
    """Conversations and agent sessions: which requests are turns of one session.

    A session is a chain (or tree) of turns, each turn linked to the one it follows (its
    parent). ``source`` says how the links were found: ``session_id`` (an OpenAI request
    log's ``session_id``; turns follow each other in time), ``parent_id`` (a multi-turn trace's
    ``parent_chat_id``) or ``hash_ids`` (a request whose prefix blocks extend an earlier
    request's whole block list is that request's next turn).

    ``turns``: turns per session (a request with no session is a session of one turn).
    ``rate_sps``: sessions started per second. ``first_turn_tokens``: a first turn's prompt.
    ``new_tokens``: per follow-up turn, prompt tokens beyond the parent's prompt and answer.
    ``context_growth``: per follow-up turn, prompt tokens beyond the parent's prompt.
    ``context_by_turn``: mean prompt tokens at turn 1, 2, ... (at most 32 turns).
    ``think_time_s``: per follow-up turn, its arrival minus the moment its parent's answer
    came back (``think_time_basis`` ``answer``, when the trace logs latencies) or minus its
    parent's arrival (``arrival``, when it does not: the gap then includes the answer's own
    time); a turn sent before its parent's answer counts 0 here and in ``in_flight_fraction``.
    ``quick_chain_fraction``: share of follow-up turns with think time under 1 s (agents
    chaining calls). ``in_flight_fraction``: share sent while the parent's answer was still
    being generated (None without latencies). ``fanout_fraction``: among the turns that have a
    next turn, the share with two or more (an agent fanning out); ``max_fanout``: the most
    next turns of one turn.
    ``session_span_s``: first to last arrival of a multi-turn session.
    """

    source: Literal["session_id", "parent_id", "hash_ids"]
    sessions: int = Field(ge=1)
    rate_sps: float = Field(ge=0)
    multi_turn_fraction: float = Field(ge=0, le=1)
    turns: LengthDist
    first_turn_tokens: LengthDist
    new_tokens: LengthDist | None = None
    context_growth: LengthDist | None = None
    context_by_turn: list[float] = Field(default_factory=list, max_length=32)
    think_time_s: LengthDist | None = None
    think_time_basis: Literal["answer", "arrival"] = "arrival"
    quick_chain_fraction: float | None = Field(default=None, ge=0, le=1)
    in_flight_fraction: float | None = Field(default=None, ge=0, le=1)
    fanout_fraction: float = Field(default=0.0, ge=0, le=1)
    max_fanout: int = Field(default=0, ge=0)
    session_span_s: LengthDist | None = None
    # prefixes sessions share with other sessions (a common system prompt or document):
    # the sharing of the sessions' first turns among themselves (None: the trace has no
    # blocks or prefix ids to tell, or a shape fitted before it was kept)
    shared_prefix: PrefixStats | None = None

    def summary(self) -> dict[str, object]:
        """The headline numbers, for ``show``."""
        def mean(d: LengthDist | None) -> float | None:
            return d.mean if d is not None else None

        def p50(d: LengthDist | None) -> float | None:
            return d.p50 if d is not None else None

        return {
            "source": self.source,
            "sessions": self.sessions,
            "rate_sps": self.rate_sps,
            "multi_turn_fraction": self.multi_turn_fraction,
            "turns_mean": self.turns.mean,
            "turns_max": self.turns.max,
            "first_turn_tokens_mean": self.first_turn_tokens.mean,
            "new_tokens_mean": mean(self.new_tokens),
            "context_growth_mean": mean(self.context_growth),
            "think_time_s_p50": p50(self.think_time_s),
            "think_time_s_mean": mean(self.think_time_s),
            "think_time_basis": self.think_time_basis,
            "quick_chain_fraction": self.quick_chain_fraction,
            "in_flight_fraction": self.in_flight_fraction,
            "fanout_fraction": self.fanout_fraction,
            "max_fanout": self.max_fanout,
            "shared_across_sessions_fraction": (self.shared_prefix.shared_token_fraction
                                                if self.shared_prefix else None),
        }


class Precision(_Model):
    """How coarse a shape's statistics are, where they are coarser than a request log's.

    ``input_tokens`` / ``output_tokens``: a bound on the Wasserstein-1 distance between the
    true length distribution and the stored one, relative to its mean (the unit of
    ``shape diff``'s length distance, which widens its threshold by it). 0 = exact.
    ``rate``: a bound on the relative error of ``rate_rps`` (counts from Prometheus'
    ``increase()``, extrapolated to the range's ends); ``diff`` widens its rate threshold by
    ``log2(1 + rate)``. None = exact.
    """

    input_tokens: float = Field(default=0.0, ge=0)
    output_tokens: float = Field(default=0.0, ge=0)
    rate: float | None = Field(default=None, ge=0)
    note: str | None = None


class PrometheusRange(_Model):
    """Which traffic a shape from Prometheus describes: the server, the label selector, the
    range (unix seconds and ISO 8601), the window of the arrival counts and the PromQL
    queries that read it (``shape diff`` and ``watch`` compare like with like by it)."""

    url: str
    selector: str = ""
    start: float
    end: float
    start_iso: str
    end_iso: str
    window_s: float = Field(gt=0)
    replicas: int = Field(default=0, ge=0)
    queries: dict[str, str] = Field(default_factory=dict)


class SourceInfo(_Model):
    """Where the statistics came from (not part of the fingerprint)."""

    path: str | None = None
    format: str | None = None
    skipped_lines: int = Field(default=0, ge=0)
    failed_requests: int = Field(default=0, ge=0)
    note: str | None = None
    prometheus: PrometheusRange | None = None


class TrafficShape(_Model):
    """A fitted traffic shape. Save with :func:`save_shape`, load with :func:`load_shape`.

    ``rate_rps`` and ``duration_s`` are 0 for a synthetic shape without arrival times.
    """

    version: int = Field(default=SHAPE_VERSION, ge=1)
    name: str = Field(min_length=1)
    fingerprint: str
    requests: int = Field(ge=1)
    duration_s: float = Field(ge=0)
    rate_rps: float = Field(ge=0)
    input_tokens: LengthDist
    output_tokens: LengthDist
    correlation: Correlation | None = None
    arrivals: ArrivalStats | None = None
    concurrency: ConcurrencyEstimate | None = None
    prefix: PrefixStats | None = None
    sessions: SessionStats | None = None
    source: SourceInfo | None = None
    precision: Precision | None = None
    load: LoadSpec

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v > SHAPE_VERSION:
            raise ValueError(
                f"shape format version {v} is newer than this autotune understands "
                f"({SHAPE_VERSION}); upgrade autotune"
            )
        return v

    def summary(self) -> dict[str, Any]:
        """The headline numbers (what ``autotune shape show --json`` prints)."""
        out: dict[str, Any] = {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "requests": self.requests,
            "duration_s": self.duration_s,
            "rate_rps": self.rate_rps,
            "input_tokens": self.input_tokens.summary(),
            "output_tokens": self.output_tokens.summary(),
            "correlation_spearman": self.correlation.spearman if self.correlation else None,
            "interarrival_cv": self.arrivals.interarrival_cv if self.arrivals else None,
            "dispersion_60s": self.arrivals.dispersion_60s if self.arrivals else None,
            "peak_rate_rps": self.arrivals.peak_rate_rps if self.arrivals else None,
            "concurrency": self.concurrency.mean if self.concurrency else None,
            "prefix_shared_token_fraction": (
                self.prefix.shared_token_fraction if self.prefix else None
            ),
            "load": self.load.model_dump(),
        }
        if self.sessions is not None:
            out["sessions"] = self.sessions.summary()
        if self.source is not None:
            out["source"] = self.source.model_dump()
        if self.precision is not None:
            out["precision"] = self.precision.model_dump()
        return out

    def with_load(self, load: LoadSpec) -> TrafficShape:
        """The same traffic with another replay default (the fingerprint is unchanged)."""
        return self.model_copy(update={"load": load})


def _canonical(value: object) -> object:
    """Round floats to 4 significant digits, recursively, so tiny float noise is ignored."""
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return 0.0
        r = float(f"{value:.{_FINGERPRINT_DIGITS}g}")
        return int(r) if r == int(r) and abs(r) < 2**53 else r
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    raise TypeError(f"cannot fingerprint a {type(value).__name__}")


def compute_fingerprint(stats: Mapping[str, object]) -> str:
    """``sha256`` of the canonical JSON of the statistics, first 16 hex digits.

    ``stats`` is a (partial) model dump; only the fingerprinted keys are used, so a whole
    ``TrafficShape.model_dump()`` works too. Floats are rounded to 4 significant digits
    and whole floats written as integers, keys sorted, None kept; a section added to the
    format later (``sessions``) counts only when present, so older shapes keep theirs.
    """
    canon = {k: _canonical(stats.get(k)) for k in _FINGERPRINT_FIELDS}
    for k in _OPTIONAL_FINGERPRINT_FIELDS:
        if stats.get(k) is not None:
            canon[k] = _canonical(stats[k])
    later = canon.get("sessions")
    if isinstance(later, dict):  # a later key, absent: the fingerprint it had before
        canon["sessions"] = {k: v for k, v in later.items()
                             if not (k in _LATER_SESSION_KEYS and v is None)}
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
