"""A rollout's settings, validated once (pydantic; unknown keys rejected, frozen)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from autotune.rollout._compare import METRICS
from autotune.rollout._plan import DEFAULT_STEPS, parse_steps

__all__ = ["RolloutSettings"]


class RolloutSettings(BaseModel):
    """What ``autotune rollout`` does; the CLI's options, one for one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    router: str
    old: tuple[str, ...] = ()  # empty: the router's workers when the rollout starts
    new: tuple[str, ...] = ()  # new servers already running (else the CLI's --start)
    steps: str = DEFAULT_STEPS
    metrics: tuple[str, ...] = METRICS
    tolerance: float = Field(0.10, ge=0.0)  # relative, on every latency metric
    error_tolerance: float = Field(0.01, ge=0.0)  # absolute, on the error fraction
    error_burst: int = Field(5, ge=1)  # this many new errors above the old rate: roll back
    min_requests: int = Field(30, ge=1)  # finished per side before a step is judged
    interval_s: float = Field(5.0, gt=0.0)  # scrape interval
    min_hold_s: float = Field(60.0, ge=0.0)  # a step is held at least this long
    step_timeout_s: float = Field(600.0, gt=0.0)  # undecided after this long: roll back
    drain_timeout_s: float = Field(600.0, gt=0.0)  # a removed server's requests finish
    stop_drained: str | None = None  # shell command for a drained server ({url})
    out: Path | None = None

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: str) -> str:
        parse_steps(v)
        return v

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [m for m in v if m not in METRICS]
        if bad or not v:
            raise ValueError(f"unknown metric {bad[0] if bad else '(none)'!r}; choose from "
                             + ", ".join(METRICS))
        return v

    @field_validator("router", "old", "new")
    @classmethod
    def _urls(cls, v: str | tuple[str, ...]) -> str | tuple[str, ...]:
        for u in (v,) if isinstance(v, str) else v:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"{u!r} is not a URL; use http://host:port")
        if isinstance(v, str):
            return v.rstrip("/")
        return tuple(u.rstrip("/") for u in v)
