"""The code's shape, enforced: the engine's layers import one way, nothing imports a front end above it, no
import circles, and nothing grows too long.

The layer map (docs/architecture.md draws it), bottom to top; a module may import its own layer and the ones
below, never one above — imports inside functions and under ``TYPE_CHECKING`` count, read with ``ast``:

    base         engine.errors · engine.limits · engine.owned · engine.devices · engine.files · engine.run.events
    language     engine.schema · engine.programs
    containers   engine.kv
    model        engine.model
    cache        engine.cache
    run          engine.run
    arms         engine.arms
    application  engine.config · engine.session · engine.runlog · engine.cli · engine.public · engine (its __init__)

Above the engine: studio/ (never bench/), then bench/. The engine never imports gradio, studio or bench; tools/
never imports bench. No import circles in engine/, studio/, bench/ or tools/, nor across them. bench/ is a package of
scripts (each runs as ``python bench/NAME.py``: it has a ``__main__`` guard) and of the modules they share; nothing
imports a script (tests/ may).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

LAYERS = (
    # engine.run.events imports nothing of the engine: every floor that yields an event (encoding, the arms) reads it
    ("base", ("engine.errors", "engine.limits", "engine.owned", "engine.devices", "engine.files", "engine.run.events")),
    ("language", ("engine.schema", "engine.programs")),
    ("containers", ("engine.kv",)),
    ("model", ("engine.model",)),
    ("cache", ("engine.cache",)),
    ("run", ("engine.run",)),
    ("arms", ("engine.arms",)),
    ("application", ("engine.config", "engine.session", "engine.runlog", "engine.cli", "engine.public", "engine")),
)
# studio/'s own floors, bottom to top (docs/architecture.md draws them beside the engine's): the same rule
STUDIO_LAYERS = (
    ("studio base", ("studio.errors", "studio.hosting", "studio.connections", "studio.streaming", "studio.shutdown",
               "studio.guard", "studio.live", "studio.pagescript", "studio.stale_events", "studio.kernel_words",
               "studio.recovery",
               "studio.builder", "studio.docqa")),
    ("studio views", ("studio.arm_views", "studio.views", "studio.settings", "studio.files")),
    ("studio api", ("studio.api",)),
    ("studio tabs", ("studio.state", "studio.benchmarks", "studio.tabs")),
    ("studio launch", ("studio.app", "studio.launch", "studio.cli", "studio")),
)
FRONT_ENDS = {"engine": {"gradio", "studio", "bench"}, "studio": {"bench"}, "tools": {"bench"}}
# What studio/ may import of the engine: the package, its application modules, and engine.public for the rest
STUDIO_READS = {"engine", "engine.public", "engine.errors", "engine.config", "engine.session", "engine.runlog"}
STUDIO_ALSO = {"studio.cli": {"engine.cli", "engine.cli_encode"}}  # the console script extends the engine's commands
PACKAGES = ("engine", "studio", "bench", "tools")
DYNAMIC = {"import_module", "__import__"}
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_ENGINE_FILE_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, here: str, package: bool) -> list[tuple[str, int]]:
    """(module, line) of every import in ``tree`` — relative ones resolved against ``here`` — including imports
    in functions, under TYPE_CHECKING, and ``importlib.import_module("...")`` with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".") if package else here.split(".")[:-1]
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            out += [(f"{module}.{a.name}" if _is_module(f"{module}.{a.name}") else module, node.lineno)
                    for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in DYNAMIC \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.append((node.args[0].value, node.lineno))
    return out


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index of ``module``'s layer (the longest matching prefix); None outside the map."""
    best, index = -1, None
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    return index


def graph(package: str = "engine") -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported module, line)] for every module of ``package``."""
    out = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        out[module_name(f)] = imports(ast.parse(f.read_text(encoding="utf-8")), module_name(f),
                                      f.name == "__init__.py")
    return out


def upward(edges: dict[str, list[tuple[str, int]]], layers=LAYERS) -> list[str]:
    bad = []
    for module, targets in edges.items():
        mine = layer_of(module, layers)
        for target, line in targets:
            theirs = layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{module}:{line} ({layers[mine][0]}) imports {target} ({layers[theirs][0]})")
    return bad


def circles(edges: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    nodes = {m: sorted({t for t, _ in ts if t in edges and t != m}) for m, ts in edges.items()}
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in nodes[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


# ----------------------------------------------------------------------------------------------
# The rules
# ----------------------------------------------------------------------------------------------

def test_every_engine_module_has_a_layer():
    assert [m for m in graph() if layer_of(m) is None] == []


def test_no_engine_import_runs_up_a_layer():
    assert upward(graph()) == []


def test_no_studio_import_runs_up_a_layer():
    assert len(upward({"studio.guard": [("studio.api.errors", 1)]}, STUDIO_LAYERS)) == 1
    assert upward(graph("studio"), STUDIO_LAYERS) == []


def test_every_studio_module_is_named_in_the_studio_map():
    """Only studio/__init__ falls back on the bare "studio" prefix: a new module is placed on purpose."""
    named = {p for _, prefixes in STUDIO_LAYERS for p in prefixes if p != "studio"}
    assert [m for m in graph("studio") if m != "studio" and not any(m == p or m.startswith(p + ".") for p in named)] == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    assert circles(graph(package)) == []


def test_no_import_circle_across_the_packages():
    assert circles({m: ts for package in PACKAGES for m, ts in graph(package).items()}) == []


def bench_scripts() -> set[str]:
    """The modules of bench/ that run as scripts: those with a ``__main__`` guard."""
    return {module_name(f) for f in (ROOT / "bench").glob("*.py")
            if re.search(r"^if __name__ == .__main__.:", f.read_text(encoding="utf-8"), re.M)}


def test_nothing_imports_a_bench_script():
    """A script's shared parts live in a module of bench/ that scripts import (measurement, workloads, peers,
    result records), so no script runs another's top level and no two scripts depend on each other."""
    scripts = bench_scripts()
    assert {"bench.report", "bench.fidelity", "bench.workload"} <= scripts and "bench.common" not in scripts
    found = [f"{m}:{line} imports {t}" for package in PACKAGES for m, ts in graph(package).items()
             for t, line in ts if t in scripts and t != m]
    assert found == []


