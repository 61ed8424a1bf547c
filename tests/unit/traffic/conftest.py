"""Shared fixtures: excerpts of the public traces, committed in tests/data/traces (SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.traffic import TraceRecords, TrafficShape, fit_shape, read_trace

REPO = Path(__file__).resolve().parents[3]
TRACES = REPO / "tests" / "data" / "traces"
AZURE = TRACES / "azure2023_conv.csv"
MOONCAKE = TRACES / "mooncake_fast25_conversation.jsonl"
BURSTGPT = TRACES / "burstgpt1_head54.csv"


def _need(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"trace sample {path} is missing (committed in tests/data/traces)")
    return path


@pytest.fixture(scope="session")
def azure_path() -> Path:
    return _need(AZURE)


@pytest.fixture(scope="session")
def mooncake_path() -> Path:
    return _need(MOONCAKE)


@pytest.fixture(scope="session")
def burstgpt_path() -> Path:
    return _need(BURSTGPT)


@pytest.fixture(scope="session")
def azure_records(azure_path: Path) -> TraceRecords:
    return read_trace(azure_path)


@pytest.fixture(scope="session")
def mooncake_records(mooncake_path: Path) -> TraceRecords:
    return read_trace(mooncake_path)


@pytest.fixture(scope="session")
def azure_shape(azure_records: TraceRecords) -> TrafficShape:
    return fit_shape(azure_records, name="azure")


@pytest.fixture(scope="session")
def mooncake_shape(mooncake_records: TraceRecords) -> TrafficShape:
    return fit_shape(mooncake_records, name="mooncake")
