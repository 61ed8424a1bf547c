"""docs/faults.md and the fault suite name the same tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "faults.md"


def _tests() -> set[str]:
    names = set()
    for f in HERE.glob("test_faults_*.py"):
        if f.name == Path(__file__).name:
            continue
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(f"{f.name}::{node.name}")
    return names


def test_every_fault_test_is_in_the_table_and_every_row_names_a_test() -> None:
    doc = DOC.read_text()
    named = set(re.findall(r"(test_faults_\w+\.py::test_\w+)", doc))
    tests = _tests()
    assert tests - named == set(), "tests missing from docs/faults.md"
    assert named - tests == set(), "docs/faults.md names tests that do not exist"


def test_tests_named_elsewhere_in_the_doc_exist() -> None:
    defined = set()
    for f in HERE.parent.rglob("test_*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef):
                defined.add(node.name)
    mentioned = set(re.findall(r"\b(test_[a-z0-9_]+)\b(?!\.py)", DOC.read_text()))
    assert mentioned - defined == set()
