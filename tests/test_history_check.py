"""scripts/check_history.py: the repository describes the product, not the history of the
project's own runs or how its GPU host was obtained; it names file and line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_history.py"


def _mod():
    spec = importlib.util.spec_from_file_location("check_history", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_repository_tells_no_run_history() -> None:
    found = _mod().check(_mod().tracked())
    assert not found, "\n".join(found)


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


def test_the_script_names_file_and_line_and_fails(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("# Notes\n\nThe ninth session ran the study.\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "notes.md")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 1
    assert f"{tmp_path / 'notes.md'}:3: 'ninth session'" in done.stdout
    clean = tmp_path / "ok.md"
    clean.write_text("A study measures each config on a fresh server.\n")
    assert subprocess.run([sys.executable, str(SCRIPT), str(clean)], cwd=tmp_path,
                          timeout=60).returncode == 0
