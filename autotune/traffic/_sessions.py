"""Fit the ``sessions`` section of a shape from the turn links of :class:`TraceRecords`
(pure: no I/O)."""

from __future__ import annotations

from typing import Final

import numpy as np

from autotune.traffic._dist import length_dist, prefix_stats, rounded
from autotune.traffic._models import SessionStats
from autotune.traffic._records import TraceRecords

__all__ = ["MAX_PROFILE_TURNS", "QUICK_CHAIN_S", "session_stats"]

#: a follow-up turn sent less than this long after its parent's answer is a quick chain
QUICK_CHAIN_S: Final = 1.0
#: ``context_by_turn`` covers turns 1 .. this
MAX_PROFILE_TURNS: Final = 32


def _fraction(mask: np.ndarray) -> float:
    return rounded(float(np.mean(mask))) if mask.shape[0] else 0.0


def session_stats(records: TraceRecords) -> SessionStats | None:
    """The sessions of ``records`` (None when the trace carries no session links)."""
    links = records.sessions
    if links is None:
        return None
    ts, inp = records.timestamps_s, records.input_tokens
    n = len(records)
    parent = links.parent
    root, turn = links.tree()
    first = parent < 0
    turns = np.bincount(root, minlength=n)[first]
    span = float(ts[-1] - ts[0])
    by_turn = np.bincount(turn, minlength=2)
    depth = min(int(turn.max()), MAX_PROFILE_TURNS)
    context = np.bincount(turn, weights=inp.astype(np.float64), minlength=depth + 1)
    follow = ~first
    p = parent[follow]
    children = np.bincount(p, minlength=n)
    with_next = children[children > 0]
    section: dict[str, object] = {
        "source": links.source,
        "sessions": int(turns.shape[0]),
        "rate_sps": rounded(turns.shape[0] / span) if span > 0 else 0.0,
        "multi_turn_fraction": _fraction(turns >= 2),
        "turns": length_dist(turns),
        "first_turn_tokens": length_dist(inp[first]),
        "context_by_turn": [rounded(context[t] / by_turn[t]) for t in range(1, depth + 1)],
        "fanout_fraction": _fraction(with_next >= 2),
        "max_fanout": int(children.max()),
    }
    if records.cross_prefix is not None and np.any(records.cross_prefix.shared_tokens > 0):
        section["shared_prefix"] = prefix_stats(records.cross_prefix.take(np.flatnonzero(first)),
                                                inp[first])
    if p.shape[0]:
        section |= _follow_ups(records, follow, p)
        last = np.full(n, -np.inf)
        np.maximum.at(last, root, ts)
        multi = np.flatnonzero(first)[turns >= 2]
        section["session_span_s"] = length_dist(last[multi] - ts[multi])
    return SessionStats.model_validate(section)


def _follow_ups(records: TraceRecords, follow: np.ndarray, p: np.ndarray) -> dict[str, object]:
    """Tokens and think time of the turns that follow another (``p``: their parents)."""
    ts, inp, out = records.timestamps_s, records.input_tokens, records.output_tokens
    gap = ts[follow] - ts[p]
    lat = records.latencies_s
    in_flight: float | None = None
    if lat is not None and np.all(np.isfinite(lat[p])):
        think = gap - lat[p]
        basis = "answer"
        in_flight = _fraction(think < 0)
    else:  # no answer times: the gap between arrivals, which includes the answer's own time
        think = gap
        basis = "arrival"
    return {
        "new_tokens": length_dist(np.maximum(inp[follow] - (inp[p] + out[p]), 0)),
        "context_growth": length_dist(np.maximum(inp[follow] - inp[p], 0)),
        "think_time_s": length_dist(np.maximum(think, 0.0)),
        "think_time_basis": basis,
        "quick_chain_fraction": _fraction(think < QUICK_CHAIN_S),
        "in_flight_fraction": in_flight,
    }
