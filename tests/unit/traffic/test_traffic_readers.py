"""Readers: the real public traces, an OpenAI-style log, and every kind of bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import autotune.traffic._readers as readers
from autotune.errors import TraceFormatError
from autotune.traffic import TraceRecords, detect_format, read_trace

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


# ------------------------------------------------------------------ the real traces


def test_azure_trace_matches_sources(azure_records: TraceRecords) -> None:
    # the sample: the recording's first 600 s (tests/data/traces/SOURCES.md)
    r = azure_records
    assert r.format == "azure" and len(r) == 2867 and r.skipped == 0 and r.failed == 0
    assert r.timestamps_s[0] == 0.0 and np.all(np.diff(r.timestamps_s) >= 0)
    assert r.timestamps_s[-1] == pytest.approx(599.97, abs=0.005)
    assert r.input_tokens.mean() == pytest.approx(1146.63, abs=0.01)
    assert np.percentile(r.input_tokens, [50, 99]).tolist() == pytest.approx(
        [1041, 4106.34], abs=0.01
    )
    assert r.input_tokens.max() == 7930
    assert r.output_tokens.mean() == pytest.approx(260.27, abs=0.01)
    assert np.percentile(r.output_tokens, [50, 99]).tolist() == pytest.approx(
        [217, 620.02], abs=0.01
    )
    assert r.output_tokens.max() == 1000
    assert r.prefix is None and r.start_epoch_s is not None


def test_mooncake_trace_matches_sources(mooncake_records: TraceRecords) -> None:
    r = mooncake_records
    assert r.format == "mooncake" and len(r) == 918  # the first 300 s
    assert r.timestamps_s[-1] == pytest.approx(297.0, abs=0.05)
    assert r.input_tokens.mean() == pytest.approx(13_557.79, abs=0.01)
    assert np.percentile(r.input_tokens, [50, 99]).tolist() == pytest.approx(
        [8353, 88073.38], abs=0.01
    )
    assert r.input_tokens.max() == 121_924
    assert r.output_tokens.mean() == pytest.approx(352.79, abs=0.01)
    assert np.percentile(r.output_tokens, [50, 99]).tolist() == pytest.approx(
        [367.5, 998.2], abs=0.01
    )
    assert r.output_tokens.max() == 2000
    assert r.prefix is not None and r.prefix.source == "hash_ids"
    assert r.prefix.block_tokens == 512
    # a perfect cache serves between none and all of the shared leading tokens
    assert 0 < r.prefix.hit_tokens.sum() <= r.prefix.shared_tokens.sum() <= r.input_tokens.sum()


def test_burstgpt_failed_rows_counted_and_left_out(burstgpt_path: Path) -> None:
    r = read_trace(burstgpt_path)
    # 2 rows with 0 request tokens and 3 with 0 response tokens: 3 distinct rows
    assert r.format == "burstgpt" and len(r) == 51 and r.failed == 3 and r.skipped == 0
    assert r.input_tokens.min() >= 1 and r.output_tokens.min() >= 1


def test_detect_format(azure_path: Path, mooncake_path: Path, burstgpt_path: Path) -> None:
    assert detect_format(azure_path) == "azure"
    assert detect_format(mooncake_path) == "mooncake"
    assert detect_format(burstgpt_path) == "burstgpt"


# ------------------------------------------------------------------ OpenAI-style log


def _log_lines() -> list[dict[str, object]]:
    return [
        {
            "timestamp": "2025-01-07T10:15:00Z",
            "usage": {"prompt_tokens": 800, "completion_tokens": 100},
            "session_id": "s1",
            "latency_s": 2.0,
        },
        {
            "timestamp": "2025-01-07T10:15:04.5Z",
            "usage": {"prompt_tokens": 1000, "completion_tokens": 50},
            "session_id": "s1",
            "latency_s": 1.0,
        },
        {
            "created": 1736244902,
            "usage": {"prompt_tokens": 300, "completion_tokens": 30},
            "latency_s": 1.5,
        },
        {"timestamp": "2025-01-07T10:15:03Z", "status": 500, "error": {"message": "boom"}},
        {
            "timestamp": "2025-01-07T10:15:05Z",
            "usage": {"prompt_tokens": 10, "completion_tokens": 0},
        },
        {
            "timestamp": 1736244906.0,
            "prompt_tokens": 40,
            "completion_tokens": 4,
            "session_id": 7,
            "latency_s": 0.5,
        },
    ]


def test_openai_log(tmp_path: Path) -> None:
    p = _write(tmp_path, "log.jsonl", "\n".join(json.dumps(x) for x in _log_lines()) + "\n\n")
    assert detect_format(p) == "openai_log"
    r = read_trace(p)
    assert len(r) == 4 and r.failed == 2 and r.skipped == 0
    assert r.timestamps_s.tolist() == [0.0, 2.0, 4.5, 6.0]
    assert r.input_tokens.tolist() == [800, 300, 1000, 40]
    assert r.latencies_s is not None and r.latencies_s.tolist() == [2.0, 1.5, 1.0, 0.5]
    # session s1: turn 2 starts with turn 1's prompt + answer (800 + 100 tokens)
    assert r.prefix is not None and r.prefix.source == "session"
    assert r.prefix.hit_tokens.tolist() == [0.0, 0.0, 900.0, 0.0]
    assert r.prefix.shared_tokens.tolist() == [800, 0, 900, 0]


def test_openai_log_prefix_ids(tmp_path: Path) -> None:
    lines = [
        {
            "timestamp": i,
            "usage": {"prompt_tokens": 700, "completion_tokens": 9},
            "prefix_id": "sys-a" if i < 3 else None,
            "prefix_tokens": 500,
        }
        for i in range(4)
    ]
    r = read_trace(_write(tmp_path, "p.jsonl", "\n".join(json.dumps(x) for x in lines)))
    assert r.prefix is not None and r.prefix.source == "prefix_id"
    assert r.prefix.shared_tokens.tolist() == [500, 500, 500, 0]
    assert r.prefix.hit_tokens.sum() == pytest.approx(1000)  # 3 holders: 2 of them hit


def test_openai_log_prefix_id_needs_tokens(tmp_path: Path) -> None:
    line = {"timestamp": 1, "usage": {"prompt_tokens": 7, "completion_tokens": 9}, "prefix_id": "x"}
    with pytest.raises(TraceFormatError, match=r"line 1: 'prefix_tokens' is missing"):
        read_trace(_write(tmp_path, "p.jsonl", json.dumps(line)))


def test_openai_log_milliseconds_are_not_taken_for_seconds(tmp_path: Path) -> None:
    line = {"timestamp": 1736244902000, "usage": {"prompt_tokens": 7, "completion_tokens": 9}}
    with pytest.raises(TraceFormatError, match=r"line 1: 'timestamp' is 1736244902000, which"):
        read_trace(_write(tmp_path, "ms.jsonl", json.dumps(line)))
    line = {"timestamp_ms": 1736244902000, "usage": {"prompt_tokens": 7, "completion_tokens": 9}}
    assert len(read_trace(_write(tmp_path, "ok.jsonl", json.dumps(line)))) == 1


def test_gzip_and_unsorted_rows(tmp_path: Path) -> None:
    text = AZURE_HEADER + "2023-11-16 18:15:50.5,20,2\n2023-11-16 18:15:46.5,10,1\n"
    p = tmp_path / "t.csv.gz"
    with gzip.open(p, "wt", encoding="utf-8") as fh:
        fh.write(text)
    r = read_trace(p)
    assert not r.was_sorted
    assert r.timestamps_s.tolist() == [0.0, 4.0] and r.input_tokens.tolist() == [10, 20]


# ------------------------------------------------------------------ bad input

CSV_CASES = [
    ("2023-11-16 18:15:47.0,396,-3", "'GeneratedTokens' is -3; token counts must be >= 0"),
    ("2023-11-16 18:15:47.0,NaN,3", "'ContextTokens' is NaN"),
    ("2023-11-16 18:15:47.0,inf,3", "'ContextTokens' is inf; token counts must be finite"),
    ("2023-11-16 18:15:47.0,12.5,3", "'ContextTokens' is 12.5; token counts must be whole"),
    ("2023-11-16 18:15:47.0,abc,3", "'ContextTokens' is 'abc'"),
    ("2023-11-16 18:15:47.0,10", "'GeneratedTokens' is missing"),
    ("2023-11-16 18:15:47.0,1,2,3", "malformed CSV"),
    ("yesterday,1,2", "'TIMESTAMP' is 'yesterday', which cannot be parsed as a timestamp"),
    (",1,2", "'TIMESTAMP' is missing"),
]


@pytest.mark.parametrize(("row", "message"), CSV_CASES)
def test_bad_csv_row_names_file_line_value_and_fix(tmp_path: Path, row: str, message: str) -> None:
    p = _write(
        tmp_path,
        "t.csv",
        AZURE_HEADER
        + "2023-11-16 18:15:46.0,374,44\n"
        + row
        + "\n"
        + "2023-11-16 18:15:48.0,30,5\n",
    )
    with pytest.raises(TraceFormatError) as info:
        read_trace(p)
    text = str(info.value)
    assert text.startswith(f"traffic file {p} line 3: ")
    assert message in text and "pass --skip-bad" in text
    r = read_trace(p, skip_bad=True)
    assert len(r) == 2 and r.skipped == 1 and r.skipped_examples[0].line == 3


JSONL_CASES = [
    ('{"timestamp": 1, "input_length": 10', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"timestamp": 1, "output_length": 5}', "'input_length' is missing"),
    ('{"timestamp": 1, "input_length": -1, "output_length": 5}', "'input_length' is -1"),
    ('{"timestamp": 1, "input_length": NaN, "output_length": 5}', "'input_length' is nan"),
    ('{"timestamp": 1, "input_length": true, "output_length": 5}', "'input_length' is True"),
    ('{"timestamp": 1, "input_length": "7", "output_length": 5}', "'input_length' is '7'"),
    ('{"timestamp": "noon", "input_length": 7, "output_length": 5}', "'timestamp' is 'noon'"),
    ('{"timestamp": 1, "input_length": 7, "output_length": 5, "hash_ids": [1, "a"]}', "'hash_ids'"),
]


@pytest.mark.parametrize(("line", "message"), JSONL_CASES)
def test_bad_jsonl_line(tmp_path: Path, line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}'
    p = _write(tmp_path, "m.jsonl", f"{good}\n{line}\n{good}\n")
    with pytest.raises(TraceFormatError, match="line 2: ") as info:
        read_trace(p, format="mooncake")
    assert message in str(info.value) and str(p) in str(info.value)
    r = read_trace(p, format="mooncake", skip_bad=True)
    assert len(r) == 2 and r.skipped == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("\n\n  \n", "is empty"),
        (AZURE_HEADER, "has no usable requests"),
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n", "column 'GeneratedTokens' is missing"),
        ("hello world\n", "cannot tell its format"),
        ('{"foo": 1}\n', "pass --format"),
        (AZURE_HEADER + "2023-11-16 18:15:46,0,5\n", "1 failed or zero-token"),
    ],
)
def test_unusable_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        read_trace(_write(tmp_path, "x.csv", text))


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="does not exist"):
        read_trace(tmp_path / "nope.csv")
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        read_trace(binary)
    with pytest.raises(TraceFormatError, match="unknown trace format 'parquet'"):
        read_trace(binary, format="parquet")


def test_chunked_reading_keeps_line_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across chunk boundaries, and after lines with a wrong field count were skipped."""
    monkeypatch.setattr(readers, "_CSV_CHUNK_ROWS", 4)
    rows = [f"{i},{10 + i},{1 + i}" for i in range(30)]
    rows[5] = "5,1,2,3"  # line 7: extra field
    rows[11] = "11,1,2,3"  # line 13
    rows[22] = "22,-4,1"  # line 24
    text = "Timestamp,Request tokens,Response tokens\n" + "\n".join(rows) + "\n"
    p = _write(tmp_path, "b.csv", text)
    with pytest.raises(TraceFormatError, match="line 7: malformed CSV"):
        read_trace(p, format="burstgpt")
    r = read_trace(p, format="burstgpt", skip_bad=True)
    assert r.skipped == 3 and [e.line for e in r.skipped_examples] == [7, 13, 24]
    assert "'Request tokens' is -4" in r.skipped_examples[2].reason
    assert len(r) == 27


