"""Helpers shared by tests/integration/test_objective.py and tests/unit/test_objective.py."""

from __future__ import annotations

from tests.conftest import REPO

OPEN = REPO / "traffic" / "azure-conv-2k.json"  # fitted from a trace: open loop, 5.53 req/s


CLOSED = REPO / "traffic" / "example-chat.json"  # closed loop, 8 streams
