"""The engine returns data; the front ends draw it. No public name in ``engine/`` — function, method, class,
class attribute, dataclass field or module constant — speaks of chips, bars, labels or colours: the words and
looks live in ``studio/`` (one view per arm in ``studio/arm_views/``) and in the CLI's text."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

WORDS = re.compile(r"chips|bars|label|colou?r", re.IGNORECASE)


def public_names(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of every public definition: functions and classes at any depth, the attributes and
    fields of classes, and module-level assignments."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.name, node.lineno))
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for st in node.body:
                targets = [st.target] if isinstance(st, ast.AnnAssign) else st.targets if isinstance(st, ast.Assign) else []
                out += [(t.id, st.lineno) for t in targets if isinstance(t, ast.Name)]
    return [(n, line) for n, line in out if not n.startswith("_")]


def test_no_public_name_in_the_engine_is_about_looks():
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, line in public_names(ast.parse(path.read_text())):
            if WORDS.search(name):
                found.append(f"{rel}:{line}: {name}")
    assert found == [], "words and looks belong to studio/ (arm views) or the CLI's text:\n" + "\n".join(found)


def test_every_arm_s_details_are_data():
    """No arm's detail type draws itself: its view (studio/arm_views/) does."""
    import engine.arms  # noqa: F401  (registers the arms)
    from engine.arms.registry import REGISTRY

    for spec in REGISTRY.values():
        if spec.detail is not None:
            assert not [m for m in dir(spec.detail) if WORDS.search(m)], spec.name


def test_a_runs_result_crosses_as_typed_fields():
    """No untyped channel carries what a run chose: nothing in engine/run/ holds an ``Any`` field or returns one,
    and the API reads a run's result by its fields (``ArmResult.routing``), never by ``getattr``."""
    loose = [f"engine/run/{p.name}:{node.lineno}" for p in sorted((ROOT / "engine" / "run").glob("*.py"))
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.AnnAssign) and "Any" in ast.unparse(node.annotation)]
    reads = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in sorted((ROOT / "studio" / "api").glob("*.py"))
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
             and re.search(r"\b(detail|run|res|comparison|result)\b|\.arm\(", ast.unparse(node.args[0]))]
    assert loose == [] and reads == []
