"""KV ownership: a lease's lengths have one set of writers, its own methods (engine/kv/pool.py); its KV tensor is
written only by the lease's methods and the cache layers a forward writes through (at the slots its lengths give);
and the lengths advance in one place, engine/run/forward.py, once per forward: not in a cache layer, the C++ step or
a CUDA graph's replay (checked by running every arm, the C++ step and the graph path's bookkeeping)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch

from engine.arms.registry import Sampling
from engine.kv.pool import Lease
from tests.conftest import ROOT

OWNERS = {("engine/kv/pool.py", "Lease"), ("engine/kv/pool.py", "KVPool")}
MUTATORS = {"copy_", "index_copy_", "index_put_", "fill_", "zero_", "normal_", "masked_fill_", "scatter_"}
KV_TENSORS = {"data", "raw", "base"}  # a lease's or pool's tensor, however reached
ADVANCER = "engine/run/forward.py"


def _writes_lengths(target: ast.expr) -> bool:
    """Whether an assignment target is ``x.lengths`` / ``x._lengths`` (or a subscript of one; also in a tuple)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_writes_lengths(t) for t in target.elts)
    if isinstance(target, ast.Subscript):
        target = target.value
    # a script's ``args.lengths`` is a command-line option, not a lease's
    return isinstance(target, ast.Attribute) and target.attr in ("lengths", "_lengths") and \
        not (isinstance(target.value, ast.Name) and target.value.id == "args")


def _reaches(node: ast.expr) -> set[str]:
    """The attribute names on the way down to the object ``node`` mutates (``a.data[0].b`` -> {data, b})."""
    names = set()
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    return names


def kv_writes(path: Path, rel: str) -> list[str]:
    """``rel:line`` of each write to a lease's lengths or KV tensor outside an owner class's methods."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and (rel, node.name) in OWNERS:
            allowed |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_writes_lengths(t) or (isinstance(t, ast.Subscript) and _reaches(t.value) & KV_TENSORS)
                   for t in targets):
                found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and _reaches(node.func.value) & KV_TENSORS:
            found.append(node.lineno)
    return [f"{rel}:{n}" for n in sorted(found)]


def test_only_a_leases_own_methods_write_its_lengths_or_its_kv():
    found = []
    for folder in ("engine", "studio", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += kv_writes(path, path.relative_to(ROOT).as_posix())
    assert found == [], "write KV and lengths through the lease's methods (engine/kv/pool.py): " + ", ".join(found)


def test_the_check_sees_a_write_from_outside(tmp_path):
    code = ("class Lease:\n    def reset(self):\n        self._lengths = [0]\n\n"
            "def rebuild(buf):\n    buf.lengths = [0] * 3\n    buf._lengths[1] += 2\n    a, buf.lengths = 1, []\n"
            "    buf.data[0, :, 0].copy_(x)\n    buf.raw[1] = 0\n    x.data = 3\n")
    path = tmp_path / "x.py"
    path.write_text(code)
    assert kv_writes(path, "engine/kv/pool.py") == [f"engine/kv/pool.py:{n}" for n in (6, 7, 8, 9, 10)]
    assert kv_writes(path, "engine/arms/routed.py") == [f"engine/arms/routed.py:{n}" for n in (3, 6, 7, 8, 9, 10)]


def _advancers(monkeypatch) -> list[str]:
    """Where each Lease.advance is called from, as it is (a file relative to the checkout)."""
    seen, real = [], Lease.advance

    def spy(self, n):
        seen.append(Path(sys._getframe(1).f_code.co_filename).resolve().relative_to(ROOT).as_posix())
        return real(self, n)

    monkeypatch.setattr(Lease, "advance", spy)
    return seen


def test_every_arm_advances_lengths_only_in_the_forward_module(tiny_engine, monkeypatch):
    seen = _advancers(monkeypatch)
    cfg = tiny_engine.config.with_(arms=("baseline", "prefix", "cached", "blend", "routed"), blend=0.5)
    tiny_engine.compare("<schema name='s'><module name='a'>The red fox jumps over the lazy dog near the bank."
                        "</module></schema>", "<prompt schema='s'><a/> What jumps?</prompt>", Sampling(4), config=cfg)
    assert seen and set(seen) == {ADVANCER}


def test_the_c_step_and_a_graphs_replay_leave_the_count_to_the_forward_module(tiny_engine, monkeypatch):
    """The graph path's bookkeeping on the CPU (capture and replay replaced by the forward they record), and a
    step through the C++ decoder where the kernels are built: each counted once, by the forward module."""
    from engine.model import graphs, kernels
    from engine.run import forward
    from engine.run.pools import pool_of

    seen = _advancers(monkeypatch)
    lm = tiny_engine.lm
    monkeypatch.setattr(graphs, "_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(graphs._Graph, "capture", lambda self: None)
    monkeypatch.setattr(graphs._Graph, "replay", lambda self: self._forward().clone())
    graphs.set_mode(lm.model, "on")
    try:
        lease = pool_of(lm).lease(16)
        with torch.inference_mode():
            forward.prefill(lm, lease, [5, 6, 7], [0, 1, 2])
            forward.step(lm, [forward.Row(lease, 8, 3)])
        assert lease.length == 4 and graphs.captured(lm.model) == 2
        lease.release()
    finally:
        graphs.set_mode(lm.model, "auto")
        graphs._graphs.pop(lm.model, None)
    assert seen == [ADVANCER, ADVANCER]
    if kernels.ops() is not None:
        from tests.engine.test_step import _model, _pool

        model = _model("llama", "int8", 4096)
        fast = type("LM", (), {"model": model, "weights": "int8", "device": "cpu", "attention": "pml"})()
        lease = _pool(model).lease(8)
        with torch.inference_mode():
            forward.step(fast, [forward.Row(lease, 8, 0)])
        assert lease.length == 1 and seen[-1] == ADVANCER
