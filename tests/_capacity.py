"""Helpers shared by tests/integration/test_capacity.py and tests/unit/test_capacity.py."""

from __future__ import annotations

from tests.conftest import REPO

SHAPE = REPO / "traffic" / "example-chat.json"  # recorded 5.53 req/s, outputs p50 43
