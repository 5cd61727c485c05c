"""Engine functions take what they need in a few parameters: over MAX_PARAMS only with a one-line comment right
above the ``def`` that says why (a long signature usually wants a context object; gpt-fast's ``ModelArgs``)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

MAX_PARAMS = 7


def long_signatures(path: Path, rel: str) -> list[str]:
    """``rel:line name (n)`` of each function over MAX_PARAMS (self and cls not counted) without a comment line
    above its ``def`` (or its first decorator)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        n = len([x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")])
        n += (a.vararg is not None) + (a.kwarg is not None)
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        above = lines[first - 2].strip() if first >= 2 else ""
        if n > MAX_PARAMS and not above.startswith("#"):
            found.append(f"{rel}:{node.lineno} {node.name} ({n})")
    return found


def test_no_engine_function_takes_over_seven_parameters_without_saying_why():
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        found += long_signatures(path, path.relative_to(ROOT).as_posix())
    assert found == [], "pass a context, or say why in a comment above the def: " + ", ".join(found)


def test_the_check_sees_a_long_signature(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def a(self, b, c, d, e, f, g, h):\n    pass\n\n\ndef i(b, c, d, e, f, g, h, *j):\n    pass\n\n\n"
                    "# why\ndef k(b, c, d, e, f, g, h, j):\n    pass\n")
    assert long_signatures(path, "x.py") == ["x.py:5 i (8)"]
