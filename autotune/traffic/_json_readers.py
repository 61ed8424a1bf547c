"""The JSON-lines trace readers: Mooncake traces and OpenAI request logs.
"""

from __future__ import annotations

import json
import logging
import math
from array import array
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import numpy as np

from autotune.traffic._collect import (
    _FAILED_STATUS,
    _Collector,
    _Extra,
    _negative_time,
    _open_text,
    _PrefixRaw,
)

logger = logging.getLogger(__name__)


def _json_lines(p: Path, col: _Collector) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open_text(p) as fh:
        for lineno, raw in enumerate(fh, start=1):
            text = raw.strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                col.bad(lineno, f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(obj, dict):
                col.bad(lineno, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield lineno, obj


def _count(obj: dict[str, Any], key: str) -> int | str:
    """A token count from a JSON object, or the reason it is bad."""
    if key not in obj or obj[key] is None:
        return f"{key!r} is missing; every request needs a token count"
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        return f"{key!r} is {v!r}; token counts must be whole numbers >= 0"
    if not math.isfinite(v):
        return f"{key!r} is {v}; token counts must be finite whole numbers >= 0"
    if v < 0:
        return f"{key!r} is {v}; token counts must be >= 0"
    if v != int(v):
        return f"{key!r} is {v}; token counts must be whole numbers"
    return int(v)


def _number(obj: dict[str, Any], key: str) -> float | str:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return f"{key!r} is {v!r}; expected a finite number"
    return float(v)


def _read_mooncake(p: Path, col: _Collector) -> _Extra:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    raw = _PrefixRaw()
    any_blocks = False
    for lineno, obj in _json_lines(p, col):
        ts = _number(obj, "timestamp")
        if isinstance(ts, str):
            col.bad(lineno, ts.replace("a finite number", "milliseconds as a finite number"))
            continue
        if ts < 0:
            col.bad(lineno, _negative_time("timestamp", obj["timestamp"], "milliseconds"))
            continue
        inp = _count(obj, "input_length")
        if isinstance(inp, str):
            col.bad(lineno, inp)
            continue
        out = _count(obj, "output_length")
        if isinstance(out, str):
            col.bad(lineno, out)
            continue
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            col.bad(lineno, f"'hash_ids' is {str(ids)[:40]!r}; expected a list of integer ids")
            continue
        if inp == 0 or out == 0:
            col.failed += 1
            continue
        col.ts.append(ts / 1000.0)
        col.inp.append(inp)
        col.out.append(out)
        if ids:
            any_blocks = True
            raw.blocks.extend(ids)
        raw.offsets.append(len(raw.blocks))
    return _Extra(prefix=raw if any_blocks else None)


def _parse_time(v: object, key: str) -> float | str:
    if isinstance(v, bool):
        return f"{key!r} is {v!r}; expected seconds or an ISO-8601 date-time"
    if isinstance(v, int | float):
        if not math.isfinite(v):
            return f"{key!r} is {v}; expected a finite number of seconds"
        if v < 0:
            return _negative_time(key, v, "milliseconds" if key == "timestamp_ms" else "seconds")
        if key == "timestamp_ms":
            return float(v) / 1000.0
        if abs(v) > _MAX_UNIX_SECONDS:
            return (
                f"{key!r} is {v}, which looks like milliseconds (seconds would be after the "
                "year 5000); write it as 'timestamp_ms' or in seconds"
            )
        return float(v)
    if isinstance(v, str):
        try:
            dt = datetime.fromisoformat(v.strip())  # 3.11 reads a trailing Z
        except ValueError:
            return (
                f"{key!r} is {v!r}, which cannot be parsed as a timestamp "
                "(expected unix seconds or an ISO-8601 date-time such as 2025-01-07T10:15:02Z)"
            )
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    return f"{key!r} is {v!r}; expected seconds or an ISO-8601 date-time"


_TIME_KEYS: Final = ("timestamp", "arrival_time", "created", "timestamp_ms")


_MAX_UNIX_SECONDS: Final = 1e11


def _is_failed(obj: dict[str, Any]) -> bool:
    status = obj.get("status")
    if isinstance(status, int) and not isinstance(status, bool) and status >= 400:
        return True
    if isinstance(status, str) and status.strip().lower() in _FAILED_STATUS:
        return True
    return bool(obj.get("error"))


def _read_openai_log(p: Path, col: _Collector) -> _Extra:
    """OpenAI-style request log (see docs/traffic.md)."""
    raw = _PrefixRaw()
    lat = array("d")
    any_lat = False
    for lineno, obj in _json_lines(p, col):
        key = next((k for k in _TIME_KEYS if k in obj), None)
        if key is None:
            col.bad(lineno, "no arrival time; add 'timestamp' (unix seconds or ISO-8601)")
            continue
        ts = _parse_time(obj[key], key)
        if isinstance(ts, str):
            col.bad(lineno, ts)
            continue
        if _is_failed(obj):
            col.failed += 1
            continue
        usage = obj.get("usage", obj)
        if not isinstance(usage, dict):
            col.bad(lineno, f"'usage' is {usage!r}; expected an object with prompt_tokens")
            continue
        inp = _count(usage, "prompt_tokens")
        if isinstance(inp, str):
            col.bad(lineno, inp)
            continue
        out = _count(usage, "completion_tokens")
        if isinstance(out, str):
            col.bad(lineno, out)
            continue
        latency = math.nan
        if obj.get("latency_s") is not None:
            v = _number(obj, "latency_s")
            if isinstance(v, str) or v < 0:
                col.bad(lineno, f"'latency_s' is {obj['latency_s']!r}; expected seconds >= 0")
                continue
            latency = v
        pid, ptok = -1, 0
        if obj.get("prefix_id") is not None:
            n = _count(obj, "prefix_tokens")
            if isinstance(n, str):
                col.bad(lineno, n.replace("token count", "'prefix_tokens' beside 'prefix_id'"))
                continue
            pid, ptok = raw.code(obj["prefix_id"]), n
            raw.seen_prefix = True
        sid = -1
        if obj.get("session_id") is not None:
            sid = raw.code(obj["session_id"])
            raw.seen_session = True
        if inp == 0 or out == 0:
            col.failed += 1
            continue
        col.ts.append(ts)
        col.inp.append(inp)
        col.out.append(out)
        lat.append(latency)
        any_lat = any_lat or not math.isnan(latency)
        raw.session.append(sid)
        raw.prefix_id.append(pid)
        raw.prefix_tokens.append(ptok)
    raw.codes.clear()  # only the integer codes are needed from here on
    prefix = raw if (raw.seen_prefix or raw.seen_session) else None
    latencies = np.frombuffer(lat, dtype=np.float64).copy() if any_lat else None
    return _Extra(wall_clock=True, prefix=prefix, latencies=latencies)
