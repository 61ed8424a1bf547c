"""Readers of recorded traffic: OpenAI-style request logs, Azure, BurstGPT, Mooncake and
multi-turn (``chat_id`` / ``parent_chat_id``) traces.

Every reader streams its file (CSV in chunks, JSONL line by line) and keeps only numeric
arrays, so a file of several GB is read in bounded memory. A bad line raises
:class:`TraceFormatError` naming the file, the line, the value and the fix, unless
``skip_bad`` is set; then it is counted and left out. Failed or zero-token requests are
valid lines: they are counted in ``failed`` and left out of the records.
"""

from __future__ import annotations

import json
import logging
import math
import re
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from autotune.errors import TraceFormatError
from autotune.traffic._collect import (
    _CSV_CHUNK_ROWS,
    _CSV_COLUMNS,
    _CSV_TITLES,
    _FIX,
    FORMATS,
    _Collector,
    _Extra,
    _is_gzip,
    _negative_time,
    _open_text,
)
from autotune.traffic._json_readers import _read_mooncake, _read_multi_turn, _read_openai_log
from autotune.traffic._records import TraceRecords
from autotune.traffic._session_links import cross_session_prefix, prefix_and_sessions

logger = logging.getLogger(__name__)


def read_trace(
    path: str | Path, *, format: str | None = None, skip_bad: bool = False
) -> TraceRecords:
    """Read a recorded-traffic file into :class:`TraceRecords` (sorted by arrival).

    ``format`` is one of ``"openai_log"``, ``"azure"``, ``"burstgpt"``, ``"mooncake"``,
    ``"multi_turn"``;
    ``None`` detects it from the first line. Gzip-compressed files are read as well.
    Raises :class:`TraceFormatError` for a missing, empty or malformed file.
    """
    p = Path(path)
    name = str(path)
    if not p.is_file():
        raise TraceFormatError(
            f"traffic file {name} does not exist or is not a file; check the path"
        )
    fmt = _asked_format(p, format) if format is not None else detect_format(p)
    logger.info("reading %s as %s", name, fmt)
    col = _Collector(name=name, skip_bad=skip_bad)
    try:
        if fmt in _CSV_COLUMNS:
            extra = _read_csv(p, fmt, col)
        elif fmt == "mooncake":
            extra = _read_mooncake(p, col)
        elif fmt == "multi_turn":
            extra = _read_multi_turn(p, col)
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
            if "chat_id" in obj and "input_length" in obj:
                return "multi_turn"
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


def _asked_format(p: Path, fmt: str) -> str:
    """``--format fmt`` for ``p``, refused at once when the file is of the other kind (JSON
    lines for a CSV format, or CSV for a JSON one): the error names the format asked and the
    one the file looks like, not the first parse error of the wrong reader."""
    _check_format(fmt)
    try:
        looks = detect_format(p)
    except TraceFormatError:
        return fmt  # not recognisable: the reader says what is wrong
    if (fmt in _CSV_COLUMNS) != (looks in _CSV_COLUMNS):
        kind = "CSV" if fmt in _CSV_COLUMNS else "JSON lines"
        other = "CSV" if looks in _CSV_COLUMNS else "JSON lines"
        raise TraceFormatError(
            f"traffic file {p}: --format {fmt} reads {kind}, but the file is {other} and "
            f"looks like {looks}; pass --format {looks}, or leave --format out to detect it")
    return fmt


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


def _chunks(reader: Iterator[pd.DataFrame], name: str) -> Iterator[pd.DataFrame]:
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
    if kind == "seconds":  # a date-time before 1970 is a date; a negative count is wrong
        with np.errstate(invalid="ignore"):
            ok &= num >= 0
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
    if kind == "seconds":
        try:
            if float(str(value)) < 0:
                return _negative_time(column, value)
        except ValueError:
            pass
    expected = (
        "seconds as a number"
        if kind == "seconds"
        else "a date-time such as 2023-11-16 18:15:46.680"
    )
    return f"{column!r} is {value!r}, which cannot be parsed as a timestamp (expected {expected})"


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
    gaps = np.diff(ts)
    was_sorted = bool(np.all(gaps >= 0))
    if not was_sorted:
        logger.info("traffic file %s: rows are not in time order; sorting them", col.name)
    # a canonical order (time, then lengths) so that a shuffled file gives identical arrays
    if np.all(gaps > 0):
        order = np.arange(ts.shape[0])
    else:
        order = np.lexsort((out, inp, ts))
    prefix, sessions = prefix_and_sessions(
        fmt, extra, order, (ts, inp, out), name=col.name, skip_bad=col.skip_bad
    )
    cross = cross_session_prefix(fmt, extra, order, inp, sessions)
    ts, inp, out = ts[order], inp[order], out[order]
    latencies = extra.latencies
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
        prefix=prefix,
        sessions=sessions,
        cross_prefix=cross,
        latencies_s=latencies[order] if latencies is not None else None,
        start_epoch_s=start if extra.wall_clock else None,
        was_sorted=was_sorted,
        links_cut=tuple(extra.turns.cut_lines) if extra.turns is not None else (),
    )
