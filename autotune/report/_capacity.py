"""A capacity for people, the same in the study's summary, ``autotune best`` and the
report: the bracket, and the GPUs the recorded traffic needs as what they are, an upper
bound (a passing level's rate) with the least the bracket allows, never a point figure
made from a lower bound."""

from __future__ import annotations

import math
from collections.abc import Mapping

from autotune.measure import fmt_bracket, fmt_interval, fmt_value
from autotune.records import CapacityDeclared
from autotune.store import capacity_cut
from autotune.trial import flat_note

__all__ = ["capacity_line", "level_rate", "needed_text", "open_search_text"]


def needed_text(at_most: float, low: float | None, unit: str = "") -> str:
    """Servers or GPUs needed from a capacity: "at most 0.386 GPU(s) (the bracket puts it
    in [0.354, 0.386])", or with no failing level "at most 0.386 GPU(s) (no load level
    failed: fewer may do)"."""
    head = f"at most {fmt_value(at_most)}{' ' + unit if unit else ''}"
    if low is None:
        return f"{head} (no load level failed: fewer may do)"
    return f"{head} (the bracket puts it in {fmt_interval(low, at_most)})"


def open_search_text(status: str | None) -> str:
    """Why a capacity has no top: where its search ended before a level failed, and what
    measures beyond it (``autotune.capacity``'s status)."""
    where, fix = capacity_cut(status)
    return f"no load level failed before the search ended at {where}: a lower bound; {fix}"


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def capacity_line(block: CapacityDeclared | Mapping[str, object], unit: str = "GPU") -> str:
    """best.json's ``capacity`` in one line (what operators size a fleet by), and a note
    when the capacity is chance within a range (``CapacityResult.flat_misses``). Reads
    a ``capacity`` block; ``goodput_bar``, ``slo`` and ``search`` may be missing
    (``autotune best`` answers from a trial's metrics). ``unit``: what is counted
    ("GPU", or "server" on the CPU build: :func:`autotune.hardware.unit_of`)."""
    c = (block if isinstance(block, CapacityDeclared)
         else CapacityDeclared.model_validate(block))
    value = c.capacity_rps
    lo, hi = _finite(c.capacity_rps_ci_low), _finite(c.capacity_rps_ci_high)
    # a median over fresh starts is no bracket's lower end: say whose bracket follows
    whose = ("bracket" if lo is not None and math.isclose(lo, value)
             else "the median over starts; the bracket of the reading it rests on")
    bar = (f", >= {c.goodput_bar:.0%} of requests within "
           f"{', '.join(f'{k}={v:g}s' for k, v in c.slo.items())}"
           if c.goodput_bar is not None and c.slo else "")
    tok, busiest = _finite(c.output_tokens_per_s_at_capacity), _finite(c.busiest_rps_at_capacity)
    # a level replays the recording's busiest stretch: its tokens/s are that stretch's
    where = (f"its busiest stretch, which each level replays, sent {fmt_value(busiest)} req/s "
             "at that mean rate" if busiest is not None else "")
    at = ((f"{where}: {fmt_value(tok)} out tok/s there" if where
           else f"{fmt_value(tok)} out tok/s while the level ran") if tok is not None
          else (where or "output tokens/s at that rate not recorded"))
    rec, gpus = _finite(c.recorded_rps), _finite(c.gpus_needed)
    if rec is not None and gpus is not None:
        # the least the bracket allows: rate / its top (gpus_needed is rate / value)
        least = gpus * value / hi if hi is not None and hi > 0 else None
        need = (f"{unit}s needed for the recorded {fmt_value(rec)} req/s: "
                f"{needed_text(gpus, least)}")
    else:
        need = f"{unit}s needed: not known (no recorded arrival rate)"
    sps = _finite(c.capacity_sps)
    rate = (f"{fmt_value(value)} req/s mean rate" if sps is None  # sessions: sessions/s first
            else f"{fmt_value(sps)} sessions/s ({fmt_value(value)} req/s of turns)")
    bracket = fmt_bracket(lo, hi)
    if sps is not None and value > 0:  # the same bracket in sessions/s
        per = sps / value
        bracket += " = " + fmt_bracket(lo * per if lo is not None else None,
                                       hi * per if hi is not None else None, "sessions/s")
    line = (f"capacity: {'' if hi is not None else 'at least '}{rate} within "
            f"the SLOs ({whose} {bracket}"
            + ("" if hi is not None else f": {open_search_text(c.search)}")
            + f"{bar}); {at}; {need}")
    if c.flat_misses_rps:
        line += f"\nnote: {flat_note(c.flat_misses_rps)}"
    return line


def level_rate(level: Mapping[str, object]) -> str:
    """A load level's rates in the one form every place prints them: "7.26 req/s mean
    (busiest stretch 29.1 req/s)": the mean rate its scale gives (``offered_rps``) and the
    rate it sent, the recording's busiest stretch (``busiest_rps``; absent in older
    records)."""
    mean, busiest = level.get("offered_rps"), level.get("busiest_rps")
    text = f"{fmt_value(float(mean))} req/s mean" if isinstance(mean, (int, float)) else "?"
    if isinstance(busiest, (int, float)):
        text += f" (busiest stretch {fmt_value(float(busiest))} req/s)"
    return text
