"""Module memory that keeps retrieval: int8 / int4 storage (KIVI's layout) and question-aware retention."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from conftest import ROOT, arm_ms, decoded_fully, first_token_kl, timed
from engine.cache.compress import METHOD_NOTES, RETENTION_NOTE, question_keep
from engine.config import CHOICES, METHODS, Compression, RunConfig, values
from engine.errors import EngineError
from engine.kv import Lease, ModuleKV, QuantKV
from engine.arms.registry import Sampling
from engine.session import Engine
from engine.cache.store import DiskStore
from test_module_memory import PROMPT, SCHEMA

V1 = ROOT / "tests" / "data" / "modules-v1"


def real_shaped(n: int = 250, layers: int = 2, seed: int = 0) -> ModuleKV:
    """A module entry shaped like SmolLM2-135M's (3 KV heads, head dim 64), keys with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, 3, n, 64, generator=g)
    kv[:, 0] = kv[:, 0] * 2 + torch.randn(layers, 3, 1, 64, generator=g) * 8  # per-channel offsets, as keys have
    return ModuleKV(kv, torch.arange(7, 7 + n), torch.arange(n))


# -- quantized entries --------------------------------------------------------------------------

@pytest.mark.parametrize("precision,bits", [("int8", 8), ("int4", 4)])
def test_round_trip_error_is_within_half_a_step_of_each_group(precision, bits):
    entry = real_shaped(n=203)  # a partial last key group
    q = QuantKV.quantize(entry, precision)
    back = q.dequantize()
    k, v = entry.kv[:, 0], entry.kv[:, 1]
    # the bound, from the original tensor: half a quantization step of the element's group, plus fp16 rounding
    kg, vg = q.key_group, q.value_group
    pad = -k.shape[2] % kg
    kp = torch.cat([k, k[:, :, -1:].expand(-1, -1, pad, -1)], 2).unflatten(2, (-1, kg))
    k_lo, k_hi = kp.amin(3, keepdim=True), kp.amax(3, keepdim=True)
    k_bound = ((k_hi - k_lo) * (0.5 / (2 ** bits - 1) + 2 ** -10) + k_lo.abs() * 2 ** -10).expand_as(kp)
    k_bound = k_bound.flatten(2, 3)[:, :, : k.shape[2]]
    vp = v.unflatten(3, (-1, vg))
    v_lo, v_hi = vp.amin(4, keepdim=True), vp.amax(4, keepdim=True)
    v_bound = ((v_hi - v_lo) * (0.5 / (2 ** bits - 1) + 2 ** -10) + v_lo.abs() * 2 ** -10).expand_as(vp).flatten(3)
    assert ((back[:, 0] - k).abs() <= k_bound + 1e-6).all()
    assert ((back[:, 1] - v).abs() <= v_bound + 1e-6).all()
    rel = float((back - entry.kv).norm() / entry.kv.norm())
    assert rel < (0.01 if bits == 8 else 0.1)


@pytest.mark.parametrize("precision,limit", [("int8", 0.27), ("int4", 0.16)])
def test_stored_bytes_with_scales_against_fp32(tmp_path, precision, limit):
    disk = DiskStore(tmp_path)
    for n in (64, 130, 250, 1000):
        entry = real_shaped(n)
        q = QuantKV.quantize(entry, precision)
        counted = sum(t.numel() * t.element_size() for name, t in q.tensors().items()
                      if name not in ("positions", "token_ids"))
        assert q.nbytes == counted and q.nbytes <= limit * entry.nbytes, (n, q.nbytes / entry.nbytes)
        disk.save(f"{precision}{n}", q)
        disk.save(f"fp32{n}", entry)
        on_disk = disk.path(f"{precision}{n}").stat().st_size
        ids = 2 * 8 * n  # positions and token ids (int64) are in both files
        assert on_disk - ids <= limit * (disk.path(f"fp32{n}").stat().st_size - ids) + 4096  # + header


def test_dequantizing_into_a_buffer_equals_dequantize_for_any_range():
    entry = real_shaped(n=300)
    for precision in ("int8", "int4"):
        q = QuantKV.quantize(entry, precision)
        full = q.dequantize()
        for a, b in [(0, 300), (5, 6), (10, 63), (64, 128), (60, 200), (250, 300), (129, 131)]:
            buf = Lease.private(torch.zeros(2, 2, 1, 3, 400, 64))
            buf.write(torch.ones(2, 2, 3, 4, 64))  # something before it
            q.write_into(buf, a, b)
            assert buf.lengths == (4 + b - a,) * 2
            assert torch.equal(buf.data[:, :, 0, :, 4:4 + b - a], full[:, :, :, a:b])
            assert torch.equal(buf.data[:, :, 0, :, :4], torch.ones(2, 2, 3, 4, 64))


