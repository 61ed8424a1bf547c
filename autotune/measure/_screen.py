"""Screen, then refine: the coarse fidelity of a trial and the promotion rule (pure).

A screened trial is first read at a coarse fidelity on its own server: a throughput
interval within ``SCREEN_PRECISION_FACTOR`` x ``--precision`` (3 x 2 % = 6 %), or a
capacity bracket closed within ``SCREEN_BRACKET`` (its ends at most 2x apart). The study
(autotune.study) passes the bar of that rung with the trial; the trial goes on to full
resolution (rung 1) only when its coarse reading is a leader, else it stops there (rung 0,
"screened"). Successive halving over fidelity, as Optuna's SuccessiveHalvingPruner rungs
trials over steps: the bar is the top 1/eta of the rung-0 readings so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

#: the coarse throughput reading: the interval's relative half-width within this many
#: times ``--precision`` (a third of the precision needs about a ninth of the segments)
SCREEN_PRECISION_FACTOR = 3.0
#: measured segments at least before a coarse reading (the pruner's prune_after is 2)
SCREEN_MIN_SEGMENTS = 3
#: the coarse capacity reading: a bracket [highest pass, lowest fail] at most 2x wide
SCREEN_BRACKET = 2.0
#: the promotion share: the top 1/ETA of the rung-0 readings go on to full resolution
ETA = 3


class CoarseRecord(TypedDict):
    """``autotune.screen`` of a trial: its coarse reading (per server, like the metrics)."""

    value: float
    ci_low: float
    ci_high: float
    bar: float  # the rung's bar it was judged against
    incumbent: float | None  # the incumbent's full-resolution value then (None: none)
    promoted: bool
    at_s: float  # seconds of measurement when the coarse reading was taken


@dataclass(frozen=True)
class Screen:
    """The bar a trial's coarse reading is judged against (per server, in the objective's
    unit: output tokens/s, or req/s for capacity).

    ``bar``: the top-1/eta value of the rung-0 readings so far; ``incumbent``: the best
    full-resolution reading so far (None: none yet). Promoted (:meth:`promotes`) when the
    coarse value reaches the bar, or when its interval's top reaches the incumbent (it
    could still beat it); otherwise the trial stops, screened."""

    bar: float
    incumbent: float | None = None
    precision_factor: float = SCREEN_PRECISION_FACTOR
    bracket: float = SCREEN_BRACKET

    def promotes(self, value: float, high: float) -> bool:
        """Whether a coarse reading (its value and its interval's top) goes on to full
        resolution; a reading that is not finite always does (it says nothing)."""
        if not (math.isfinite(value) and math.isfinite(self.bar)):
            return True
        if value >= self.bar:
            return True
        return self.incumbent is not None and (not math.isfinite(high)
                                               or high >= self.incumbent)

    def record(self, value: float, low: float, high: float, at_s: float) -> CoarseRecord:
        """The trial's ``autotune.screen`` for this coarse reading."""
        return CoarseRecord(value=float(value), ci_low=float(low), ci_high=float(high),
                            bar=float(self.bar), incumbent=self.incumbent,
                            promoted=self.promotes(value, high), at_s=round(at_s, 2))


def coarse_ready(rates_n: int, half_width: float, precision: float,
                 factor: float = SCREEN_PRECISION_FACTOR) -> bool:
    """A throughput interval is a coarse reading: at least ``SCREEN_MIN_SEGMENTS``
    segments and a relative half-width within ``factor`` x ``precision``."""
    return rates_n >= SCREEN_MIN_SEGMENTS and half_width <= factor * precision


def bracket_closed(low: float | None, high: float | None,
                   bracket: float = SCREEN_BRACKET) -> bool:
    """A capacity bracket is a coarse reading: both ends found, at most ``bracket`` x
    apart."""
    return (low is not None and high is not None and low > 0
            and high / low <= bracket)
