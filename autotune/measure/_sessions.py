"""A session replay's own figures: TTFT by turn, per-session latency, sessions served."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autotune.load import RequestRecord

#: TTFT is reported for turns 1..TURN_BUCKETS - 1 each and for the later ones together
TURN_BUCKETS = 4


def session_figures(records: Sequence[RequestRecord], wall_s: float | None = None
                    ) -> dict[str, float]:
    """Figures of the records of a session replay (those with a ``session``; {} when none).

    ``sessions``, ``turns`` (sent), ``turns_per_session``; ``ttft_p50_s_turn1``,
    ``_turn2``, ``_turn3``, ``_turn4plus`` (and ``ttft_p90_s_`` the same): a later turn's
    TTFT shows what its cached prefix saved; ``session_s_p50``/``_p90``: first send to last
    answer of the sessions whose every turn succeeded; ``sessions_per_s``: sessions
    started over ``wall_s``; ``failed_sessions``: sessions with a failed turn."""
    by_session: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.session is not None:
            by_session[r.session].append(r)
    if not by_session:
        return {}
    ttft: dict[str, list[float]] = defaultdict(list)
    spans: list[float] = []
    failed = 0
    for recs in by_session.values():
        ok = all(r.ok for r in recs)
        failed += not ok
        for r in recs:
            if r.ok and r.first_token_s is not None and r.turn is not None:
                k = min(r.turn + 1, TURN_BUCKETS)
                key = f"turn{k}plus" if k == TURN_BUCKETS else f"turn{k}"
                ttft[key].append(r.first_token_s - r.send_s)
        ends = [r.end_s for r in recs if r.end_s is not None]
        if ok and ends:
            spans.append(max(ends) - min(r.send_s for r in recs))
    n_turns = sum(len(v) for v in by_session.values())
    out: dict[str, float] = {"sessions": float(len(by_session)), "turns": float(n_turns),
                             "turns_per_session": n_turns / len(by_session),
                             "failed_sessions": float(failed)}
    for key, vals in ttft.items():
        p50, p90 = np.percentile(vals, [50.0, 90.0])
        out[f"ttft_p50_s_{key}"] = float(p50)
        out[f"ttft_p90_s_{key}"] = float(p90)
    if spans:
        p50, p90 = np.percentile(spans, [50.0, 90.0])
        out["session_s_p50"], out["session_s_p90"] = float(p50), float(p90)
    if wall_s is not None and wall_s > 0:
        out["sessions_per_s"] = len(by_session) / wall_s
    return {k: v for k, v in out.items() if math.isfinite(v)}
