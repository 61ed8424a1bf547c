"""The measurement records: SLOs, percentiles and a trial's ``Measurement``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal, TypedDict, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from autotune.measure._stats import drift


class Slo(BaseModel):
    """Per-request latency thresholds for goodput (None: no limit on that figure)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @field_validator("ttft_s", "tpot_s", "e2e_s")
    @classmethod
    def _positive(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"an SLO threshold must be a finite number of seconds > 0, got {v}")
        return v

    def met_by(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        """True when every set threshold is met (a figure that does not exist is not judged)."""
        return not self.missed_by(ttft, tpot, e2e)

    def missed_by(self, ttft: float | None, tpot: float | None, e2e: float | None
                  ) -> tuple[str, ...]:
        """The thresholds these figures exceed ("ttft", "tpot", "e2e"), in that order."""
        return tuple(name for name, lim, v in (("ttft", self.ttft_s, ttft),
                                               ("tpot", self.tpot_s, tpot),
                                               ("e2e", self.e2e_s, e2e))
                     if lim is not None and v is not None and v > lim)



def goodput_slo(limits: Mapping[str, float]) -> Slo | None:
    """Per-request goodput thresholds from SLO limits (``{"ttft_p99": 2.0, ...}``, the
    ``--slo`` keys: ttft, tpot and e2e count; None without any)."""
    if not limits:
        return None
    pick: dict[str, float | None] = {"ttft_s": None, "tpot_s": None, "e2e_s": None}
    for key, limit in limits.items():
        kind = key.split("_")[0]
        if f"{kind}_s" in pick:
            pick[f"{kind}_s"] = limit
    return Slo(**pick)


class Percentiles(BaseModel):
    """Mean and percentiles of one latency figure, in seconds (None: no data)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Percentiles:
        """Linear-interpolated percentiles of the finite values."""
        arr = np.fromiter((v for v in values if v is not None and math.isfinite(v)), float)
        if arr.size == 0:
            return cls()
        p50, p90, p99 = np.percentile(arr, [50.0, 90.0, 99.0])
        return cls(mean=float(arr.mean()), p50=float(p50), p90=float(p90), p99=float(p99))


class PercentilesRecord(TypedDict):
    """``Percentiles`` as stored (``Measurement.record()``): the same keys."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


class MeasurementRecord(TypedDict):
    """``Measurement`` as a trial returns and stores it (``TrialOutcome.measurement``,
    bench's JSON): its JSON dump, tuples as lists; the same keys as the model's fields."""

    output_tokens_per_s: float | None
    requests_per_s: float | None
    goodput_rps: float | None
    error_rate: float | None
    n_requests: int
    n_ok: int
    n_errors: int
    errors: dict[str, int]
    window_s: float | None
    window_start_s: float | None
    window_end_s: float | None
    window_rule: Literal["steady", "whole_run", "none", "repeats"]
    n_latency: int
    ttft_s: PercentilesRecord
    tpot_s: PercentilesRecord
    itl_s: PercentilesRecord
    e2e_s: PercentilesRecord
    cv: float | None
    cv_kind: Literal["subwindows", "repeats"] | None
    repeats: int
    repeat_tokens_per_s: list[float]
    repeat_server: list[dict[str, float]]
    repeat_segments: list[int]
    total_output_tokens: int
    server: dict[str, float]
    output_tokens_per_s_ci_low: float | None
    output_tokens_per_s_ci_high: float | None
    segment_tokens_per_s: list[float]
    segment_kind: Literal["segments", "subwindows"] | None
    ci_method: str | None
    interval_note: str
    sessions: dict[str, float]


class Measurement(BaseModel):
    """What one run (or the median of repeats) measured. None means "could not be measured"."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    output_tokens_per_s: float | None
    requests_per_s: float | None
    goodput_rps: float | None
    error_rate: float | None
    n_requests: int
    n_ok: int
    n_errors: int
    errors: dict[str, int]
    window_s: float | None
    window_start_s: float | None = None
    window_end_s: float | None = None
    window_rule: Literal["steady", "whole_run", "none", "repeats"] = "steady"
    n_latency: int = 0  # requests the latency percentiles are over
    ttft_s: Percentiles = Percentiles()
    tpot_s: Percentiles = Percentiles()
    itl_s: Percentiles = Percentiles()
    e2e_s: Percentiles = Percentiles()
    cv: float | None = None
    cv_kind: Literal["subwindows", "repeats"] | None = None
    repeats: int = 1
    repeat_tokens_per_s: tuple[float, ...] = ()
    # each repeat's own server figures (step_ms, ...): the median in ``server`` hides
    # whether repeats on one server ran at different engine speeds
    repeat_server: tuple[dict[str, float], ...] = ()
    # how many of ``segment_tokens_per_s`` each repeat measured, in order (a repeat's own
    # segments: did it climb, how noisy was it?)
    repeat_segments: tuple[int, ...] = ()
    total_output_tokens: int = 0
    server: dict[str, float] = Field(default_factory=dict)
    # 95 % interval of output_tokens_per_s: t-interval over the segment rates (batch
    # means), its half-width placed around output_tokens_per_s
    output_tokens_per_s_ci_low: float | None = None
    output_tokens_per_s_ci_high: float | None = None
    segment_tokens_per_s: tuple[float, ...] = ()
    segment_kind: Literal["segments", "subwindows"] | None = None
    # how the interval was made (autotune.intervals.rate_interval): "t", "log-t" (skewed
    # segments), "bootstrap" (skewed, a segment served nothing); None without one
    ci_method: str | None = None
    # an open loop whose segments' spread follows its arrivals says so (arrivals_note)
    interval_note: str = ""
    # a session replay's figures (autotune.measure._sessions.session_figures): TTFT by
    # turn, per-session latency; {} for independent requests
    sessions: dict[str, float] = Field(default_factory=dict)

    def record(self) -> MeasurementRecord:
        """The JSON form a trial returns (``TrialOutcome.measurement``)."""
        return cast(MeasurementRecord, self.model_dump(mode="json"))

    def flat(self) -> dict[str, float]:
        """Finite floats for trackers: throughputs, counts, pXX of each latency, cv,
        window_s, ``server_*`` and ``session_*``; a figure that is None or not finite is
        left out."""
        out: dict[str, float | int | None] = {
            "output_tokens_per_s": self.output_tokens_per_s,
            "output_tokens_per_s_ci_low": self.output_tokens_per_s_ci_low,
            "output_tokens_per_s_ci_high": self.output_tokens_per_s_ci_high,
            "requests_per_s": self.requests_per_s,
            "goodput_rps": self.goodput_rps,
            "error_rate": self.error_rate,
            "n_requests": self.n_requests,
            "n_errors": self.n_errors,
        }
        for name in ("ttft", "tpot", "itl", "e2e"):
            p: Percentiles = getattr(self, f"{name}_s")
            out[f"{name}_p50_s"] = p.p50
            out[f"{name}_p90_s"] = p.p90
            out[f"{name}_p99_s"] = p.p99
        out["cv"] = self.cv
        out["window_s"] = self.window_s
        out["segments"] = len(self.segment_tokens_per_s) or None
        d = drift(self.segment_tokens_per_s) if self.segment_kind == "segments" else None
        if d is not None:  # the second half's mean rate over the first's, less 1
            out["output_tokens_per_s_drift"] = d.relative
        for k, v in self.server.items():
            out[f"server_{k}"] = v
        for k, v in self.sessions.items():
            out[f"session_{k}"] = v
        return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}
