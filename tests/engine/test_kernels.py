"""The engine's int8 / int4 kernels (engine/model/kernels.py, csrc/packed_matmul.cpp) against float matrix
products of the same integer weights, their packings against their inverses, and the fallback to torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import kernels
from engine.model.weights import pack_linear

needs_kernels = pytest.mark.skipif(kernels.ops() is None, reason=kernels.status())
TOKENS = [1, 2, 3, 4, 5, 7, 9]  # the kernels take up to 4 tokens per pass: every remainder


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 63), (192, 130)])
@pytest.mark.parametrize("m", TOKENS)
def test_int8_kernel_is_the_float_product_of_its_integers(rows, cols, m):
    torch.manual_seed(rows + cols + m)
    q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
    scale, bias, x = torch.rand(rows) * 0.01, torch.randn(rows), torch.randn(m, cols)
    want = x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()
    got = kernels.ops().int8_matmul(x, kernels.pack_int8(q), scale, bias)
    assert got.shape == (m, rows) and got.dtype == torch.float32
    assert rel(got.double(), want) < 1e-4  # activations in 16 bits: ~3e-5


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 96), (64, 4864)])
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("group,dtype", [(16, torch.float32), (32, torch.float16), (32, torch.float32)])
def test_grouped_int8_kernel_is_the_float_product_of_its_groups(rows, cols, m, group, dtype):
    """A scale per row and group of 16 or 32 columns (a GGUF's Q6_K and Q8_0 blocks), fp16 or float32."""
    torch.manual_seed(rows + cols + m + group)
    q = torch.randint(-128, 128, (rows, cols), dtype=torch.int8)
    scale, bias, x = (torch.rand(rows, cols // group) * 0.01).to(dtype).float(), torch.randn(rows), torch.randn(m, cols)
    w = (q.double().reshape(rows, -1, group) * scale.double()[..., None]).reshape(rows, cols)
    packed = kernels.pack_group_scales(scale, dtype)
    assert torch.equal(kernels.unpack_group_scales(packed), scale)
    got = kernels.ops().int8_matmul(x, kernels.pack_int8(q), packed, bias)
    assert rel(got.double(), x.double() @ w.T + bias.double()) < 1e-4


@needs_kernels
def test_int8_kernel_refuses_scales_of_no_group():
    q, x = torch.zeros(64, 96, dtype=torch.int8), torch.randn(1, 96)
    with pytest.raises(RuntimeError, match="scales' shape"):
        kernels.ops().int8_matmul(x, kernels.pack_int8(q), torch.ones(64 * 4), None)  # 24 columns a group


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(64, 32), (128, 96), (64, 4864)])
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("levels", [16, 32])  # int4, and a GGUF's 5-bit blocks (a fifth bit per value)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # float32: a GGUF's Q4_K scales
def test_int4_kernel_is_the_float_product_of_its_groups(rows, cols, m, levels, dtype):
    torch.manual_seed(rows + cols + m + levels)
    q = torch.randint(0, levels, (rows, cols))
    scale, zero = torch.rand(rows, cols // 32) * 0.02, torch.randn(rows, cols // 32) * 0.1
    nibbles, sz, fifth = kernels.pack_int4(q, scale, zero, dtype)
    assert (fifth is not None) == (levels == 32) and sz.dtype == dtype
    s, z = sz.float().permute(0, 3, 2, 1).reshape(rows, 2, -1).unbind(1)  # as stored
    w = (q.double().reshape(rows, -1, 32) * s.double()[..., None] + z.double()[..., None]).reshape(rows, cols)
    x = torch.randn(m, cols)
    got = kernels.ops().int4_matmul(x, nibbles, sz, fifth, None)
    assert got.shape == (m, rows)
    assert rel(got.double(), x.double() @ w.T) < 3e-4  # activations in 15 bits


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int8-groups", "int4", "int5"])
def test_each_tokens_product_is_the_same_bits_in_any_batch(kind):
    """A token's row of a product over 9 tokens is its product alone, bit for bit: the scheduler's batched decode
    answers as each run alone (tests/engine/test_scheduler.py) only because no kernel's sums depend on the batch."""
    torch.manual_seed(9)
    rows, cols = 192, 256
    if kind.startswith("int8"):
        q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
        scale = torch.rand(rows) * 0.01 if kind == "int8" else kernels.pack_group_scales(
            torch.rand(rows, cols // 32) * 0.01, torch.float16)
        product = lambda x: kernels.ops().int8_matmul(x, kernels.pack_int8(q), scale, None)  # noqa: E731
    else:
        q = torch.randint(0, 16 if kind == "int4" else 32, (rows, cols))
        packed = kernels.pack_int4(q, torch.rand(rows, cols // 32) * 0.02, torch.randn(rows, cols // 32) * 0.1)
        product = lambda x: kernels.ops().int4_matmul(x, *packed, None)  # noqa: E731
    x = torch.randn(9, cols)
    together = product(x)
    for m in (1, 2, 3, 4, 5, 9):
        assert torch.equal(product(x[:m]), together[:m])
    for i in range(9):
        assert torch.equal(product(x[i:i + 1])[0], together[i])


@needs_kernels
def test_an_outlier_activation_costs_little():
    """Per-token activation scales: one channel 300x the rest (LLMs' massive activations) still leaves the product
    within 1e-3 of the float one (the small channels keep ~7 bits of their own)."""
    torch.manual_seed(5)
    q = torch.randint(-127, 128, (128, 256), dtype=torch.int8)
    x = torch.randn(2, 256)
    x[:, 7] = 300.0
    want = x.double() @ q.double().T
    assert rel(kernels.ops().int8_matmul(x, kernels.pack_int8(q), torch.ones(128), None).double(), want) < 1e-3


def test_packings_invert():
    torch.manual_seed(2)
    q8 = torch.randint(-127, 128, (128, 65), dtype=torch.int8)
    assert torch.equal(kernels.unpack_int8(kernels.pack_int8(q8), 65), q8)
    scale, zero = torch.rand(64, 3), torch.randn(64, 3)
    for levels in (16, 32):
        q4 = torch.randint(0, levels, (64, 96))
        back, s, z = kernels.unpack_int4(*kernels.pack_int4(q4, scale, zero))
        assert torch.equal(back.long(), q4)
        assert torch.equal(s, scale.half().float()) and torch.equal(z, zero.half().float())


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_layer_on_the_engines_kernels_agrees_with_torchs(kind, monkeypatch):
    """The same float layer packed for each set of kernels: the two agree to the activations' rounding (bf16 for
    torch's), and the engine's is used only where the rows tile."""
    torch.manual_seed(4)
    linear = torch.nn.Linear(128, 192, bias=True)
    x = torch.randn(3, 128)
    own = pack_linear(linear, kind)
    mine = own(x)
    assert own.own and rel(mine, F.linear(x, own.dense(), linear.bias)) < 3e-4  # 16- or 15-bit activations
    monkeypatch.setitem(kernels._state, "ops", None)
    theirs = pack_linear(linear, kind)
    assert not theirs.own and rel(mine, theirs(x)) < 0.01
    monkeypatch.undo()
    assert not pack_linear(torch.nn.Linear(128, 80), kind).own  # 80 rows: not a multiple of 64


def test_without_the_kernels_the_status_says_why(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("PML_STUDIO_KERNELS", "0")
    assert kernels.ops() is None and "PML_STUDIO_KERNELS=0" in kernels.status()
    assert not kernels.fits("int8", 64, 64)
