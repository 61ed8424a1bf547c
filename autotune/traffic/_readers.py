"""Readers of recorded traffic: OpenAI-style request logs, Azure, BurstGPT and Mooncake traces.

Every reader streams its file (CSV in chunks, JSONL line by line) and keeps only numeric
arrays, so a file of several GB is read in bounded memory. A bad line raises
:class:`TraceFormatError` naming the file, the line, the value and the fix, unless
``skip_bad`` is set; then it is counted and left out. Failed or zero-token requests are
valid lines: they are counted in ``failed`` and left out of the records.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import re
import warnings
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, TextIO

import numpy as np
import pandas as pd

from autotune.errors import TraceFormatError
from autotune.traffic._records import (
    PrefixInfo,
    SkippedLine,
    TraceRecords,
    prefix_from_blocks,
    prefix_from_ids,
    prefix_from_sessions,
)

__all__ = ["FORMATS", "TraceFormat", "detect_format", "read_trace"]

logger = logging.getLogger(__name__)

TraceFormat = Literal["openai_log", "azure", "burstgpt", "mooncake"]
FORMATS: Final[tuple[str, ...]] = ("openai_log", "azure", "burstgpt", "mooncake")

_CSV_COLUMNS: Final[dict[str, tuple[str, str, str]]] = {
    # format: (timestamp, input tokens, output tokens)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}
_CSV_TITLES: Final[dict[str, str]] = {"azure": "an Azure LLM inference", "burstgpt": "a BurstGPT"}
_CSV_CHUNK_ROWS: Final = 200_000
_MAX_EXAMPLES: Final = 10
_MOONCAKE_BLOCK_TOKENS: Final = 512
_FIX = "fix the row or pass --skip-bad"
_FAILED_STATUS: Final = frozenset(
    {"error", "failed", "failure", "timeout", "cancelled", "canceled", "aborted"}
)


@dataclass
class _Collector:
    """Growing numeric columns plus the bookkeeping of bad and failed lines."""

    name: str
    skip_bad: bool
    ts: array[float] = field(default_factory=lambda: array("d"))
    inp: array[int] = field(default_factory=lambda: array("q"))
    out: array[int] = field(default_factory=lambda: array("q"))
    skipped: int = 0
    failed: int = 0
    examples: list[SkippedLine] = field(default_factory=list)

    def bad(self, line: int, reason: str) -> None:
        """A bad line: raise, or count it when skipping."""
        if not self.skip_bad:
            raise TraceFormatError(f"traffic file {self.name} line {line}: {reason} ({_FIX})")
        self.skipped += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(SkippedLine(line, reason))


def read_trace(
    path: str | Path, *, format: str | None = None, skip_bad: bool = False
) -> TraceRecords:
    """Read a recorded-traffic file into :class:`TraceRecords` (sorted by arrival).

    ``format`` is one of ``"openai_log"``, ``"azure"``, ``"burstgpt"``, ``"mooncake"``;
    ``None`` detects it from the first line. Gzip-compressed files are read as well.
    Raises :class:`TraceFormatError` for a missing, empty or malformed file.
    """
    p = Path(path)
    name = str(path)
    if not p.is_file():
        raise TraceFormatError(
            f"traffic file {name} does not exist or is not a file; check the path"
        )
    fmt = _check_format(format) if format is not None else detect_format(p)
    logger.info("reading %s as %s", name, fmt)
    col = _Collector(name=name, skip_bad=skip_bad)
    try:
        if fmt in _CSV_COLUMNS:
            extra = _read_csv(p, fmt, col)
        elif fmt == "mooncake":
            extra = _read_mooncake(p, col)
        else:
            extra = _read_openai_log(p, col)
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"traffic file {name} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "pass a CSV or JSONL trace"
        ) from exc
    except (EOFError, zlib.error) as exc:
        raise TraceFormatError(
            f"traffic file {name} is a truncated or corrupt compressed file ({exc}); "
            "decompress it again or re-download it"
        ) from exc
    except OSError as exc:
        raise TraceFormatError(f"traffic file {name} cannot be read: {exc}") from exc
    return _finish(col, fmt, extra)


def detect_format(path: str | Path) -> str:
    """The trace format of ``path``, from its first non-blank line."""
    name = str(path)
    try:
        with _open_text(Path(path)) as fh:
            first = ""
            for n, raw in enumerate(fh):
                if raw.strip():
                    first = raw.strip()
                    break
                if n > 100_000:  # a file of blank lines: give up looking
                    break
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"traffic file {name} is not UTF-8 text; pass a CSV or JSONL trace"
        ) from exc
    except (EOFError, zlib.error) as exc:
        raise TraceFormatError(
            f"traffic file {name} is a truncated or corrupt compressed file ({exc})"
        ) from exc
    except OSError as exc:
        raise TraceFormatError(f"traffic file {name} cannot be read: {exc}") from exc
    if not first:
        raise TraceFormatError(f"traffic file {name} is empty; it has no requests to fit")
    hint = f"pass --format with one of {', '.join(FORMATS)}"
    if first.startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(
                f"traffic file {name} line 1: not valid JSON ({exc.msg}); {hint}"
            ) from exc
        if isinstance(obj, dict):
            if "input_length" in obj or "hash_ids" in obj:
                return "mooncake"
            if "usage" in obj or "prompt_tokens" in obj:
                return "openai_log"
        raise TraceFormatError(
            f"traffic file {name}: a JSON line without 'input_length' (Mooncake) or 'usage' "
            f"(OpenAI request log) fields; {hint}"
        )
    header = {c.strip() for c in first.split(",")}
    # the CSV format sharing the most column names; its reader names any missing column
    score, fmt = max((len(header & set(cols)), fmt) for fmt, cols in _CSV_COLUMNS.items())
    if score >= 2:
        return fmt
    raise TraceFormatError(
        f"traffic file {name}: cannot tell its format from the first line {first[:80]!r}; {hint}"
    )


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def _is_gzip(p: Path) -> bool:
    with p.open("rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def _open_text(p: Path) -> TextIO:
    if _is_gzip(p):
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    return p.open("r", encoding="utf-8")


# ----------------------------------------------------------------------------- CSV


_SKIP_RE = re.compile(r"Skipping line (\d+): (.*)")
_PARSER_LINE_RE = re.compile(r"line (\d+)")


def _read_csv(p: Path, fmt: str, col: _Collector) -> _Extra:
    """Azure / BurstGPT CSV, in chunks."""
    ts_col, in_col, out_col = _CSV_COLUMNS[fmt]
    skipped_lines: list[int] = []  # lines with a wrong number of fields (skip_bad only)
    ts_kind: str | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", pd.errors.ParserWarning)
        reader = pd.read_csv(
            p,
            dtype=object,  # plain str cells: faster to convert than arrow strings
            na_filter=False,
            skip_blank_lines=False,
            skipinitialspace=True,
            chunksize=_CSV_CHUNK_ROWS,
            compression="gzip" if _is_gzip(p) else None,
            on_bad_lines="warn" if col.skip_bad else "error",
            encoding="utf-8",
        )
        try:
            with reader:
                for chunk in _chunks(reader, col.name):
                    chunk.columns = [str(c).strip() for c in chunk.columns]
                    missing = [c for c in (ts_col, in_col, out_col) if c not in chunk.columns]
                    if missing:
                        found = ", ".join(map(repr, chunk.columns))
                        raise TraceFormatError(
                            f"traffic file {col.name}: column {missing[0]!r} is missing (found "
                            f"{found}); {_CSV_TITLES[fmt]} trace has columns "
                            f"{', '.join(_CSV_COLUMNS[fmt])}: fix the header or pass --format"
                        )
                    for w in caught:
                        for m in _SKIP_RE.finditer(str(w.message)):
                            skipped_lines.append(int(m.group(1)))
                            col.bad(int(m.group(1)), m.group(2).strip())
                    caught.clear()
                    ts_kind = _csv_chunk(
                        chunk, ts_col, in_col, out_col, col, skipped_lines, ts_kind
                    )
        except pd.errors.EmptyDataError as exc:
            raise TraceFormatError(
                f"traffic file {col.name} is empty; it has no requests to fit"
            ) from exc
        for w in caught:  # warnings raised while reading the last chunk
            for m in _SKIP_RE.finditer(str(w.message)):
                col.bad(int(m.group(1)), m.group(2).strip())
    return _Extra(wall_clock=ts_kind == "datetime")


def _chunks(reader: Any, name: str) -> Iterator[pd.DataFrame]:
    while True:
        try:
            chunk = next(reader)
        except StopIteration:
            return
        except pd.errors.ParserError as exc:
            m = _PARSER_LINE_RE.search(str(exc))
            where = f" line {m.group(1)}" if m else ""
            detail = str(exc).split("C error: ")[-1].strip()
            raise TraceFormatError(
                f"traffic file {name}{where}: malformed CSV ({detail}) ({_FIX})"
            ) from exc
        yield chunk


def _csv_chunk(
    chunk: pd.DataFrame,
    ts_col: str,
    in_col: str,
    out_col: str,
    col: _Collector,
    skipped_lines: list[int],
    ts_kind: str | None,
) -> str | None:
    """Validate one chunk vectorised; append its good rows. Returns the timestamp kind."""
    rows = chunk.index.to_numpy(dtype=np.int64)
    # row r is on line r + 2 (header on line 1), plus the bad lines pandas skipped before it
    if skipped_lines:
        s = np.sort(np.asarray(skipped_lines, dtype=np.int64))
        t = s - 2 - np.arange(s.shape[0])
        lines = rows + 2 + np.searchsorted(t, rows, side="right")
    else:
        lines = rows + 2
    blank = (chunk == "").all(axis=1).to_numpy(dtype=bool)
    inp, in_err = _counts_vec(chunk[in_col])
    out, out_err = _counts_vec(chunk[out_col])
    if ts_kind is None:
        ts_kind = _timestamp_kind(chunk[ts_col])
    ts, ts_err = _timestamps_vec(chunk[ts_col], ts_kind)
    bad = (in_err | out_err | ts_err) & ~blank
    if np.any(bad):
        for i in np.flatnonzero(bad):
            if ts_err[i]:
                reason = _ts_reason(ts_col, chunk[ts_col].iat[i], ts_kind)
            elif in_err[i]:
                reason = _count_reason(in_col, chunk[in_col].iat[i])
            else:
                reason = _count_reason(out_col, chunk[out_col].iat[i])
            col.bad(int(lines[i]), reason)
    good = ~bad & ~blank
    failed = good & ((inp == 0) | (out == 0))
    col.failed += int(np.count_nonzero(failed))
    keep = good & ~failed
    col.ts.frombytes(ts[keep].astype(np.float64).tobytes())
    col.inp.frombytes(inp[keep].astype(np.int64).tobytes())
    col.out.frombytes(out[keep].astype(np.int64).tobytes())
    return ts_kind


def _counts_vec(raw: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Token counts as int64 and a mask of the values that are not whole numbers >= 0."""
    num = _floats(raw)
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(num) & (num >= 0) & (num == np.floor(num)) & (num < 2**53)
    return np.where(ok, num, 0).astype(np.int64), ~ok


