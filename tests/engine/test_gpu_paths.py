"""The GPU paths' CPU halves: layer-by-layer assembly, pinned storage's fallbacks, and the forward a CUDA graph
captures, each checked against the path it replaces on a tiny random-weight Llama (the CUDA runs themselves:
tests/gpu/)."""

from __future__ import annotations

import pytest
import torch

from tests.arm_runs import run_baseline
from tests.arm_runs import run_cached
from engine.arms.registry import Sampling
from engine.run.pools import pool_of
from engine.cache.store import ModuleStore
from engine.kv import KVPool, Lease, ModuleKV
from engine.kv import pinned as pinning
from engine.kv.layerwise import LayerCopies
from engine.model import graphs
from engine.model.attend import PLAIN

DOCS = ("The red fox jumps over the lazy dog near the river bank.",
        "Quantum computers use qubits that can hold superpositions of states.",
        "The library opens at nine and closes at five on weekdays.")
SCHEMA = """<schema name="three">
  <system>You answer questions about the documents.</system>
  <module name="d1">{0}</module>
  <module name="d2">{1}</module>
  <module name="d3">{2}</module>
</schema>""".format(*DOCS)
PROMPT = "<prompt schema='three'><d1/><d3/> Which animal jumps, and when does the library open?</prompt>"


def cached_runs(eng, mode: str, layerwise: bool, n: int = 8):
    lay = eng.layout(SCHEMA)
    plan = eng.plan(lay, PROMPT, max_new_tokens=n)
    enc = eng.encode(lay, eng.config.with_(mode=mode)).encoded
    space = pool_of(eng.lm)
    before, made, lease = space.layerwise, [], space.lease
    space.layerwise = layerwise
    space.lease = lambda tokens: made.append(lease(tokens)) or made[-1]  # the run's lease, seen as it is made
    try:
        run = run_cached(eng.lm, plan, enc, eng.store(), Sampling(n))
        copies = made[-1].copies
    finally:
        space.layerwise = before
        del space.lease
    return run, copies


# -- layer by layer ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["prefixed", "isolated"])
def test_layerwise_assembly_gives_bit_identical_logits_and_tokens(tiny_engine, mode):
    eager, none = cached_runs(tiny_engine, mode, layerwise=False)
    layered, copies = cached_runs(tiny_engine, mode, layerwise=True)
    assert none is None and copies is not None and copies.launched  # the copies were deferred to the first layer
    assert not any(copies.pending)
    assert torch.equal(layered.first_logits, eager.first_logits)
    assert layered.token_ids == eager.token_ids and len(eager.token_ids) > 1


def test_layerwise_is_off_by_default_on_the_cpu(tiny_lm):
    assert pool_of(tiny_lm).layerwise is False
    assert KVPool(2, 2, 4, torch.float32, "cpu", 1 << 20).layerwise is False


def test_deferred_writes_fill_the_buffer_as_direct_writes_do():
    torch.manual_seed(0)
    a = torch.randn(3, 2, 2, 5, 4)  # [layers, 2, kv_heads, n, head_dim]
    b = torch.randn(2, 2, 3, 4)  # one layer's [2, kv_heads, n, head_dim]
    direct = Lease(torch.zeros(3, 2, 1, 2, 16, 4))
    deferred = Lease(torch.zeros(3, 2, 1, 2, 16, 4), layerwise=True)
    for buf in (direct, deferred):
        buf.write(a)
        buf.write_layer(1, b)
    assert deferred.copies.waiting and not deferred.raw.any()  # nothing copied before the forward asks
    assert deferred.lengths == direct.lengths == (5, 8, 5)
    deferred.ready(0)  # the first layer's update launches every copy (synchronously on the CPU)
    assert not deferred.copies.waiting
    assert torch.equal(deferred.data, direct.data)


def test_reading_the_data_settles_the_copies():
    buf = Lease(torch.zeros(2, 2, 1, 1, 8, 2), layerwise=True)
    buf.write(torch.ones(2, 2, 1, 3, 2))
    assert float(buf.data.sum()) == 2 * 2 * 3 * 2
    assert repr(LayerCopies(2, "cpu")).startswith("LayerCopies(layers=2")


# -- pinned storage ------------------------------------------------------------------------------