def test_bench_scripts_import_their_siblings_through_the_package():
    """``from bench.common import ...``, never ``from common import ...``: one module object per file, whether a
    script runs it or a test imports it (a bare name made a second copy, and hid the edges from this test)."""
    siblings = {f.stem for f in (ROOT / "bench").glob("*.py")}
    bare = [f"{m}:{line} imports {t}" for m, ts in graph("bench").items() for t, line in ts
            if t.split(".")[0] in siblings]
    assert bare == []


def test_the_generate_loop_sits_below_the_arms():
    """engine.run never reaches up into engine.arms, and engine/arms/ holds only the registry, compare, repair and
    files that each register an arm."""
    up = [f"{m}:{line} imports {t}" for m, ts in graph().items() if m.split(".")[:2] == ["engine", "run"]
          for t, line in ts if t.startswith("engine.arms")]
    assert up == []
    shared = {"__init__", "registry", "compare", "repair"}
    loose = [f.name for f in sorted((ROOT / "engine" / "arms").glob("*.py"))
             if f.stem not in shared and "register(ArmSpec(" not in f.read_text(encoding="utf-8")]
    assert loose == []


def test_nothing_imports_a_front_end_above_it():
    offenders = [f"{module}:{line} imports {target}"
                 for package, forbidden in FRONT_ENDS.items()
                 for module, targets in graph(package).items()
                 for target, line in targets if target.split(".")[0] in forbidden]
    assert offenders == []


def test_the_studio_reads_the_engine_through_its_face():
    """Models, schemas and runs reach studio/ through ``engine`` and engine/public.py, never an internal module or the
    engine's CLI; engine.public is a door out (nothing in the engine imports it), every name it offers exists, and
    importing it loads no module behind it."""
    inside = [f"{m}:{line} imports {t}" for m, ts in graph("studio").items() for t, line in ts
              if t.split(".")[0] == "engine" and t not in STUDIO_READS | STUDIO_ALSO.get(m, set())]
    assert inside == []
    assert [m for m, ts in graph().items() if "engine.public" in {t for t, _ in ts}] == []
    import engine.public as public

    assert [name for name in public.__all__ if getattr(public, name, None) is None] == []
    code = "import sys, engine.public\nprint(sorted(m for m in ('torch', 'engine.session') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_engine_reads_no_benchmark_file():
    """The engine names no path into bench/ (a front end reads results and passes what it needs)."""
    parts = [f"{f.relative_to(ROOT)}:{node.lineno}" for f in sorted((ROOT / "engine").rglob("*.py"))
             for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and node.value in ("bench", "results", "bench/results")]
    assert parts == []


def test_importing_the_engine_loads_no_gradio():
    code = ("import sys, engine, engine.session, engine.runlog, engine.arms, engine.cli\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('gradio', 'studio', 'bench'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


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
    for f in [*sorted((ROOT / "engine").rglob("*.py")), *sorted((ROOT / "studio").rglob("*.py")),
              *sorted((ROOT / "bench").rglob("*.py"))]:
        text, name = f.read_text(), f.relative_to(ROOT).as_posix()
        long += [f"{name}:{line} {what} ({n} lines)" for line, what, n in oversized(ast.parse(text))]
        if name.startswith("engine/") and len(text.splitlines()) > MAX_ENGINE_FILE_LINES:
            long.append(f"{name} ({len(text.splitlines())} lines)")
    assert long == []


# ----------------------------------------------------------------------------------------------
# The checkers themselves
# ----------------------------------------------------------------------------------------------

def test_the_checkers_see_upward_imports_circles_and_long_code():
    tree = ast.parse("from engine.kv import KVBuffer\nimport bench.common\ndef f():\n    from ..run import timing\n"
                     "    importlib.import_module('studio.app')\nif TYPE_CHECKING:\n    from engine.session import Engine\n")
    found = imports(tree, "engine.cache.store", False)
    assert ("engine.run.timing", 4) in found and ("engine.session", 7) in found and ("studio.app", 5) in found
    edges = {"engine.cache.store": found, "engine.run.timing": [("engine.cache.store", 1)]}
    assert len(upward(edges)) == 2  # cache -> run, cache -> application
    assert circles(edges) == [["engine.cache.store", "engine.run.timing"]]
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(MAX_CLASS_LINES // 3 + 1))
    assert [name for _, name, _ in oversized(ast.parse(f"def f():\n{body}\n\n\nclass C:\n{methods}"))] == ["f", "C"]


def test_the_layer_map_is_drawn_in_the_docs():
    page = (ROOT / "docs" / "architecture.md").read_text()
    for name, prefixes in LAYERS:
        assert name in page and all(p.split(".")[-1] in page for p in prefixes if p != "engine"), name


def test_the_studio_layer_map_is_drawn_in_the_docs():
    page = (ROOT / "docs" / "architecture.md").read_text()
    for name, prefixes in STUDIO_LAYERS:
        assert name in page and all(p.split(".")[-1] in page for p in prefixes if p != "studio"), name
