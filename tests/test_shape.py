"""The code's static shape (issues 13 and 16): arrows point one way, and nothing grows too long —
no function over 60 lines, no class over 250 (methods included) in engine/ or studio/, no file in
engine/ over 600.

Read from the source with `ast`, so imports inside functions count too.
"""

from __future__ import annotations

import ast
import pathlib

from conftest import ROOT

MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_ENGINE_FILE_LINES = 600
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


def oversized(tree: ast.AST) -> list[tuple[int, str, int]]:
    """(line, name, lines) of each function over MAX_FUNCTION_LINES and class over MAX_CLASS_LINES."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append((node.lineno, node.name, n))
    return out


def test_no_long_function_class_or_engine_file():
    long = []
    for f in python_files("engine") + python_files("studio"):
        text, name = f.read_text(), f.relative_to(ROOT).as_posix()
        long += [f"{name}:{line} {what} ({n} lines)" for line, what, n in oversized(ast.parse(text))]
        if name.startswith("engine/") and len(text.splitlines()) > MAX_ENGINE_FILE_LINES:
            long.append(f"{name} ({len(text.splitlines())} lines)")
    assert long == []


def test_the_checker_sees_long_functions_long_classes_and_upward_imports():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    tree = ast.parse(f"def f():\n    import gradio\n    from studio import app\n{body}\n")
    assert imported_roots(tree) >= {"gradio", "studio"}
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(MAX_CLASS_LINES // 3 + 1))
    assert [name for _, name, _ in oversized(ast.parse(f"def f():\n{body}\n\n\nclass C:\n{methods}"))] == ["f", "C"]
