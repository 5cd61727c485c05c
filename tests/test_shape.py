"""The code's static shape (issue 13): arrows point one way, and no function grows past 100 lines.

Read from the source with `ast`, so imports inside functions count too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from conftest import ROOT

MAX_LINES = 100
FORBIDDEN_IN_ENGINE = ("gradio", "studio", "bench")


def python_files(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_roots(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_engine_imports_nothing_above_it():
    offenders = {f.relative_to(ROOT).as_posix(): sorted(imported_roots(ast.parse(f.read_text())) &
                                                          set(FORBIDDEN_IN_ENGINE))
                 for f in python_files("engine")}
    assert {f: bad for f, bad in offenders.items() if bad} == {}


@pytest.mark.parametrize("package", ["engine", "studio"])
def test_no_function_over_100_lines(package):
    long = []
    for f in python_files(package):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_the_checker_sees_long_functions_and_upward_imports():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    tree = ast.parse(f"def f():\n    import gradio\n    from studio import app\n{body}\n")
    fn = tree.body[0]
    assert fn.end_lineno - fn.lineno + 1 > MAX_LINES
    assert imported_roots(tree) >= {"gradio", "studio"}
