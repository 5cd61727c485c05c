"""The decorated function's `def` node, errors located in its file, and names in its scope."""

from __future__ import annotations

import ast
import linecache
import sys
import typing
from dataclasses import dataclass

from engine.errors import Problem
from engine.programs.model import MISSING, ProgramError


@dataclass(frozen=True)
class Definition:
    """A function being compiled."""

    func: typing.Callable
    node: ast.FunctionDef
    source: str  # its file
    chat: bool

    @property
    def name(self) -> str:
        return self.func.__name__

    def error(self, node, message: str, hint: str = "") -> ProgramError:
        """A ProgramError at ``node``."""
        line = getattr(node, "lineno", self.node.lineno)
        col = getattr(node, "col_offset", 0) + 1
        return ProgramError(Problem(self.source, line, col, message, hint))

    def resolve(self, func_node):
        """The object a call's function expression names, without running anything."""
        if isinstance(func_node, ast.Name):
            closure = dict(zip(self.func.__code__.co_freevars,
                               [c.cell_contents if _cell_full(c) else MISSING for c in (self.func.__closure__ or ())]))
            if func_node.id in closure:
                return closure[func_node.id]
            if func_node.id in self.func.__globals__:
                return self.func.__globals__[func_node.id]
            builtins = self.func.__globals__.get("__builtins__", {})
            builtins = builtins if isinstance(builtins, dict) else vars(builtins)
            return builtins.get(func_node.id, MISSING)
        if isinstance(func_node, ast.Attribute):
            base = self.resolve(func_node.value)
            if isinstance(base, type(sys)):  # modules only: no property runs
                return vars(base).get(func_node.attr, MISSING)
        return MISSING


def function_node(func, source: str) -> ast.FunctionDef:
    """The function's `def`, parsed from its whole file so positions are the file's."""
    linecache.checkcache(source)
    lines = linecache.getlines(source, func.__globals__)
    first = func.__code__.co_firstlineno
    where = Problem(source, first, 1, f"cannot read the source of {func.__name__}",
                    "define prompt programs in a .py file (not in a REPL or with exec)")
    if not lines:
        raise ProgramError(where)
    try:
        tree = ast.parse("".join(lines), filename=source)
    except SyntaxError:
        raise ProgramError(where) from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func.__name__:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if start == first:
                if isinstance(node, ast.AsyncFunctionDef):
                    raise ProgramError(Problem(source, node.lineno, node.col_offset + 1,
                                               "a prompt program cannot be async", "write `def`, not `async def`"))
                return node
    raise ProgramError(where)


def src(node) -> str:
    """``node`` as source text."""
    try:
        return ast.unparse(node)
    except Exception:
        return type(node).__name__


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
