"""The layering of autotune/ (docs/architecture.md): the layer order, no import cycle, no
long function, no long file, few top-level modules.

Read from the source (AST), not by importing: every ``import`` counts, at module level and
inside functions (a function-level import only hides a cycle until the function runs);
imports under ``if TYPE_CHECKING:`` are left out (they never run), except in a package's
``__init__.py``, whose re-exports load on first use (``autotune.lazy_exports``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PKG = REPO / "autotune"
MAX_FUNCTION_LINES = 120
# the load generator and a trial: a mode is a small strategy (load/_modes.py, _hooks.py),
# not a branch of one function that serves every mode
MAX_FUNCTION_LINES_BY_PACKAGE = {"load": 80, "trial": 80}
MAX_FILE_LINES = 600
MAX_TOP_LEVEL_MODULES = 8  # autotune/*.py, __init__ and __main__ included

# The layers, bottom to top: the one place that says which package may import which. A
# module may import its own layer and the layers below it, never one above. A name is a
# top-level module (``errors``) or a package (``store``); "autotune" is autotune/__init__.
LAYERS: list[tuple[str, ...]] = [
    ("autotune", "errors", "credentials", "hardware", "cost", "config", "events", "records"),
    ("parallelism", "traffic"),
    ("space",),
    ("load",),
    ("measure",),
    ("store",),
    ("engine",),
    ("quality",),
    ("trial",),
    ("exec", "kernels", "testing"),
    ("results", "report"),
    ("study",),
    ("deploy", "rollout", "watch"),
    ("cli", "__main__"),
]


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


def _imports(tree: ast.AST, module: str, is_package: bool, *,
             type_checking: bool = False) -> set[str]:
    """Every module name ``tree`` imports (absolute), TYPE_CHECKING blocks left out unless
    ``type_checking`` (a package's face: its names load lazily, on first use)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
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
        face = path.name == "__init__.py"  # re-exports load lazily: they count as imports
        targets = _imports(ast.parse(path.read_text()), name, face, type_checking=face)
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


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "autotune"


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    out = []
    for module, targets in sorted(graph.items()):
        here = rank.get(_layer_of(module))
        if here is None:
            out.append(f"{module}: in no layer (add its package to LAYERS)")
            continue
        out += [f"{module} -> {t}" for t in sorted(targets) if rank[_layer_of(t)] > here]
    return out


def test_the_layer_check_finds_an_upward_import() -> None:
    assert _upward_imports({"autotune.store._keys": {"autotune.study"}}) == [
        "autotune.store._keys -> autotune.study"]
    assert _upward_imports({"autotune.study._loop": {"autotune.store"}}) == []
    assert _upward_imports({"autotune.nowhere": set()}) == [
        "autotune.nowhere: in no layer (add its package to LAYERS)"]


def test_a_lower_layer_never_imports_a_higher_one() -> None:
    up = _upward_imports(_graph())
    assert not up, "imports that run up the layers (see LAYERS): " + "; ".join(up)


def test_the_store_is_the_bottom_of_the_study_layer() -> None:
    graph = _graph()
    # the statistics are pure (numpy, scipy; the segment rule's defaults are the
    # measurement settings', from config, the bottom layer): the verdict's interval, read by
    # every reader of a study; hardware answers whether a trial's tuner process on this host still runs;
    # credentials (stdlib only) keeps a storage URL's password out of its messages
    store = set().union(*(t for m, t in graph.items() if _layer_of(m) == "store"))
    assert {_layer_of(t) for t in store} <= {"store", "errors", "measure", "hardware",
                                              "credentials"}
    assert {t for t in store if _layer_of(t) == "measure"} <= {"autotune.measure._stats"}
    assert graph["autotune.credentials"] == set()
    assert graph["autotune.measure._stats"] <= {"autotune.config"}
    assert graph["autotune.hardware"] == set()
    for module, targets in graph.items():
        if _layer_of(module) == "results":
            assert not any(_layer_of(t) == "study" for t in targets), module


def test_few_modules_at_the_top_of_the_package() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(top)} modules at the top of autotune/ (at most {MAX_TOP_LEVEL_MODULES}): "
        f"{top}; move a module into the package of its layer")


def test_no_file_longer_than_600_lines() -> None:
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, long


def _long_functions(packages: set[str] | None, limit: int) -> list[str]:
    """Functions (and methods) of ``packages`` (all of autotune/ when None) over ``limit``
    lines, decorators left out, the docstring counted."""
    long = []
    for name, path in _modules().items():
        if packages is not None and _layer_of(name) not in packages:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    long.append(f"{name}.{node.name}: {n} lines")
    return long


def test_no_function_longer_than_120_lines() -> None:
    long = _long_functions(None, MAX_FUNCTION_LINES)
    assert not long, long


def test_no_function_longer_than_80_lines_in_the_load_generator_and_a_trial() -> None:
    for package, limit in MAX_FUNCTION_LINES_BY_PACKAGE.items():
        assert _long_functions({package}, 10), f"no function of autotune/{package}/ read"
        long = _long_functions({package}, limit)
        assert not long, (f"functions over {limit} lines in autotune/{package}/ (split a "
                          f"mode into a strategy, a step into a function): {long}")


def test_no_package_re_exports_a_name_of_one_of_its_modules() -> None:
    # importing the module ``pkg._x`` sets ``pkg._x`` to it, hiding a re-exported ``_x``
    clash = []
    for init in sorted(PKG.rglob("__init__.py")):
        modules = {p.stem for p in init.parent.iterdir() if p.suffix == ".py" or p.is_dir()}
        names = {a.asname or a.name for n in ast.walk(ast.parse(init.read_text()))
                 if isinstance(n, ast.ImportFrom) for a in n.names}
        clash += [f"{init.relative_to(REPO)}: {n}" for n in sorted(names & modules)]
    assert not clash, clash
