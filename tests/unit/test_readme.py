"""README.md as a first-time user reads it: the install step comes before any command."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_install_step_comes_before_the_first_autotune_command() -> None:
    text = README.read_text()
    blocks = re.findall(r"```(?:bash|console)?\n(.*?)```", text, flags=re.S)
    first_setup = next(i for i, b in enumerate(blocks) if "scripts/setup.sh" in b)
    first_autotune = next(i for i, b in enumerate(blocks)
                          if re.search(r"^\s*(?:\S+/)?autotune |scripts/demo\.sh", b, re.M))
    assert first_setup <= first_autotune, blocks[first_autotune]
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "scripts/setup.sh" in quick and "activate" in quick
