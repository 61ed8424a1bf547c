"""A :class:`TrialSpec` from flat keys, for tests that build trials by hand."""

from __future__ import annotations

from typing import Any

from autotune.config import MEASURE_KEYS, MeasureSettings
from autotune.trial import TrialSpec


def flat_spec(**kw: Any) -> TrialSpec:
    """``TrialSpec(**kw)`` with the :class:`MeasureSettings` keys (``num_requests``,
    ``precision``, ``slo``, ...) moved into its ``measure`` (validated there)."""
    measure = {k: kw.pop(k) for k in list(kw) if k in MEASURE_KEYS}
    return TrialSpec(measure=MeasureSettings(**measure), **kw)
