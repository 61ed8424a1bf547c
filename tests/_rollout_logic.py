"""Helpers shared by tests/integration/test_rollout_logic.py and tests/unit/test_rollout_logic.py."""

from __future__ import annotations

BOUNDS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
