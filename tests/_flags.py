"""Helpers shared by tests/integration/test_flags.py and tests/unit/test_flags.py."""

from __future__ import annotations

from pathlib import Path

from autotune.space import ModelFacts

REPO = Path(__file__).resolve().parents[1]


SPACES = sorted((REPO / "search_spaces").glob("*.yaml"))


FACTS = ModelFacts(hybrid=True, mtp=True, device="cuda")  # every knob active
