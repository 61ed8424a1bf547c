"""Helpers shared by tests/unit/traffic/test_traffic_cli.py and tests/integration/test_traffic_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err
