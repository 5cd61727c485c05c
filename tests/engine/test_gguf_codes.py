"""A GGUF file's own blocks as weights (``--weights gguf``): the codes read from the file (Q5_0, Q8_0, Q4_K,
Q6_K) give exactly what gguf-py dequantizes, and a layer built from them multiplies by exactly the loaded
(dequantized) weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import kernels
from engine.model.gguf import file_blocks
from engine.model.weights import FILE_KINDS, pack_linear, file_codes

BLOCK_BYTES = {"Q4_K": (256, 144), "Q6_K": (256, 210)}  # ggml's K-quant blocks: weights, bytes
SCALE_AT = {"Q4_K": (0, 4), "Q6_K": (208, 210)}  # where a block's fp16 scales lie (Q4_K: d then dmin)


def _blocks(kind: str, w: np.ndarray, rng) -> np.ndarray:
    """``w`` as ``kind``'s blocks, [rows, bytes]: gguf-py quantizes Q5_0 and Q8_0; it cannot quantize K-quants, so
    those are random bytes with sane fp16 scales (the codes' every bit pattern is then read)."""
    from gguf import GGMLQuantizationType, quants

    kind_id = GGMLQuantizationType[kind]
    if kind not in BLOCK_BYTES:
        return quants.quantize(w, kind_id)
    per, size = BLOCK_BYTES[kind]
    rows, cols = w.shape
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    start, end = SCALE_AT[kind]
    raw[:, start:end] = rng.uniform(0.001, 0.02, (len(raw), (end - start) // 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _file(path, tensors: dict) -> None:
    """Write ``tensors`` (name -> (kind, blocks)) as a GGUF file."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name, (kind, blocks) in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _dequantized(kind: str, blocks: np.ndarray) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind]))


def _weight(found) -> torch.Tensor:
    w = found.values.float().reshape(*found.scale.shape, -1) * found.scale[..., None]
    return (w if found.zero is None else w + found.zero[..., None]).reshape(found.values.shape)


@pytest.mark.parametrize("kind", list(FILE_KINDS))
def test_file_blocks_are_what_gguf_dequantizes(tmp_path, kind):
    rng = np.random.default_rng(0)
    gate, out = rng.standard_normal((128, 512)).astype(np.float32), rng.standard_normal((64, 256)).astype(np.float32)
    tensors = {"blk.0.ffn_gate.weight": (kind, _blocks(kind, gate, rng)), "output.weight": (kind, _blocks(kind, out, rng)),
               "blk.0.attn_norm.weight": ("Q8_0", _blocks("Q8_0", out, rng))}  # no linear layer: skipped
    _file(tmp_path / "m.gguf", tensors)
    found = file_blocks(tmp_path / "m.gguf")
    assert set(found) == {"model.layers.0.mlp.gate_proj", "lm_head"}
    for gguf_name, name in [("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj"), ("output.weight", "lm_head")]:
        got = found[name]
        assert got.kind == kind
        low, high = {"Q5_0": (0, 31), "Q4_K": (0, 15), "Q8_0": (-128, 127), "Q6_K": (-32, 31)}[kind]
        assert low <= int(got.values.min()) and int(got.values.max()) <= high
        assert torch.equal(_weight(got), _dequantized(kind, tensors[gguf_name][1]))


@pytest.mark.skipif(kernels.ops() is None, reason=kernels.status())
@pytest.mark.parametrize("kind", list(FILE_KINDS))
def test_a_layer_from_the_files_codes_is_the_loaded_layer(tmp_path, kind):
    rng = np.random.default_rng(1)
    blocks = _blocks(kind, rng.standard_normal((128, 512)).astype(np.float32), rng)
    _file(tmp_path / "m.gguf", {"blk.3.attn_q.weight": (kind, blocks)})
    codes = file_blocks(tmp_path / "m.gguf")
    linear = torch.nn.Linear(512, 128, bias=True)
    linear.weight.data = _dequantized(kind, blocks)  # what the converted model holds
    taken = file_codes(codes, "model.layers.3.self_attn.q_proj", linear)
    assert taken is not None
    layer = pack_linear(linear, kind, taken)
    assert torch.equal(layer.dense(), linear.weight)  # the file's values exactly
    for tokens in (1, 3, 300):  # the kernel (4 tokens a pass), a remainder, the dense path of a prefill
        x = torch.randn(tokens, 512)
        want = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
        assert float((layer(x).double() - want).norm() / want.norm()) < 3e-4  # activations in 15-16 bits
    bits = {"Q5_0": 7, "Q4_K": 6, "Q8_0": 8.5, "Q6_K": 10}[kind]  # values + fp16 / float32 scales (and zeros)
    assert layer.nbytes() <= linear.weight.numel() * bits / 8
    linear.weight.data[0, 0] += 1e-3  # another weight than the file's: its codes are not used
    assert file_codes(codes, "model.layers.3.self_attn.q_proj", linear) is None


def test_gguf_weights_without_the_files_blocks_are_refused(tiny_lm):
    import copy

    from engine.errors import ModelError
    from engine.model.weights import quantize_weights

    with pytest.raises(ModelError, match="GGUF file"):
        quantize_weights(copy.deepcopy(tiny_lm.model), "gguf")
