"""scripts/check_history.py: the repository describes the product, not the history of the (the pure part: no server, no subprocess; the rest is tests/integration/test_history_check.py)"""

from __future__ import annotations

import pytest

from tests._history_check import _mod


@pytest.mark.parametrize("line", [
    "The twenty-third session measured it: three repeats on one server.",
    "A second H200 session found why staggered streams ran at half speed.",
    "`nvidia-h200-x2` has not been lent since the first session.",
    "x2 was not lent this session",
    "staged with experiments/poll-lib.sh, then `bash proof-x2.sh`",
    "see experiments/GPU-SESSIONS.md for the plan",
    "the device budget of 30 device-minutes",
    "the capacity results (session of 2026-11-30 15:43)",
])
def test_history_is_found(line: str) -> None:
    assert list(_mod().findings(line)), line


@pytest.mark.parametrize("line", [
    "The client reuses one aiohttp.ClientSession per replay (HTTP sessions keep connections).",
    "Each request carries a `session_id` so that a multi-turn session hits the prefix cache.",
    "The server runs in its own process session (`start_new_session=True`, `setsid`).",
    "A session-scoped fixture starts one CPU vLLM server for the whole test session.",
    "Add this session's account to what earlier sessions of the study recorded.",
    "`budget_left_s`: what is left of the kernel tuning's budget now.",
    "Where the device time goes: start, warm-up, measuring, idle.",
    "One NVIDIA H200, vLLM 0.26; `autotune best --gpu \"NVIDIA H200\"`.",
    "make_bundle.py writes `.gpu/p0 ... .gpu/pN`.",
])
def test_ordinary_uses_pass(line: str) -> None:
    assert not list(_mod().findings(line)), line
