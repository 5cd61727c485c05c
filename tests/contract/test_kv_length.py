"""A KV buffer's length has one set of writers: the buffer's own methods (``KVBuffer`` in engine/kv/buffer.py,
``BatchedKV`` in engine/kv/batched.py). Everything else (a forward's cache layer, the C++ step, a graph's replay,
an arm rebuilding its buffer, the decode loop) goes through ``advance`` / ``reset`` / the write methods."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

OWNERS = {("engine/kv/buffer.py", "KVBuffer"), ("engine/kv/batched.py", "BatchedKV")}


def _writes_lengths(target: ast.expr) -> bool:
    """Whether an assignment target is ``x.lengths`` or ``x.lengths[...]`` (also inside a tuple)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_writes_lengths(t) for t in target.elts)
    if isinstance(target, ast.Subscript):
        target = target.value
    # a script's ``args.lengths`` is a command-line option, not a buffer's
    return isinstance(target, ast.Attribute) and target.attr == "lengths" and \
        not (isinstance(target.value, ast.Name) and target.value.id == "args")


def length_writes(path: Path, rel: str) -> list[str]:
    """``rel:line`` of each assignment to ``.lengths`` outside an owner class's methods."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and (rel, node.name) in OWNERS:
            allowed |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        if id(node) not in allowed and any(_writes_lengths(t) for t in targets):
            found.append(node.lineno)
    return [f"{rel}:{n}" for n in sorted(found)]


def test_only_the_buffers_own_methods_write_a_kv_length():
    found = []
    for folder in ("engine", "studio", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += length_writes(path, path.relative_to(ROOT).as_posix())
    assert found == [], "write the KV length through the buffer's advance / reset / write methods: " + ", ".join(found)


def test_the_check_sees_a_write_from_outside(tmp_path):
    code = ("class KVBuffer:\n    def reset(self):\n        self.lengths = [0]\n\n"
            "def rebuild(buf):\n    buf.lengths = [0] * 3\n    buf.lengths[1] += 2\n    a, buf.lengths = 1, []\n")
    path = tmp_path / "x.py"
    path.write_text(code)
    assert length_writes(path, "engine/kv/buffer.py") == ["engine/kv/buffer.py:6", "engine/kv/buffer.py:7",
                                                          "engine/kv/buffer.py:8"]
    assert length_writes(path, "engine/arms/routed.py") == [f"engine/arms/routed.py:{n}" for n in (3, 6, 7, 8)]
