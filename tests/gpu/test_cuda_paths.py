"""The GPU paths on CUDA (skipped without it; bench/gpu.sh runs them on a lent GPU): pinned CPU storage, layer-by-
layer copies on a side stream and CUDA graphs give the eager path's greedy tokens on a tiny random-weight Llama.

The tokenizer is the small model's (SmolLM2-135M), or ``PML_GPU_TOKENIZER``'s folder where the model packages
are not installed (a lent GPU: bench/gpu.sh saves one).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.engine.test_gpu_paths import PROMPT, SCHEMA  # the CPU tests' case, here on CUDA

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW = 12


@pytest.fixture(scope="module")
def cuda_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model import SMALL_MODEL
    from engine.model.load import load_tokenizer, wrap_model

    _, tok, _ = load_tokenizer(os.environ.get("PML_GPU_TOKENIZER") or SMALL_MODEL)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().to("cuda")
    return wrap_model(model, tok, "tiny-llama-cuda", device="cuda", dtype="float32", fingerprint="tiny-llama-cuda")


def runs(lm, storage: str, layerwise: bool, graphs_on: bool):
    """(baseline, cached) greedy runs with the GPU paths as given, and the store."""
    from tests.arm_runs import run_baseline
    from tests.arm_runs import run_cached
    from engine.arms.registry import Sampling
    from engine.run.pools import pool_of
    from engine.model import graphs
    from engine.session import Engine

    eng = Engine.from_loaded(lm, storage=storage)
    lay = eng.layout(SCHEMA)
    plan = eng.plan(lay, PROMPT, max_new_tokens=NEW)
    enc = eng.encode(lay).encoded
    pool_of(lm).layerwise = layerwise
    graphs.set_mode(lm.model, "on" if graphs_on else "off")
    try:
        out = [(run_baseline(lm, plan, Sampling(NEW)), run_cached(lm, plan, enc, eng.store(), Sampling(NEW)))
               for _ in range(2)]  # the second pair replays the graphs the first captured
    finally:
        pool_of(lm).layerwise = True
        graphs.set_mode(lm.model, "auto")
    assert out[0][0].token_ids == out[1][0].token_ids and out[0][1].token_ids == out[1][1].token_ids
    return out[1][0], out[1][1], eng.store()


@pytest.mark.parametrize("storage", ["cpu", "cuda"])
def test_layerwise_pinned_and_graphed_runs_give_the_eager_tokens(cuda_lm, storage):
    from engine.model import graphs

    eager_base, eager_cached, _ = runs(cuda_lm, storage, layerwise=False, graphs_on=False)
    fast_base, fast_cached, store = runs(cuda_lm, storage, layerwise=True, graphs_on=True)
    assert graphs.status(cuda_lm.model) == "on", graphs.status(cuda_lm.model)
    assert graphs.captured(cuda_lm.model) >= 2  # the question's bucket and the decode step's
    assert fast_base.token_ids == eager_base.token_ids and len(eager_base.token_ids) == NEW
    assert fast_cached.token_ids == eager_cached.token_ids
    assert torch.allclose(fast_cached.first_logits, eager_cached.first_logits, atol=1e-4)
    assert torch.allclose(fast_base.first_logits, eager_base.first_logits, atol=1e-4)
    if storage == "cpu":
        assert store.pinning.why == "on" and store.pinning.pinned_bytes > 0


def test_cpu_storage_for_a_cuda_model_is_page_locked(cuda_lm):
    from engine.kv.pinned import is_page_locked
    from engine.session import Engine

    eng = Engine.from_loaded(cuda_lm, storage="cpu")
    eng.encode(eng.layout(SCHEMA))
    store = eng.store()
    assert store.pinning.active and len(store) > 0
    assert all(is_page_locked(store.get(k)) for k in store.keys())
    assert store.stats()["page_locked_bytes"] == store.nbytes()


def test_side_stream_copies_land_layer_by_layer():
    from engine.kv import Lease

    src = torch.randn(4, 2, 2, 64, 8).pin_memory()  # [layers, 2, kv_heads, n, head_dim]
    direct = Lease(torch.zeros(4, 2, 1, 2, 128, 8, device="cuda"))
    layered = Lease(torch.zeros(4, 2, 1, 2, 128, 8, device="cuda"), layerwise=True)
    direct.write(src)
    layered.write(src)
    assert layered.copies.waiting
    for i in range(4):
        layered.ready(i)  # launches on the side stream, then waits for layer i only
        assert torch.equal(layered.raw[i], direct.raw[i])
    assert len(layered.copies.events) == 4
    assert torch.equal(layered.data, direct.data)


def test_graphs_fall_back_to_eager_past_the_largest_bucket(cuda_lm):
    from engine.kv import KVWorkspace
    from engine.model import graphs
    from engine.model.attend import PLAIN

    space = KVWorkspace(cuda_lm.n_layers, cuda_lm.kv_heads, cuda_lm.head_dim, torch.float32, "cuda")
    buf = space.buffer(graphs.BUCKETS[-1] + 8)
    n = graphs.BUCKETS[-1] + 1
    with torch.inference_mode():
        assert graphs.forward(cuda_lm, buf.cache(), list(range(n)), list(range(n)), PLAIN) is None


@pytest.mark.parametrize("storage", ["cpu", "cuda"])
def test_every_arm_runs_on_cuda_as_on_the_cpu(cuda_lm, storage):
    """Each registered arm, decoded together and apart on the GPU, against the same weights on the CPU."""
    import copy

    from engine.arms.registry import Sampling
    from engine.model.load import wrap_model
    from engine.session import Engine

    cpu_lm = wrap_model(copy.deepcopy(cuda_lm.model).to("cpu"), cuda_lm.tokenizer, "tiny-llama-cpu", device="cpu",
                        dtype="float32", fingerprint="tiny-llama-cuda")
    on_cpu = Engine.from_loaded(cpu_lm).compare(SCHEMA, PROMPT, Sampling(NEW))
    eng = Engine.from_loaded(cuda_lm, storage=storage)
    together = eng.compare(SCHEMA, PROMPT, Sampling(NEW))
    apart = eng.compare(SCHEMA, PROMPT, Sampling(NEW), config=eng.config.with_(decode="apart"))
    assert together.device.startswith("cuda") and set(together.arms) == set(on_cpu.arms) == set(apart.arms)
    for arm, res in together.arms.items():
        assert len(res.run.token_ids) == NEW and res.run.ttft_ms > 0, arm
        assert res.run.token_ids == apart.arms[arm].run.token_ids, arm
        want = on_cpu.arms[arm].run.first_logits
        assert torch.allclose(res.run.first_logits.cpu(), want, atol=1e-3), (arm, (res.run.first_logits.cpu() - want).abs().max())


def test_host_kv_lands_by_2d_dma_as_torch_copies_it():
    from engine.kv import dma

    assert dma.available() == "on"
    kv = torch.randn(3, 2, 4, 20, 8).pin_memory()  # a stored entry: [layers, 2, kv_heads, seq, head_dim]
    raw = torch.zeros(3, 2, 1, 4, 64, 8, device="cuda")  # a run buffer
    want = raw.clone()
    for dst, src in [((1, slice(None), 0, slice(None), slice(5, 25)), kv[1]),  # one layer of a whole entry
                     ((slice(None), slice(None), 0, slice(None), slice(30, 36)), kv[:, :, :, 3:9]),  # all, a range
                     ((2, slice(None), 0, slice(None), slice(40, 41)), kv[2, :, :, 0:1])]:  # one token
        assert dma.copy_rows(raw[dst], src)
        want[dst].copy_(src)
    torch.cuda.synchronize()
    assert torch.equal(raw, want)
    assert not dma.copy_rows(raw[0, :, 0, :, 0:20], torch.randn(2, 4, 20, 8))  # pageable: torch copies it


def test_copies_settled_before_a_graph_launch_whole_and_land_as_layer_by_layer():
    from engine.kv import Lease

    src = torch.randn(4, 2, 2, 64, 8).pin_memory()
    layered = Lease(torch.zeros(4, 2, 1, 2, 128, 8, device="cuda"), layerwise=True)
    whole = Lease(torch.zeros(4, 2, 1, 2, 128, 8, device="cuda"), layerwise=True)
    for buf in (layered, whole):
        buf.write(src[:, :, :, :40])
        buf.write(src[:, :, :, 40:])
    for i in range(4):
        layered.ready(i)
    whole.settle()
    assert len(set(map(id, whole.copies.events))) == 1 and len(set(map(id, layered.copies.events))) == 4
    assert len(whole.copies.held) == 2 and len(layered.copies.held) == 8  # one DMA per range, or per range and layer
    assert torch.equal(whole.data, layered.data) and torch.equal(whole.data[:, :, 0, :, :64].cpu(), src)