def entry(n: int = 4) -> ModuleKV:
    return ModuleKV(torch.randn(2, 2, 1, n, 4), torch.arange(n), torch.arange(n))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_a_store_asked_to_pin_without_cuda_says_cuda_only_and_stores_pageable():
    store = ModuleStore("cpu", page_locked=True)
    kept = store.put("k", entry())
    assert not store.pinning.active and "CUDA only" in store.pinning.why
    assert not pinning.is_page_locked(kept)
    assert store.stats()["page_locked"] == store.pinning.why and store.stats()["page_locked_bytes"] == 0


def test_a_store_on_a_cpu_model_does_not_pin():
    store = ModuleStore("cpu")
    assert store.pinning.why.startswith("off: CUDA only") and not store.pinning.wanted


def test_an_os_refusal_stores_the_entry_pageable_and_says_so(monkeypatch):
    def refuse(entry):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(pinning, "page_locked", refuse)
    store = ModuleStore("cpu")
    store.pinning = pinning.PinState(True, active=True, why="on")
    e = entry()
    kept = store.put("k", e)
    assert kept is e and store.get("k") is e  # stored, unpinned
    assert store.pinning.failures == 1 and "refused" in store.pinning.why and "ulimit -l" in store.pinning.why
    assert "cudaHostAlloc" in store.stats()["page_locked"]


def test_pinned_bytes_follow_puts_and_evictions(monkeypatch):
    monkeypatch.setattr(pinning, "page_locked", lambda e: ModuleKV(e.kv.clone(), e.positions, e.token_ids))
    monkeypatch.setattr(pinning, "is_page_locked", lambda e: True)
    store = ModuleStore("cpu")
    store.pinning = pinning.PinState(True, active=True, why="on")
    e = entry()
    store.put("k", e)
    assert store.pinning.pinned_bytes == e.nbytes
    store.evict("k")
    assert store.pinning.pinned_bytes == 0


# -- CUDA graphs -----------------------------------------------------------------------------------

def test_graphs_never_apply_on_the_cpu(tiny_lm):
    graphs.set_mode(tiny_lm.model, "on")
    try:
        buf = KVPool(tiny_lm.n_layers, tiny_lm.kv_heads, tiny_lm.head_dim, torch.float32, "cpu", 1 << 20).lease(16)
        assert graphs.forward(tiny_lm, buf.cache(), [1, 2], [0, 1], PLAIN) is None
        assert graphs.status(tiny_lm.model).startswith("off: CUDA only")
    finally:
        graphs.set_mode(tiny_lm.model, "auto")
    with pytest.raises(ValueError, match="auto, on, off"):
        graphs.set_mode(tiny_lm.model, "yes")


@pytest.mark.parametrize("n_new", [1, 3, 5])
def test_the_captured_forward_equals_the_eager_one(tiny_lm, n_new):
    """What a graph records (static cache over the pool, the lease's window read from its first slot, slot mask,
    padded bucket, the last real token's logits) run uncaptured on the CPU, against the eager forward over the
    lease; the lease is not the pool's first, and its neighbour's slots hold garbage the graph must not read."""
    model, dims = tiny_lm.model, (tiny_lm.n_layers, tiny_lm.kv_heads, tiny_lm.head_dim, torch.float32, "cpu")
    prefix, new = list(range(100, 112)), list(range(300, 300 + n_new))
    pos = list(range(20, 20 + n_new))  # gapped after the prefix, as a cached run's question is
    token_bytes = 2 * tiny_lm.n_layers * tiny_lm.kv_heads * tiny_lm.head_dim * 4
    pool = KVPool(*dims, budget_bytes=64 * token_bytes)
    pool.lease(5).raw.normal_()
    lease = pool.lease(32)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prefix]), position_ids=torch.arange(12)[None], past_key_values=lease.cache(),
              use_cache=True)
        lease.advance(12)
        base = pool.data.clone()  # the pool after the prefix: what the graph starts from
        eager = model(input_ids=torch.tensor([new]), position_ids=torch.tensor([pos]), past_key_values=lease.cache(),
                      use_cache=True, logits_to_keep=1).logits[0, -1]
        g = graphs._Graph(model, base, graphs._bucket(n_new), 64)
        g.feed(new, pos, lease.start + 12, lease.start)
        static = g._forward()[0]
    assert g.bucket >= n_new
    assert torch.allclose(static, eager, atol=1e-5), float((static - eager).abs().max())
    assert int(static.argmax()) == int(eager.argmax())
    written = slice(lease.start + 12, lease.start + 12 + n_new)
    assert torch.allclose(base[..., written, :], pool.data[..., written, :], atol=1e-5)


