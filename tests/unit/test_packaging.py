"""pyproject.toml: a distribution name of our own on PyPI, and extras that name it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_distribution_is_not_pypi_s_other_autotune_and_its_extras_name_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = project["name"]
    assert name == "vllm-autotune"  # "autotune" on PyPI is another project's
    assert project["scripts"] == {"autotune": "autotune.cli:main"}  # the command stays
    for extra, reqs in project["optional-dependencies"].items():
        for req in reqs:
            base = re.split(r"[\[<>=! ;]", req, maxsplit=1)[0]
            assert base != "autotune", f"extra {extra!r} names the other project: {req}"
    assert f"{name}[postgres]" in project["optional-dependencies"]["team"]
    assert f"{name}[team]" in project["optional-dependencies"]["dev"]