def test_skip_bad_keeps_only_a_few_examples(tmp_path: Path) -> None:
    bad = "\n".join(f"{i},x,1" for i in range(50))
    p = _write(tmp_path, "b.csv", "Timestamp,Request tokens,Response tokens\n1,2,3\n" + bad)
    r = read_trace(p, format="burstgpt", skip_bad=True)
    assert r.skipped == 50 and len(r.skipped_examples) == 10 and len(r) == 1


def test_a_format_of_the_other_kind_names_the_asked_and_the_likely_format(
        tmp_path: Path) -> None:
    # issue 66: a CSV read with --format mooncake said "not valid JSON", a JSONL read with
    # --format azure "malformed CSV (Expected 82 fields ...)"
    csv = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n")
    with pytest.raises(TraceFormatError) as e:
        read_trace(csv, format="mooncake")
    msg = str(e.value)
    assert ("--format mooncake reads JSON lines, but the file is CSV and looks like azure; "
            "pass --format azure") in msg and "\n" not in msg
    jsonl = _write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": 10, '
                   '"output_length": 2, "hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError) as e:
        read_trace(jsonl, format="azure")
    assert ("--format azure reads CSV, but the file is JSON lines and looks like mooncake; "
            "pass --format mooncake") in str(e.value)
    assert len(read_trace(csv, format="azure")) == 1  # the right kind reads as before