def _floats(raw: pd.Series) -> np.ndarray:
    """Strings to float64; cells that are not numbers become NaN."""
    try:  # fast path: every cell parses
        return np.asarray(raw.astype(np.float64).to_numpy(), dtype=np.float64)
    except (ValueError, TypeError):
        return pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


def _timestamp_kind(raw: pd.Series) -> str:
    """'seconds' or 'datetime', by majority of the first 100 values (one bad row must not
    decide how every other row is read)."""
    values = [v for v in raw.head(200) if v != ""][:100]
    numeric = pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").notna().sum()
    return "seconds" if numeric * 2 >= len(values) else "datetime"


def _timestamps_vec(raw: pd.Series, kind: str) -> tuple[np.ndarray, np.ndarray]:
    if kind == "seconds":
        num = _floats(raw)
    else:
        dt = pd.to_datetime(raw, format="ISO8601", errors="coerce", utc=True)
        num = ((dt - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(
            dtype=np.float64, na_value=np.nan
        )
    ok = np.isfinite(num)
    return np.where(ok, num, 0.0), ~ok


def _count_reason(column: str, value: object) -> str:
    if value is None or value == "":
        return f"{column!r} is missing; every row needs a token count"
    try:
        num = float(str(value))
    except ValueError:
        return f"{column!r} is {value!r}; token counts must be whole numbers >= 0"
    if not math.isfinite(num):
        return f"{column!r} is {value}; token counts must be finite whole numbers >= 0"
    if num < 0:
        return f"{column!r} is {value}; token counts must be >= 0"
    return f"{column!r} is {value}; token counts must be whole numbers"


def _ts_reason(column: str, value: object, kind: str) -> str:
    if value is None or value == "":
        return f"{column!r} is missing; every row needs an arrival time"
    expected = (
        "seconds as a number"
        if kind == "seconds"
        else "a date-time such as 2023-11-16 18:15:46.680"
    )
    return f"{column!r} is {value!r}, which cannot be parsed as a timestamp (expected {expected})"


# ----------------------------------------------------------------------------- JSONL


@dataclass
class _PrefixRaw:
    """Raw prefix columns of a JSONL trace, aligned with the collector's kept rows."""

    blocks: array[int] = field(default_factory=lambda: array("q"))
    offsets: array[int] = field(default_factory=lambda: array("q", [0]))
    session: array[int] = field(default_factory=lambda: array("q"))
    prefix_id: array[int] = field(default_factory=lambda: array("q"))
    prefix_tokens: array[int] = field(default_factory=lambda: array("q"))
    codes: dict[str, int] = field(default_factory=dict)
    seen_session: bool = False
    seen_prefix: bool = False

    def code(self, key: object) -> int:
        return self.codes.setdefault(f"{type(key).__name__}:{key}", len(self.codes))


@dataclass
class _Extra:
    """What a reader found beside the three main columns."""

    wall_clock: bool = False
    prefix: _PrefixRaw | None = None
    latencies: np.ndarray | None = None


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


# ----------------------------------------------------------------------------- finish


def _finish(col: _Collector, fmt: str, extra: _Extra) -> TraceRecords:
    ts = np.frombuffer(col.ts, dtype=np.float64).copy()
    inp = np.frombuffer(col.inp, dtype=np.int64).copy()
    out = np.frombuffer(col.out, dtype=np.int64).copy()
    col.examples.sort(key=lambda e: e.line)
    if col.skipped:
        logger.info(
            "traffic file %s: skipped %d bad line(s), e.g. %s",
            col.name,
            col.skipped,
            "; ".join(f"line {e.line}: {e.reason}" for e in col.examples[:3]),
        )
    if ts.shape[0] == 0:
        raise TraceFormatError(
            f"traffic file {col.name} has no usable requests ({col.skipped} bad line(s) "
            f"skipped, {col.failed} failed or zero-token request(s) left out); "
            "check that the file and --format are right"
        )
    prefix: PrefixInfo | None = None
    prefix_raw, latencies = extra.prefix, extra.latencies
    if prefix_raw is not None:
        if fmt == "mooncake":
            prefix = prefix_from_blocks(
                np.frombuffer(prefix_raw.blocks, dtype=np.int64),
                np.frombuffer(prefix_raw.offsets, dtype=np.int64),
                inp,
                block_tokens=_MOONCAKE_BLOCK_TOKENS,
            )
        elif prefix_raw.seen_prefix:
            prefix = prefix_from_ids(
                np.frombuffer(prefix_raw.prefix_id, dtype=np.int64),
                np.frombuffer(prefix_raw.prefix_tokens, dtype=np.int64),
                inp,
            )
        else:
            prefix = prefix_from_sessions(
                np.frombuffer(prefix_raw.session, dtype=np.int64), ts, inp, out
            )
    gaps = np.diff(ts)
    was_sorted = bool(np.all(gaps >= 0))
    if not was_sorted:
        logger.info("traffic file %s: rows are not in time order; sorting them", col.name)
    # a canonical order (time, then lengths) so that a shuffled file gives identical arrays
    if np.all(gaps > 0):
        order = np.arange(ts.shape[0])
    else:
        order = np.lexsort((out, inp, ts))
        ts, inp, out = ts[order], inp[order], out[order]
    start = float(ts[0])
    return TraceRecords(
        path=col.name,
        format=fmt,
        timestamps_s=ts - start,
        input_tokens=inp,
        output_tokens=out,
        skipped=col.skipped,
        failed=col.failed,
        skipped_examples=tuple(col.examples),
        prefix=prefix.take(order) if prefix is not None else None,
        latencies_s=latencies[order] if latencies is not None else None,
        start_epoch_s=start if extra.wall_clock else None,
        was_sorted=was_sorted,
    )