def test_quantized_storage_runs_persists_and_reloads_exactly(tiny_lm, tmp_path):
    full = Engine.from_loaded(tiny_lm).compare(SCHEMA, PROMPT, Sampling(4))
    drift = {}
    for precision in ("int8", "int4"):
        eng = Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / precision, storage_dtype=precision)
        a = eng.compare(SCHEMA, PROMPT, Sampling(4))
        assert a.store.dtype == precision and decoded_fully(a.cached, 4, tiny_lm.eos_ids)
        drift[precision] = first_token_kl(full.cached, a.cached)  # against the fp32 entries' run
        for name, size in full.store.by_module.items():
            if name != "(anonymous)":  # the prefix stays in the compute dtype
                assert a.store.by_module[name] < 0.4 * size
        assert a.store.stats["bytes_by_precision"][precision] == sum(
            v for k, v in a.store.by_module.items() if k != "(anonymous)")
        key = eng.encode(eng.layout(SCHEMA)).encoded.module_keys["d1"]
        manifest = eng.store().disk.manifest(key)
        assert manifest["format"] == "pml-kv/2" and manifest["dtype"] == precision
        assert "keys per channel" in manifest["scheme"] and manifest["bits"] == precision[3:]
        restarted = Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / precision,
                                       storage_dtype=precision)
        b = restarted.compare(SCHEMA, PROMPT, Sampling(4))
        assert b.encode["encoded"] == 0 and b.encode["disk"] == b.encode["units"]
        assert torch.equal(a.cached.first_logits, b.cached.first_logits)
    assert 0 < drift["int8"] < drift["int4"] < 1e-4  # rounded, not garbled: coarser steps drift further


def test_quantized_storage_refuses_encode_time_retention():
    with pytest.raises(EngineError) as info:
        RunConfig(storage_dtype="int4", compression=Compression(0.5, "pyramid"))
    assert "question" in str(info.value) and "retention" in str(info.value)
    RunConfig(storage_dtype="int4", compression=Compression(0.5, "question"))  # stores full entries: allowed


# -- entries written by the previous version ------------------------------------------------------

def test_entries_of_the_previous_format_load_and_nothing_is_encoded(tiny_lm, tmp_path):
    folder = tmp_path / "modules"
    shutil.copytree(V1, folder)
    for settings in ({}, {"storage_dtype": "float16"}, {"compression": Compression(0.5, "pyramid")}):
        old = Engine.from_loaded(tiny_lm, persist=True, module_dir=folder, **settings)
        c = old.compare(SCHEMA, PROMPT, Sampling(4))
        assert c.encode["encoded"] == 0 and c.encode["units"] > 0, settings
        fresh = Engine.from_loaded(tiny_lm, **settings).compare(SCHEMA, PROMPT, Sampling(4))
        assert torch.allclose(c.cached.first_logits, fresh.cached.first_logits, atol=1e-6)
        assert c.cached.token_ids == fresh.cached.token_ids
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in V1.iterdir())  # none rewritten


