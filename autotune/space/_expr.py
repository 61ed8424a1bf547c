"""The small, safe expression language of a search space's rules and conditions.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

from autotune.errors import SpaceError

_BINOPS: dict[type[ast.AST], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}  # fmt: skip


_CMPOPS: dict[type[ast.AST], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}  # fmt: skip


_FUNCS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "int": int, "abs": abs}


class _Expr:
    """A parsed, validated expression over knob values and model facts."""

    def __init__(self, source: str, names: set[str], where: str) -> None:
        self.source = source
        try:
            self._tree = ast.parse(source, mode="eval")
        except SyntaxError as exc:
            raise SpaceError(f"{where}: cannot parse expression {source!r}: {exc.msg}") from None
        for node in ast.walk(self._tree):
            if isinstance(node, ast.Name) and node.id not in names and node.id not in _FUNCS:
                known = ", ".join(sorted(names))
                raise SpaceError(
                    f"{where}: expression {source!r} names {node.id!r}, which is neither a "
                    f"knob nor a fact; known names: {known}"
                )
            if not isinstance(
                node,
                (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
                 ast.BinOp, ast.Compare, ast.Name, ast.Load, ast.Constant, ast.List, ast.Tuple,
                 ast.Call, ast.IfExp, *_BINOPS, *_CMPOPS),
            ):  # fmt: skip
                raise SpaceError(
                    f"{where}: {type(node).__name__} is not allowed in expression {source!r}"
                )
        self.names = {n.id for n in ast.walk(self._tree) if isinstance(n, ast.Name)} - set(_FUNCS)

    def __call__(self, env: Mapping[str, Any]) -> Any:
        try:
            return self._eval(self._tree.body, env)
        except TypeError:
            # Comparing an inactive knob (None) with a number: the rule does not apply.
            return None

    def _eval(self, node: ast.AST, env: Mapping[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._eval(e, env) for e in node.elts]
        if isinstance(node, ast.BoolOp):
            vals = (self._eval(v, env) for v in node.values)
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.UnaryOp):
            v = self._eval(node.operand, env)
            return (not v) if isinstance(node.op, ast.Not) else -v
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](self._eval(node.left, env), self._eval(node.right, env))
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, env)
            for op, comp in zip(node.ops, node.comparators, strict=True):
                right = self._eval(comp, env)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            chosen = node.body if self._eval(node.test, env) else node.orelse
            return self._eval(chosen, env)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return _FUNCS[node.func.id](*(self._eval(a, env) for a in node.args))
        raise SpaceError(f"unsupported expression {self.source!r}")  # pragma: no cover
