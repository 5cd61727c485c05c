"""Packed weights saved on disk and read back (engine/model/packed_cache.py): the layers read back are the layers
packed (every tensor equal, the same logits) for each weights setting, a GGUF file's own blocks included, without
unpacking the file again; a file that cannot be read, or lacks a layer, is packed again and rewritten; a new key
replaces the model's older file; small models are not saved."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine.model import kernels, packed_cache
from engine.model.gguf import file_blocks
from engine.model.weights import PackedLinear, saved_layers
from tests.engine.test_gguf_codes import _blocks, _dequantized, _file

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path))
    monkeypatch.setattr(packed_cache, "SAVE_FROM", 0)  # the tiny model is saved as a big one would be
    return tmp_path / "packed"


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer Qwen2 (q, k, v with biases) whose matrices tile the engine's kernels, not yet packed."""
    import transformers as T

    cfg = T.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])).logits


def _pack(model, weights, codes=lambda: None, fingerprint="fp-1"):
    return packed_cache.pack(model, weights, "tiny.model", fingerprint, codes)


def _same_layers(a, b) -> None:
    got, want = saved_layers(a), saved_layers(b)
    assert got.keys() == want.keys() and got
    for name, (kind, tensors) in want.items():
        assert got[name][0] == kind and got[name][1].keys() == tensors.keys(), name
        for buffer, t in tensors.items():
            assert got[name][1][buffer].dtype == t.dtype and torch.equal(got[name][1][buffer], t), (name, buffer)


@pytest.mark.parametrize("weights", ["int8", "int4", "bf16"])
def test_layers_read_back_are_the_layers_packed(cache, tiny, weights):
    first, second = copy.deepcopy(tiny), copy.deepcopy(tiny)
    size, came = _pack(first, weights)
    assert came == "packed" and len(list(cache.glob("*.safetensors"))) == 1
    assert _pack(second, weights) == (size, "saved")
    _same_layers(second, first)
    assert torch.equal(_logits(second), _logits(first))
    # aligned as torch allocates: the kernels' AVX-512 loads across cache lines decoded ~30 % slower
    assert all(t.data_ptr() % 64 == 0 for _, found in saved_layers(second).values() for t in found.values())


def test_a_gguf_files_blocks_are_read_back_without_unpacking_the_file(cache, tiny, tmp_path):
    model = copy.deepcopy(tiny)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear):
            kind = "Q5_0" if "mlp" in name else "Q8_0"  # the 0.5B file's mix: gate and up stacked, int4 and int8
            blocks = _blocks(kind, layer.weight.detach().numpy(), rng)
            layer.weight.data = _dequantized(kind, blocks)  # what a converted model holds
            parts = name.split(".")
            gguf_name = "output" if name == "lm_head" else f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:])]}"
            tensors[f"{gguf_name}.weight"] = (kind, blocks)
    _file(tmp_path / "tiny.gguf", tensors)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    assert _pack(first, "gguf", lambda: file_blocks(tmp_path / "tiny.gguf"))[1] == "packed"
    kinds = {m.kind for m in first.modules() if isinstance(m, PackedLinear)}
    # the file's blocks where the engine's kernels run (AVX-512), not int8 made again; else int8 on torch's kernels
    assert kinds == ({"Q5_0", "Q8_0"} if kernels.ops() is not None else {"int8"})
    assert _pack(second, "gguf", lambda: pytest.fail("the GGUF file was unpacked again"))[1] == "saved"
    _same_layers(second, first)
    assert torch.equal(_logits(second), _logits(first))


def test_an_unreadable_file_is_packed_again_and_rewritten(cache, tiny, capsys):
    want = copy.deepcopy(tiny)
    _pack(want, "int8")
    saved = next(cache.glob("*.safetensors"))
    saved.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])  # cut short, as a full disk leaves it
    model = copy.deepcopy(tiny)
    assert _pack(model, "int8")[1] == "packed"
    assert "cannot be read" in capsys.readouterr().err
    assert torch.equal(_logits(model), _logits(want))
    assert _pack(copy.deepcopy(tiny), "int8")[1] == "saved"  # rewritten whole


def test_a_file_missing_a_layer_leaves_the_model_to_be_packed_again(cache, tiny, monkeypatch, capsys):
    want = copy.deepcopy(tiny)
    _pack(want, "int4")
    read = packed_cache._read
    monkeypatch.setattr(packed_cache, "_read", lambda path: {k: v for k, v in read(path).items() if "lm_head" not in k})
    model = copy.deepcopy(tiny)
    assert _pack(model, "int4")[1] == "packed"
    assert "does not fit the model" in capsys.readouterr().err
    _same_layers(model, want)  # nothing half taken from the file
    assert torch.equal(_logits(model), _logits(want))


def test_a_new_key_replaces_the_models_older_file_and_others_stay(cache, tiny):
    _pack(copy.deepcopy(tiny), "int8", fingerprint="fp-1")
    _pack(copy.deepcopy(tiny), "int4", fingerprint="fp-1")
    old = {p.name for p in cache.glob("*.safetensors")}
    assert len(old) == 2  # one per weights setting
    assert _pack(copy.deepcopy(tiny), "int8", fingerprint="fp-2")[1] == "packed"  # the model's files changed
    now = {p.name for p in cache.glob("*.safetensors")}
    assert len(now) == 2 and len(now & old) == 1 and ".int4." in "".join(now & old)


def test_small_models_and_fp32_are_not_saved(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path))
    assert _pack(copy.deepcopy(tiny), "int8")[1] == "packed"  # under SAVE_FROM linear weights
    assert _pack(copy.deepcopy(tiny), "fp32")[1] == "loaded"
    assert not (tmp_path / "packed").exists()
