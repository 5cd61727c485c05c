"""Compute precision: the default per device, module KV stored in the precision a run computes in, and
bf16 compute end to end on CPU (tiny random model: encode, store, persist, reload, run)."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import config as cfg
from engine.config import RunConfig
from engine.arms.registry import Sampling
from engine.session import Engine

from test_module_memory import PROMPT, SCHEMA


@pytest.fixture(scope="module")
def tiny_bf16(tiny_lm):
    from engine.model.load import wrap_model

    model = copy.deepcopy(tiny_lm.model).to(torch.bfloat16)
    return wrap_model(model, tiny_lm.tokenizer, "tiny-llama-bf16", dtype="bfloat16", fingerprint="tiny-llama-bf16")


def test_the_default_dtype_is_chosen_per_device_and_storage_follows_it():
    cpu, gpu = RunConfig(), RunConfig(storage="cuda")
    assert (cpu.dtype, cpu.storage_dtype) == ("float32", "float32")
    assert (gpu.device, gpu.dtype, gpu.storage_dtype) == ("cuda", "bfloat16", "bfloat16")
    assert cpu.with_(storage="cuda").dtype == "bfloat16"  # the new device's default
    assert RunConfig(dtype="float32", storage="cuda").with_(storage="cpu").dtype == "float32"
    half = cpu.with_(dtype="bfloat16")
    assert half.storage_dtype == "bfloat16"  # stored in the precision the run computes in
    assert RunConfig(storage_dtype="int8").with_(dtype="bfloat16").storage_dtype == "int8"  # a choice is kept
    assert RunConfig(dtype="bfloat16", storage_dtype="float32").storage_dtype == "float32"


def test_bf16_compute_end_to_end_with_bf16_module_kv(tiny_lm, tiny_bf16, tmp_path):
    full = Engine.from_loaded(tiny_lm).compare(SCHEMA, PROMPT, Sampling(4))
    first = Engine.from_loaded(tiny_bf16, persist=True, module_dir=tmp_path / "modules")
    assert (first.config.dtype, first.config.storage_dtype) == ("bfloat16", "bfloat16")
    a = first.compare(SCHEMA, PROMPT, Sampling(4))
    assert a.store.dtype == "bfloat16"
    entries = [first.store().get(k) for k in first.store().keys()]
    assert entries and all(e.dtype == torch.bfloat16 for e in entries)
    assert {n: b * 2 for n, b in a.store.by_module.items()} == full.store.by_module
    # a restart reads the bf16 entries back from disk and runs the same
    again = Engine.from_loaded(tiny_bf16, persist=True, module_dir=tmp_path / "modules")
    enc = again.encode(again.layout(SCHEMA))
    assert {u.source for u in enc.encoded.units} == {"disk"}
    b = again.compare(SCHEMA, PROMPT, Sampling(4))
    assert torch.equal(a.cached.first_logits, b.cached.first_logits) and a.cached.token_ids == b.cached.token_ids
    # bf16 moves the first-token distribution a little from fp32's, baseline and cached alike
    for arm in ("baseline", "cached"):
        p, q = (torch.log_softmax(getattr(c, arm).first_logits.double(), -1) for c in (full, a))
        assert float((p.exp() * (p - q)).sum()) < 1e-2


def test_one_module_at_the_start_stays_exact_in_bf16(tiny_bf16):
    schema = "<schema name='one'><module name='m'>The library opens at nine and closes at five.</module></schema>"
    c = Engine.from_loaded(tiny_bf16).compare(schema, "<prompt schema='one'><m/> When does it open?</prompt>",
                                              Sampling(4))
    assert c.agreement().first_token_agree and c.agreement().first_token_kl < 1e-3  # bf16 kernels round differently per length


def test_the_engine_says_why_and_the_cli_says_it_in_words_pointing_to_the_measurement():
    from engine.cli_text import dtype_reason

    assert cfg.dtype_why("cpu", "bfloat16") == cfg.DtypeWhy.ASKED and "as asked" in dtype_reason("cpu", "bfloat16")
    assert cfg.dtype_why("cuda", "bfloat16") == cfg.DtypeWhy.GPU_DEFAULT
    assert "not measured" in dtype_reason("cuda", "bfloat16")
    assert cfg.dtype_why("cpu", "float32") == cfg.DtypeWhy.CPU_DEFAULT
    assert "docs/models.md" in dtype_reason("cpu", "float32")  # the figures live in the docs, not the sentence
