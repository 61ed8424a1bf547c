"""Flags, JSON keys and env vars of a space checked against vLLM's own parser. (the pure part: no server, no subprocess; the rest is tests/integration/test_flags.py)"""

from __future__ import annotations

import re

import pytest

from autotune.engine._flags import (
    SUPPORTED,
    EngineSurface,
    check_space_flags,
    flag_table,
)
from autotune.space import load_space
from tests._flags import FACTS, REPO, SPACES


def _v(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", s)[:3])


def test_table_covers_every_release_of_the_supported_range() -> None:
    import json

    table = flag_table()
    newest = json.loads((REPO / "autotune/engine/vllm_flags.json").read_text())["newest_on_pypi"]
    lo, hi = SUPPORTED
    assert min(table, key=_v) == f"{lo[0]}.{lo[1]}.0"
    assert max(table, key=_v) == newest and _v(newest)[:2] < hi
    # every minor release in the range is there (0.27.1 too: patch releases were read)
    assert {_v(v)[:2] for v in table} == {(0, m) for m in range(lo[1], hi[1])}
    for entry in table.values():
        assert entry["checked"][0].startswith("argument parser of ")
        assert "--max-num-seqs" in entry["flags"] and "num_speculative_tokens" in (
            entry["json"]["--speculative-config"])
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'gpu = ["vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"]' in pyproject


@pytest.mark.parametrize("version", sorted(flag_table(), key=_v))
def test_translation_table_agrees_with_every_release(version: str) -> None:
    """Each committed space, translated for ``version``, emits only what it accepts."""
    surface = EngineSurface.from_dict(flag_table()[version])
    for path in SPACES:
        space = load_space(path, facts=FACTS)
        assert check_space_flags(space, surface) == [], (version, path.name)
