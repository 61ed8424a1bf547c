"""scripts/check_history.py: the repository describes the product, not the history of the
project's own runs or how its GPU host was obtained; it names file and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests._history_check import SCRIPT, _mod


def test_the_repository_tells_no_run_history() -> None:
    found = _mod().check(_mod().tracked())
    assert not found, "\n".join(found)


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
