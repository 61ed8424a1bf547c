"""Comparing a candidate's outputs with the reference's; user thresholds as a constraint."""

from __future__ import annotations

import logging
import math
import re
from typing import Final, TypedDict, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autotune.errors import AutotuneError, ConfigError
from autotune.quality._client import ProbeOutputs

logger = logging.getLogger(__name__)


#: Threshold keys of :func:`parse_quality` and what each bounds.
QUALITY_KEYS: Final[dict[str, str]] = {
    "min_agreement": "least share of prompts whose greedy continuation equals the "
    "reference's exactly (0..1)",
    "max_logprob_diff": "largest mean |logprob difference| on the shared prefix (nats, >= 0)",
    "min_divergence_p10": "least 10th percentile of the first-divergence position (tokens)",
}


# ---------------------------------------------------------------------------------------------
# Comparing outputs


class QualityRecord(TypedDict):
    """``QualityReport`` as a trial returns and stores it (``TrialOutcome.quality``, the
    ``autotune.quality`` attribute): the same keys as the model's fields."""

    n_prompts: int
    exact_match_rate: float
    first_divergence_mean: float
    first_divergence_p10: float
    mean_abs_logprob_diff: float | None
    max_abs_logprob_diff: float | None
    output_tokens: float
    shared_tokens: int


class QualityReport(BaseModel):
    """How far a candidate's greedy outputs are from the reference's.

    ``exact_match_rate``: share of prompts whose continuation is identical (same tokens,
    same length). ``first_divergence_*``: per prompt, the index of the first differing
    token (a prompt that matches exactly counts its full length; one that is a prefix of
    the other diverges where the shorter ends). ``mean_abs_logprob_diff``: mean
    |logprob_ref - logprob_candidate| over the tokens before each prompt's first divergence
    (None when there is no such token with finite logprobs on both sides).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_prompts: int
    exact_match_rate: float
    first_divergence_mean: float
    first_divergence_p10: float
    mean_abs_logprob_diff: float | None
    max_abs_logprob_diff: float | None
    output_tokens: float  # mean reference continuation length (what divergence is out of)
    shared_tokens: int  # tokens that entered the logprob difference

    def record(self) -> QualityRecord:
        """The JSON form a trial returns (``TrialOutcome.quality``)."""
        return cast(QualityRecord, self.model_dump(mode="json"))

    def flat(self) -> dict[str, float]:
        """Finite figures as floats named ``quality_<field>`` (trial metrics, MLflow)."""
        out = {f"quality_{k}": v for k, v in self.model_dump().items()}
        return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}


def compare(reference: ProbeOutputs, candidate: ProbeOutputs) -> QualityReport:
    """Compare ``candidate`` with ``reference`` (outputs of the same probe)."""
    if reference.probe_digest != candidate.probe_digest:
        raise AutotuneError(
            f"quality: the outputs come from different probes (reference "
            f"{reference.probe_digest[:12]}, candidate {candidate.probe_digest[:12]}); run "
            "the candidate with the probe the reference was made with"
        )
    n = len(reference.token_ids)
    if n == 0 or len(candidate.token_ids) != n:
        raise AutotuneError(
            f"quality: cannot compare {len(candidate.token_ids)} candidate outputs with "
            f"{n} reference outputs; both need the same, non-zero number of prompts"
        )
    exact = 0
    div: list[int] = []
    diffs: list[float] = []
    for ra, ca, rl, cl in zip(reference.token_ids, candidate.token_ids, reference.logprobs,
                              candidate.logprobs, strict=True):  # fmt: skip
        m = min(len(ra), len(ca))
        d = next((j for j in range(m) if ra[j] != ca[j]), m)
        div.append(d)
        exact += int(d == len(ra) == len(ca))
        for j in range(d):
            a, b = rl[j], cl[j]
            if a is not None and b is not None:
                diffs.append(abs(a - b))
    d_arr = np.asarray(div, dtype=np.float64)
    return QualityReport(
        n_prompts=n,
        exact_match_rate=exact / n,
        first_divergence_mean=float(d_arr.mean()),
        first_divergence_p10=float(np.percentile(d_arr, 10)),
        mean_abs_logprob_diff=float(np.mean(diffs)) if diffs else None,
        max_abs_logprob_diff=float(np.max(diffs)) if diffs else None,
        output_tokens=float(np.mean([len(t) for t in reference.token_ids])),
        shared_tokens=len(diffs),
    )


# ---------------------------------------------------------------------------------------------
# Thresholds


class QualityThresholds(BaseModel):
    """Bounds a config must meet (None = not bounded); see :data:`QUALITY_KEYS`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_agreement: float | None = Field(default=None, ge=0, le=1)
    max_logprob_diff: float | None = Field(default=None, ge=0)
    min_divergence_p10: float | None = Field(default=None, ge=0)

    def is_empty(self) -> bool:
        return all(v is None for v in self.model_dump().values())


def parse_quality(text: str) -> QualityThresholds:
    """Parse ``"min_agreement=0.95,max_logprob_diff=0.05"`` (comma- or space-separated).

    Keys: see :data:`QUALITY_KEYS`. Raises :class:`ConfigError` naming the bad part.
    """
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise ConfigError(
            f"--quality {text!r} is empty; give KEY=VALUE pairs such as "
            "'min_agreement=0.95' (keys: " + ", ".join(QUALITY_KEYS) + ")"
        )
    values: dict[str, float] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise ConfigError(f"--quality: {part!r} is not KEY=VALUE (e.g. 'min_agreement=0.95')")
        if key not in QUALITY_KEYS:
            raise ConfigError(
                f"--quality: unknown key {key!r}; use one of " + ", ".join(QUALITY_KEYS)
            )
        if key in values:
            raise ConfigError(f"--quality: {key!r} is given twice; give each key once")
        try:
            v = float(raw)
        except ValueError:
            raise ConfigError(f"--quality: {key}={raw!r} is not a number") from None
        if not math.isfinite(v):
            raise ConfigError(f"--quality: {key}={raw!r} must be a finite number")
        values[key] = v
    try:
        return QualityThresholds(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err.get("loc") else "?"
        raise ConfigError(
            f"--quality: {key}={values.get(key)!r} is out of range ({err['msg']}); "
            f"{key} is the {QUALITY_KEYS.get(key, key)}"
        ) from None


def quality_violation(report: QualityReport, thresholds: QualityThresholds) -> float:
    """An Optuna constraint value: 0 when every bound holds, else the summed shortfall (> 0).

    Shortfalls are relative to each bound, so the magnitudes add up: e.g. an agreement of
    0.80 against ``min_agreement=0.95`` gives 0.158. A logprob bound with no shared token to
    measure (every prompt diverged at once) counts as violated by 1.
    """
    v = 0.0
    t = thresholds
    if t.min_agreement is not None and report.exact_match_rate < t.min_agreement:
        v += (t.min_agreement - report.exact_match_rate) / max(t.min_agreement, 1e-9)
    if t.max_logprob_diff is not None:
        diff = report.mean_abs_logprob_diff
        if diff is None:
            v += 1.0
        elif diff > t.max_logprob_diff:
            v += (diff - t.max_logprob_diff) / max(t.max_logprob_diff, 1e-3)
    if t.min_divergence_p10 is not None and report.first_divergence_p10 < t.min_divergence_p10:
        v += (t.min_divergence_p10 - report.first_divergence_p10) / max(t.min_divergence_p10, 1e-9)
    return float(v)
