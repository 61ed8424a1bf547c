"""Helpers shared by tests/integration/test_history_check.py and tests/unit/test_history_check.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


SCRIPT = REPO / "scripts" / "check_history.py"


def _mod():
    spec = importlib.util.spec_from_file_location("check_history", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
