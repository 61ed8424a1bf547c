"""Helpers shared by tests/integration/test_preflight.py and tests/unit/test_preflight.py."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _package(root: Path) -> Path:
    """A package laid out like vLLM's start-up modules, not compiled."""
    from autotune.study import BYTECODE_PROBES

    pkg = root / "fakevllm"
    for rel in BYTECODE_PROBES:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("X = 1\n")
    return pkg