def test_a_baseline_and_cached_run_are_unchanged_by_the_graph_hook_on_the_cpu(tiny_engine):
    lay = tiny_engine.layout(SCHEMA)
    plan = tiny_engine.plan(lay, PROMPT, max_new_tokens=4)
    a = run_baseline(tiny_engine.lm, plan, Sampling(4))
    b = run_baseline(tiny_engine.lm, plan, Sampling(4))
    assert a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)
    assert graphs.captured(tiny_engine.lm.model) == 0


def test_every_arm_is_bit_identical_with_layerwise_copies(tiny_engine):
    """The arms that read stored KV in other ways (the prefix tree, blend's and routing's passes over a filled
    buffer, a rebuilt buffer) give the same logits and tokens with copies deferred to the first layer."""
    from engine.session import Engine

    cfg = tiny_engine.config.with_(arms=("baseline", "prefix", "cached", "blend", "routed"), blend=0.5)
    def arms(layerwise: bool) -> dict:
        eng = Engine.from_loaded(tiny_engine.lm)  # a fresh engine each time: the prefix arm's tree starts empty
        eng.pool.layerwise = layerwise
        c = eng.compare(SCHEMA, PROMPT, Sampling(6), config=cfg)
        return {name: res.run for name, res in c.arms.items()}

    eager, layered = arms(False), arms(True)
    assert set(eager) == {"baseline", "prefix", "cached", "blend", "routed"}
    for name, run in eager.items():
        assert layered[name].token_ids == run.token_ids, name
        assert torch.equal(layered[name].first_logits, run.first_logits), name


def test_a_pinned_copy_rebuilds_every_kind_of_entry():
    from engine.kv import LayeredKV, to_storage

    dense = entry(6)
    layered = LayeredKV([torch.randn(2, 1, 3, 4), torch.randn(2, 1, 2, 4)], [torch.tensor([0, 2, 5]),
                        torch.tensor([1, 4])], torch.arange(6), torch.arange(6))
    quant = to_storage(ModuleKV(torch.randn(2, 2, 2, 32, 8), torch.arange(32), torch.arange(32)), "int8")
    for e in (dense, layered, quant):
        copy = pinning.page_locked(e, pin=torch.clone)  # the rebuild, without a CUDA runtime to pin with
        assert type(copy) is type(e) and copy.nbytes == e.nbytes and copy.manifest() == e.manifest()
        assert all(torch.equal(a, b) for a, b in zip(copy.tensors().values(), e.tensors().values()))


def test_runs_through_the_graph_bookkeeping_give_the_eager_tokens(tiny_engine, monkeypatch):
    """The graph path end to end on the CPU, its capture and replay replaced by the forward they record: the hook
    in the timed run, buckets, the cache advanced past the real tokens, decode steps from a graph."""
    lm = tiny_engine.lm
    lay = tiny_engine.layout(SCHEMA)
    plan = tiny_engine.plan(lay, PROMPT, max_new_tokens=8)
    enc = tiny_engine.encode(lay).encoded

    def both():
        return run_baseline(lm, plan, Sampling(8)), run_cached(lm, plan, enc, tiny_engine.store(), Sampling(8))

    eager = both()
    replays = []
    monkeypatch.setattr(graphs, "_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(graphs._Graph, "capture", lambda self: None)
    monkeypatch.setattr(graphs._Graph, "replay", lambda self: replays.append(self.bucket) or self._forward().clone())
    graphs.set_mode(lm.model, "on")
    try:
        replayed = both()
        held = graphs.captured(lm.model)
    finally:
        graphs.set_mode(lm.model, "auto")
        graphs._graphs.pop(lm.model, None)
    assert 1 in replays and any(b > 1 for b in replays) and held >= 2  # prefills and decode steps
    assert replays.count(1) == 2 * 7  # every decode step after the first token, both runs
    for e, r in zip(eager, replayed):
        assert r.token_ids == e.token_ids
        assert torch.allclose(r.first_logits, e.first_logits, atol=1e-5)