def test_a_file_of_an_unknown_format_is_re_encoded_with_the_reason(tiny_lm, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path / "modules"
    shutil.copytree(V1, folder)
    eng = Engine.from_loaded(tiny_lm, persist=True, module_dir=folder)
    key = eng.encode(eng.layout(SCHEMA)).encoded.module_keys["d2"]
    path = folder / f"{key}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "format": "pml-kv/9"})
    again = Engine.from_loaded(tiny_lm, persist=True, module_dir=folder)
    c = again.compare(SCHEMA, PROMPT, Sampling(2))
    assert c.encode["encoded"] == 1
    assert "pml-kv/9" in c.store.stats["disk_error"] and "re-encoded" in c.store.stats["disk_error"]
    assert c.store.stats["disk_unreadable"] == 1 and c.store.stats["disk_corrupt"] == 0


# -- question-aware retention ---------------------------------------------------------------------

def test_question_keep_takes_the_pooled_neighbourhood_and_every_fixed_token():
    n = 120
    candidates = torch.ones(n, dtype=torch.bool)
    candidates[:10] = False  # e.g. the system text
    scores = torch.full((2, n), 0.01)
    scores[0, 60] = 5.0  # head 0 looks at token 60, head 1 at token 100
    scores[1, 100] = 5.0
    scores[:, 3] = 9.0  # a fixed token's score must not pull its neighbours in
    idx = question_keep(scores, candidates, keep=9, kernel=9)
    assert idx.shape == (2, 19)
    assert idx[0].tolist() == list(range(10)) + list(range(56, 65))
    assert idx[1].tolist() == list(range(10)) + list(range(96, 105))


def test_buffer_keep_gathers_per_head_and_shortens_the_layer():
    data = torch.arange(2 * 2 * 1 * 2 * 10 * 4, dtype=torch.float32).view(2, 2, 1, 2, 10, 4)
    buf = Lease.private(torch.zeros_like(data))
    buf.write(data[:, :, 0, :, :8])
    idx = torch.tensor([[0, 3, 7], [1, 2, 6]])
    buf.keep(1, idx)
    assert buf.lengths == (8, 3)
    for h in range(2):
        assert torch.equal(buf.data[1, :, 0, h, :3], data[1, :, 0, h, idx[h]])
    assert torch.equal(buf.data[0, :, :, :, :8], data[0, :, :, :, :8])
    assert buf.used_bytes == (8 + 3) * 2 * 2 * 4 * 4


def test_question_retention_keeps_the_first_token_and_shrinks_the_decode_buffer(tiny_lm):
    eng = Engine.from_loaded(tiny_lm)
    full = eng.compare(SCHEMA, PROMPT, Sampling(6))
    comp = Compression(0.5, "question")
    q, wall_ms = timed(eng.compare, SCHEMA, PROMPT, Sampling(6), config=eng.config.with_(compression=comp))
    assert q.encode["encoded"] == 0  # question retention stores full entries: the same ones
    assert q.store.nbytes == full.store.nbytes and q.store.compression == {"retention": 0.5, "method": "question"}
    assert torch.allclose(q.cached.first_logits, full.cached.first_logits, atol=1e-5)
    assert q.cached.token_ids[0] == full.cached.token_ids[0] and decoded_fully(q.cached, 6, tiny_lm.eos_ids)
    assert arm_ms(q) <= wall_ms  # the arms' own timings (retention included) fit in the call's wall time
    # what decoding ran over, from the plan: per layer the anonymous text, the new tokens and the kept share
    plan = eng.plan(eng.layout(SCHEMA), PROMPT, max_new_tokens=6)
    m = sum(n for name, n in plan.entry_tokens().items() if name != "(anonymous)")
    layers = tiny_lm.n_layers
    kept = [min(m, max(1, math.floor(r * m))) for r in comp.layer_ratios(layers)]
    per_slot = 2 * tiny_lm.kv_heads * tiny_lm.head_dim * 4
    expected = sum(plan.prompt_tokens - m + k for k in kept) * per_slot
    assert q.cached.kv_buffer_used_bytes == full.cached.kv_buffer_used_bytes == plan.prompt_tokens * layers * per_slot
    assert q.cached.kv_buffer_bytes_after_retention == expected < q.cached.kv_buffer_used_bytes
    assert full.cached.kv_buffer_bytes_after_retention == full.cached.kv_buffer_used_bytes
    assert full.cached.retention_ms == 0 and q.cached.retention_ms > 0


def test_runs_report_the_kv_bytes_they_held(tiny_lm):
    eng = Engine.from_loaded(tiny_lm, storage_dtype="int8")
    c = eng.compare(SCHEMA, PROMPT, Sampling(3))
    per_token = tiny_lm.kv_bytes_per_token
    assert c.baseline.kv_held_bytes == c.baseline.kv_buffer_used_bytes == c.plan.prompt_tokens * per_token
    assert c.baseline.kv_store_bytes == 0
    assert c.cached.kv_store_bytes == c.store.nbytes  # this prompt reads every entry of the schema
    assert c.cached.kv_held_bytes == c.store.nbytes + c.plan.prompt_tokens * per_token
    # the prefix arm (warmed with the schema-order prompt) held the prefix nodes it read plus its buffer
    pre = c.prefix
    assert pre.reused_tokens > 0 and pre.kv_store_bytes >= pre.reused_tokens * per_token
    assert pre.kv_held_bytes == pre.kv_store_bytes + c.plan.prompt_tokens * per_token
    j = c.to_json()
    for key in ("kv_held_bytes", "kv_store_bytes", "kv_buffer_used_bytes", "kv_buffer_bytes_after_retention",
                "retention_ms", "cuda_peak_bytes"):
        assert key in j["cached"] and key in j["baseline"]
    assert set(j["store_stats"]["bytes_by_precision"]) == {"float32", "int8"}


def test_choices_and_notes_cover_the_new_settings():
    assert {"int8", "int4"} <= set(values("storage_dtype")) and "question" in METHODS
    assert dict(CHOICES["storage_dtype"])["int4"] == "int4"
    assert set(METHOD_NOTES) == set(METHODS)
    assert "question" in RETENTION_NOTE and "before" in RETENTION_NOTE
