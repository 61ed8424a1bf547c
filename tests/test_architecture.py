"""The layering of autotune/ (docs/architecture.md): no import cycle, no long function.

Read from the source (AST), not by importing: every ``import`` counts, at module level and
inside functions (a function-level import only hides a cycle until the function runs);
imports under ``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PKG = REPO / "autotune"
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name ``tree`` imports (absolute), TYPE_CHECKING blocks left out."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = _imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in targets if t in mods and t != name and t not in own_packages}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    a = ast.parse("import x.b\ndef f():\n    from x.c import g\n")
    assert _imports(a, "x.a", False) == {"x.b", "x.c", "x.c.g"}
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.b\n")
    assert "x.b" not in _imports(hidden, "x.a", False)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_autotune() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (module- or function-level imports): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_schema_is_the_bottom_of_the_study_layer() -> None:
    graph = _graph()
    # stats is pure (numpy, scipy): the verdict's interval, read by every reader of a study;
    # hardware answers whether a trial's tuner process on this host still runs;
    # credentials (stdlib only) keeps a storage URL's password out of its messages
    assert graph["autotune.schema"] <= {"autotune.errors", "autotune.stats", "autotune.hardware",
                                        "autotune.credentials"}
    assert graph["autotune.credentials"] == set()
    assert graph["autotune.stats"] == set()
    assert graph["autotune.hardware"] == set()
    for reader in ("autotune.registry", "autotune.plots"):
        assert "autotune.study" not in graph[reader], reader


def test_no_function_longer_than_120_lines() -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long
