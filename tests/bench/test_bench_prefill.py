"""bench/prefill.py's parts on a tiny model: the attention floor's arithmetic, the profile's grouping of ops, and
the verdicts read from a run's figures (the full run measures the default model: minutes, docs/benchmarks.md)."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def bench_prefill():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import prefill
        yield prefill
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_the_attention_floor_counts_the_causal_half_at_the_model_s_shapes(bench_prefill, tiny_lm):
    c = tiny_lm.model.config
    got = bench_prefill.attention_floors(tiny_lm.model, [16, 64])
    dim = c.hidden_size // c.num_attention_heads
    assert (got["heads"], got["kv_heads"], got["head_dim"], got["layers"]) == \
        (c.num_attention_heads, c.num_key_value_heads, dim, c.num_hidden_layers)
    for dtype in ("float32", "bfloat16"):
        for n in (16, 64):
            row = got[dtype][str(n)]
            flops = 2 * 2 * c.num_attention_heads * dim * n * (n + 1) / 2 * c.num_hidden_layers
            assert row["s"] > 0 and row["tflops"] == pytest.approx(flops / row["s"] / 1e12, rel=0.05, abs=2e-3)


@pytest.mark.parametrize("op, group", [
    ("aten::mm", "linears"), ("aten::addmm", "linears"), ("aten::_weight_int8pack_mm", "linears"),
    ("aten::mkldnn_linear", "linears"), ("quantized::linear_dynamic", "linears"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::_softmax", "attention"),
    ("aten::copy_", "copies and layout"), ("aten::_to_copy", "copies and layout"), ("aten::cat", "copies and layout"),
    ("aten::mul_", "norms, rope and activations"), ("aten::silu", "norms, rope and activations"),
    ("aten::rsqrt", "norms, rope and activations"), ("aten::argmax", "other"), ("aten::topk", "other")])
def test_the_profile_groups_ops_by_name(bench_prefill, op, group):
    assert bench_prefill._group(op) == group


def test_a_profiled_prefill_puts_its_linears_and_attention_in_their_groups(bench_prefill, tiny_lm):
    got = bench_prefill.profile(tiny_lm, "auto", list(range(5, 133)))
    assert got["tokens"] == 128 and got["wall_s"] > 0
    assert got["groups"]["linears"] > 0 and got["groups"]["attention"] > 0
    assert sum(got["groups"].values()) <= got["wall_s"] * 1.5  # self times add up to about the forward
    top = got["top_ops"]
    assert len(top) <= 12 and [o["self_s"] for o in top] == sorted((o["self_s"] for o in top), reverse=True)
    assert all(o["group"] == bench_prefill._group(o["op"]) for o in top)


def test_the_verdicts_take_the_fastest_floor_and_split_off_the_non_linear_part(bench_prefill):
    floors = {"float32": {"1024": {"s": 7.0}}, "float32-onednn": {"1024": {"s": 6.5}}, "int8": {"1024": {"s": 4.0}}}
    studio = {"gemm-fp32": {"kernel": "gemm-fp32", "by_length": {"1024": {"median": 10.0, "linear_s": 7.5}}}}
    out = {"lengths": [1024], "floors": floors, "studio": studio, "llama_cpp": {"by_length": {"1024": {"median": 12.0}}},
           "attention_floors": {"float32": {"1024": {"s": 0.7}}},
           "encoding": {"gemm-fp32": {"median": 2.0}}, "decode": {"gemm-fp32": {"median": 100.0}},
           "kl": {"gemm-fp32": {"mean_kl": 0.0}}}
    row = bench_prefill.verdicts(out, ["gemm-fp32"])["by_length"]["1024"]
    assert row["fastest_floor"] == "int8" and row["prefill_over_fastest_floor"] == 2.5
    assert row["nonlinear_s"] == 2.5 and row["nonlinear_over_linears"] == pytest.approx(2.5 / 7.5, abs=1e-3)
    assert row["prefill_over_float32_floor"] == pytest.approx(10 / 7, abs=1e-3)
    assert row["speedup_over_llama_cpp"] == 1.2 and row["attention_floor_fp32_s"] == 0.7
