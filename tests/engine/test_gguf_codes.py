"""A GGUF file's own Q5_0 blocks as weights (``--weights gguf``): the codes read from the file give exactly what
gguf-py dequantizes, and a layer built from them multiplies by exactly the loaded (dequantized) weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import kernels
from engine.model.gguf import q5_codes
from engine.model.weights import PackedLinear, file_codes


def _q5_file(path, weights: dict) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    writer = GGUFWriter(str(path), "llama")
    for name, w in weights.items():
        writer.add_tensor(name, quants.quantize(w, GGMLQuantizationType.Q5_0), raw_dtype=GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_q5_codes_are_what_gguf_dequantizes(tmp_path):
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    w = {"blk.0.ffn_gate.weight": rng.standard_normal((128, 64)).astype(np.float32),
         "output.weight": rng.standard_normal((64, 96)).astype(np.float32),
         "blk.0.attn_norm.weight": rng.standard_normal((64, 32)).astype(np.float32)}  # no linear layer: skipped
    _q5_file(tmp_path / "m.gguf", w)
    codes = q5_codes(tmp_path / "m.gguf")
    assert set(codes) == {"model.layers.0.mlp.gate_proj", "lm_head"}
    for gguf_name, name in [("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj"), ("output.weight", "lm_head")]:
        values, scale = codes[name]
        assert values.dtype == torch.uint8 and int(values.max()) <= 31
        got = (values.float() - 16).reshape(*scale.shape, 32) * scale[..., None]
        want = quants.dequantize(quants.quantize(w[gguf_name], GGMLQuantizationType.Q5_0), GGMLQuantizationType.Q5_0)
        assert torch.equal(got.reshape(values.shape), torch.from_numpy(want))


@pytest.mark.skipif(kernels.ops() is None, reason=kernels.status())
def test_a_layer_from_the_files_codes_is_the_loaded_layer(tmp_path):
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 96)).astype(np.float32)
    _q5_file(tmp_path / "m.gguf", {"blk.3.attn_q.weight": w})
    codes = q5_codes(tmp_path / "m.gguf")
    linear = torch.nn.Linear(96, 128, bias=True)
    loaded = quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q5_0), GGMLQuantizationType.Q5_0)
    linear.weight.data = torch.from_numpy(loaded)  # what the converted model holds
    taken = file_codes(codes, "model.layers.3.self_attn.q_proj", linear)
    assert taken is not None
    layer = PackedLinear(linear, "q5", taken)
    assert torch.equal(layer.dense(), linear.weight)  # the file's values exactly
    x = torch.randn(3, 96)
    want = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert float((layer(x).double() - want).norm() / want.norm()) < 3e-4  # activations in 15 bits
    assert layer.nbytes() < linear.weight.numel() * 0.8  # 5 bits, fp16 scale and zero per 32: ~0.75 bytes
    linear.weight.data[0, 0] += 1e-3  # another weight than the file's: its codes are not used
    assert file_codes(codes, "model.layers.3.self_attn.q_proj", linear) is None


def test_gguf_weights_without_the_files_blocks_are_refused(tiny_lm):
    import copy

    from engine.errors import ModelError
    from engine.model.weights import quantize_weights

    with pytest.raises(ModelError, match="GGUF file"):
        quantize_weights(copy.deepcopy(tiny_lm.model), "gguf")
