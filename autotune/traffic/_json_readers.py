"""The JSON-lines trace readers: Mooncake and multi-turn traces, OpenAI request logs.
"""

from __future__ import annotations

import json
import logging
import math
from array import array
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import numpy as np

from autotune.traffic._collect import (
    _FAILED_STATUS,
    _Collector,
    _Extra,
    _negative_time,
    _open_text,
    _PrefixRaw,
    _TurnRaw,
)

logger = logging.getLogger(__name__)


def _json_lines(p: Path, col: _Collector) -> Iterator[tuple[int, Mapping[str, object]]]:
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


def _count(obj: Mapping[str, object], key: str) -> int | str:
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


def _number(obj: Mapping[str, object], key: str) -> float | str:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return f"{key!r} is {v!r}; expected a finite number"
    return float(v)


def _lengths_and_blocks(obj: Mapping[str, object]) -> tuple[int, int, list[int]] | str:
    """``input_length``, ``output_length`` and ``hash_ids`` of a Mooncake-style row, or the
    reason it is bad."""
    inp = _count(obj, "input_length")
    if isinstance(inp, str):
        return inp
    out = _count(obj, "output_length")
    if isinstance(out, str):
        return out
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        return f"'hash_ids' is {str(ids)[:40]!r}; expected a list of integer ids"
    return inp, out, ids


def _arrival(obj: Mapping[str, object], unit: str) -> float | str:
    """The row's ``timestamp`` in ``unit`` ("seconds" or "milliseconds"), or why it is bad."""
    ts = _number(obj, "timestamp")
    if isinstance(ts, str):
        return ts.replace("a finite number", f"{unit} as a finite number")
    if ts < 0:
        return _negative_time("timestamp", obj["timestamp"], unit)
    return ts / 1000.0 if unit == "milliseconds" else ts


def _read_mooncake(p: Path, col: _Collector) -> _Extra:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    raw = _PrefixRaw()
    for lineno, obj in _json_lines(p, col):
        ts = _arrival(obj, "milliseconds")
        row = ts if isinstance(ts, str) else _lengths_and_blocks(obj)
        if isinstance(row, str) or isinstance(ts, str):
            col.bad(lineno, str(row))
            continue
        inp, out, ids = row
        if inp == 0 or out == 0:
            col.failed += 1
            continue
        col.add(ts, inp, out)
        raw.add_blocks(ids)
    return _Extra(prefix=raw if raw.blocks else None)


def _turn_id(v: object, key: str) -> int | str | None:
    """A ``chat_id`` / ``parent_chat_id``: an integer or a non-empty string; None for a
    missing one or -1 (no parent); raises ValueError for anything else."""
    if v is None or (v == -1 and not isinstance(v, bool)):
        return None
    if (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and v):
        return v
    raise ValueError(f"{key!r} is {v!r}; expected an integer or string id")


def _turn_ids(obj: Mapping[str, object]) -> tuple[int | str, int | str | None] | str:
    """The row's ``chat_id`` and ``parent_chat_id`` (None = a first turn), or why bad."""
    try:
        chat = _turn_id(obj.get("chat_id"), "chat_id")
        parent = _turn_id(obj.get("parent_chat_id"), "parent_chat_id")
    except ValueError as exc:
        return str(exc)
    if chat is None:
        return "'chat_id' is missing; every turn of a multi-turn trace needs an id"
    return chat, parent


def _read_multi_turn(p: Path, col: _Collector) -> _Extra:
    """Multi-turn JSONL: ``chat_id``, ``parent_chat_id`` (-1 = a session's first turn),
    ``timestamp`` (s), ``input_length``, ``output_length``, optional ``hash_ids`` (16-token
    blocks) (see docs/traffic.md)."""
    raw = _PrefixRaw()
    turns = _TurnRaw()
    for lineno, obj in _json_lines(p, col):
        ts = _arrival(obj, "seconds")
        ids = _turn_ids(obj)
        row = next((x for x in (ts, ids) if isinstance(x, str)), None) or _lengths_and_blocks(obj)
        if isinstance(row, str) or isinstance(ids, str) or isinstance(ts, str):
            col.bad(lineno, str(row))
            continue
        inp, out, blocks = row
        code = turns.code(ids[0])
        up = -1 if ids[1] is None else turns.code(ids[1])
        if inp == 0 or out == 0:
            col.failed += 1
            turns.dropped[code] = up
            continue
        col.add(ts, inp, out)
        raw.add_blocks(blocks)
        turns.add(code, up, lineno)
    return _Extra(prefix=raw if raw.blocks else None, turns=turns)


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


def _is_failed(obj: Mapping[str, object]) -> bool:
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
