"""Weight precision (engine/model/weights.py): packed linear layers against the float matmul they replace, and a
whole tiny model quantized in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.errors import ModelError
from engine.arms.registry import Sampling
from engine.model.weights import (ATTENTION_PROJECTIONS, INT4_GROUP, WEIGHTS, PackedLinear, PackedMLP, pack_linear,
                                  quantize_weights)

# relative error of the layer's output against fp32, for gaussian weights (int4: 16 levels per group of 32)
TOLERANCE = {"bf16": 0.01, "int8": 0.02, "int4": 0.15}


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_a_packed_layer_computes_the_float_layer(kind):
    torch.manual_seed(0)
    linear = torch.nn.Linear(4 * INT4_GROUP, 128, bias=True)  # 128 rows: int4 keeps only the kernel's tiles
    x = torch.randn(3, 5, 4 * INT4_GROUP)
    packed = pack_linear(linear, kind)
    want = F.linear(x, linear.weight, linear.bias)
    got = packed(x)
    assert got.dtype == x.dtype and got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < TOLERANCE[kind]
    fp32_bytes = linear.weight.numel() * 4
    assert packed.nbytes() < fp32_bytes * {"bf16": 0.51, "int8": 0.27, "int4": 0.2}[kind] + 4 * 128 * 8


def test_int4_dequantizes_exactly_what_it_packed():
    """Weights already on the int4 grid of each group come back up to the bf16 rounding of their scale and zero (a
    wrong scale/zero convention would be off by whole steps of ~0.01)."""
    torch.manual_seed(1)
    low, scale = torch.randn(16, 1, 1) * 0.1, torch.rand(16, 1, 1) * 0.01 + 0.001
    codes = torch.randint(0, 16, (16, 2, INT4_GROUP)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans the whole grid
    w = (low + scale * codes).reshape(16, 2 * INT4_GROUP)
    linear = torch.nn.Linear(2 * INT4_GROUP, 16, bias=False)
    linear.weight.data = w
    eye = torch.eye(2 * INT4_GROUP)
    got = pack_linear(linear, "int4")(eye).T  # column j of W
    assert float((got - w).abs().max()) < 3e-3


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_a_quantized_model_stays_close_to_fp32(tiny_lm, kind):
    import copy

    model = copy.deepcopy(tiny_lm.model)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])
    with torch.inference_mode():
        want = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
        before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        nbytes = quantize_weights(model, kind)
        got = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
    assert before > 0 and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    mlps = [m for m in model.modules() if isinstance(m, PackedMLP)]
    assert mlps and sum(isinstance(m, PackedLinear) for m in model.modules()) == before - len(mlps)  # gate+up: one
    if kind == "int4":  # the attention projections stay int8 (weights.py's docstring says why)
        assert {m.kind for n, m in model.named_modules() if n.endswith(ATTENTION_PROJECTIONS)} == {"int8"}
        assert {m.gate_up.kind for m in mlps} == {"int4"}
    kl = float(torch.sum(want.exp() * (want - got)))
    assert kl < {"bf16": 1e-3, "int8": 1e-2, "int4": 0.2}[kind]
    assert nbytes > 0


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_a_packed_mlp_computes_its_gate_and_up_layers(tiny_lm, kind):
    """The gate and up matrices packed as one give what the two packed layers give (the same quantized values:
    a group never spans both), and the MLP's float output within the precision's tolerance."""
    import copy

    torch.manual_seed(2)
    mlp = copy.deepcopy(tiny_lm.model.model.layers[0].mlp)
    x = torch.randn(2, 3, mlp.gate_proj.in_features)
    with torch.inference_mode():
        want = mlp(x)
        gate, up = pack_linear(mlp.gate_proj, kind), pack_linear(mlp.up_proj, kind)
        two = pack_linear(mlp.down_proj, kind)(mlp.act_fn(gate(x)) * up(x))
        got = PackedMLP(mlp, kind)(x)
    assert PackedMLP.fits(mlp) and got.shape == want.shape and got.dtype == x.dtype
    assert torch.allclose(got, two, rtol=0.02, atol=1e-3 * float(two.abs().max()))
    assert float((got - want).norm() / want.norm()) < 2 * TOLERANCE[kind]


def test_fp32_leaves_the_model_and_a_bad_kind_is_named(tiny_lm):
    assert quantize_weights(tiny_lm.model, "fp32") > 0 and any(
        isinstance(m, torch.nn.Linear) for m in tiny_lm.model.modules())
    with pytest.raises(ModelError, match="unknown weight precision 'int3'"):
        quantize_weights(tiny_lm.model, "int3")
    assert WEIGHTS == ("fp32", "bf16", "int8", "int4", "gguf")


@pytest.mark.real_model
def test_the_weights_setting_reaches_the_run_and_its_json():
    """--weights / RunConfig(weights=) loads the model that way; the JSON says which weights every arm ran on, and
    module KV made with other weights is another cache entry (the fingerprint differs)."""
    from engine.cli import build_parser, config_from_args
    from engine.config import RunConfig
    from engine.errors import EngineError
    from engine.model.load import load_model
    from studio.cli import EXTRA

    args = build_parser(EXTRA).parse_args(["run", "s.xml", "p.xml", "--weights", "int8"])
    assert config_from_args(args).weights == "int8" and RunConfig().weights == "fp32"
    with pytest.raises(EngineError, match="unknown weight precision 'int2'"):
        RunConfig(weights="int2")
    assert not RunConfig(weights="int8").same_model(RunConfig())
    lm8 = load_model(None, weights="int8")
    lm32 = load_model(None)
    assert lm8.weights == "int8" and lm8.weight_bytes < lm32.weight_bytes / 3.5
    assert lm8.fingerprint != lm32.fingerprint and lm8.codec.fingerprint == lm32.codec.fingerprint
    from engine.session import Engine
    from tests.conftest import SAMPLES

    doc = Engine.from_loaded(lm8).compare((SAMPLES / "travel.xml").read_text(),
                                          (SAMPLES / "travel.prompt.xml").read_text(), Sampling(2)).to_json()
    assert doc["weights"] == "int8"


@pytest.mark.parametrize("kind,out", [("int8", 96), ("int4", 128), ("int4", 80)])
def test_a_long_input_takes_the_dequantized_weight_and_gets_the_kernels_result(kind, out, monkeypatch):
    """From DENSE_FROM tokens on, a packed layer multiplies by its dequantized weight in fp32: the same weight the
    kernel reads (80 rows: int4 values kept apart from the kernel's 64-row tiles), so both paths agree to bf16's
    rounding, and both are within the precision's tolerance of the float layer."""
    from engine.model import weights

    torch.manual_seed(3)
    linear = torch.nn.Linear(4 * INT4_GROUP, out, bias=True)
    packed = pack_linear(linear, kind)
    assert (packed.nibbles is None) == (kind == "int8" or out % weights.int4_tile() == 0)
    x = torch.randn(40, 4 * INT4_GROUP)
    monkeypatch.setitem(weights.DENSE_FROM, kind, 1 << 30)
    kernel = packed(x)
    monkeypatch.setitem(weights.DENSE_FROM, kind, 40)
    dense = packed(x)
    want = F.linear(x, linear.weight, linear.bias)
    assert float((dense - kernel).norm() / kernel.norm()) < 0.01
    assert float((dense - want).norm() / want.norm()) < TOLERANCE[kind]
