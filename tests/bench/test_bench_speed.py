"""Speed benchmarks in --quick mode (decode, step parts, peak memory, TTFT, scaling, memory): JSON shape and
internal consistency, no timing thresholds.
"""

from __future__ import annotations

import json

import pytest

from benchchecks import check_fits, check_floor, check_ttft_row, real_model, run_bench, shape_kv_bytes, timed_ms


@real_model
def test_decode_quick():
    out, data, wall_ms = run_bench("decode.py")
    fp32, int8 = data["results"]
    assert (fp32["weights"], int8["weights"]) == ("fp32", "int8")
    assert 0.24 < int8["weight_bytes"] / fp32["weight_bytes"] < 0.27  # int8 codes plus one bf16 scale per row
    for r in (fp32, int8):
        d = r["decode_ms_per_token"]
        assert 0 < d["min"] <= d["median"] <= d["max"]
    assert int8["prompts"] == 2 and 0 <= int8["same_text"] <= 2 and int8["first_token_kl"]["min"] >= 0


def test_step_parts_quick():
    """The C++ step of the default model (SmolLM2: q, k and v all int8 per row, so stacked into one product per
    layer), its products alone and transformers' path, each timed."""
    from transformers import AutoConfig

    from engine.model import kernels
    from engine.model.packaged import default_model_dir

    if kernels.ops() is None:
        pytest.skip(f"the C++ step needs the engine's kernels: {kernels.status()}")
    out, data, _ = run_bench("step_parts.py")
    layers = AutoConfig.from_pretrained(default_model_dir()).num_hidden_layers
    assert data["weights"] == "int8" and data["products_per_step"] == 4 * layers + 1  # qkv, o, gate+up, down; head
    for d in data["ms"].values():
        assert 0 < d["min"] <= d["median"] <= d["max"] and len(d["all"]) == 3
    # from the unrounded medians: the rounded ones may differ by a rounding step
    gap = data["ms"]["step"]["median"] - data["ms"]["products"]["median"]
    assert data["not_products_ms"] == pytest.approx(gap, abs=0.0101)


def test_peak_memory_quick():
    out, data, wall_ms = run_bench("peak_memory.py")
    (row,) = data["results"]
    for arm in ("baseline", "cached"):
        methods = row["arms"][arm]
        assert set(methods) == {"none", "hwm (now)", "thread 5 ms (before)"}
        for m in methods.values():
            t = m["ttft_ms"]
            assert 0 < t["min"] <= t["median"] <= t["max"] and len(t["all"]) == data["reps"]
        # each ratio is the method's TTFT over the same round's run with nothing read
        none = methods["none"]["ttft_ms"]["all"]
        hwm = methods["hwm (now)"]
        assert hwm["ratio_to_none"]["all"] == pytest.approx([x / n for x, n in zip(hwm["ttft_ms"]["all"], none)],
                                                             abs=0.02)
    assert 0 < data["hwm_cost_median_max"] and 0 < data["thread_cost_median_max"]


def test_ttft_quick():
    out, data, wall_ms = run_bench("ttft.py")
    assert "speedup" in out.splitlines()[0]  # the table comes first
    assert data["benchmark"] == "ttft" and data["ttft_includes_copy"] is True
    rows = data["results"]
    assert [r["target_tokens"] for r in rows] == [128, 256]
    for r in rows:
        assert r["prompt_tokens"] <= r["target_tokens"] + 8 and r["uncached_tokens"] < r["cached_tokens"]
        check_ttft_row(r, data["reps"])
        check_floor(r, data["reps"])
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]
    assert 0 < timed_ms(rows) < wall_ms  # the reported milliseconds were spent inside this run


def test_ttft_random_shape_quick():
    """--random-shape: a random-weight Llama of a named shape, the default model's tokenizer, bf16, recorded."""
    out, data, wall_ms = run_bench("ttft.py", "--random-shape", "tiny")
    assert data["random_weights"] is True and data["model"] == "tiny-random" and data["dtype"] == "bfloat16"
    sh = data["shape"]
    assert (sh["name"], sh["architecture"], sh["num_hidden_layers"], sh["hidden_size"]) == ("tiny", "LlamaForCausalLM",
                                                                                           2, 64)
    assert sh["vocab_size"] > 32_000 and data["tokenizer"] == "SmolLM2-135M-Instruct" and data["params"] > 0
    for r in data["results"]:
        check_ttft_row(r, data["reps"], shape_kv_bytes(data))
        check_floor(r, data["reps"])
    assert 0 < timed_ms(data["results"]) < wall_ms


@real_model
def test_scaling_quick():
    out, data, wall_ms = run_bench("scaling.py")
    rows = data["results"]
    assert len(rows) == 3 and data["ttft_includes_copy"] is True
    for r in rows:
        parts = r["cached_copy_ms"] + r["cached_prefill_ms"] + r["cached_sample_ms"]
        assert parts <= r["cached_ttft_ms"] * 1.05 + 1  # the split adds up (medians of each part)
        check_ttft_row(r, data["reps"])
        check_floor(r, data["reps"])
    check_fits(rows, data["fits"])
    assert data["gpu"] is None or isinstance(data["gpu"], dict)
    assert "grows as tokens^" in out and 0 < timed_ms(rows) < wall_ms


@real_model
def test_memory_quick():
    _, data, _ = run_bench("memory.py")
    fams = {f["model"]: f for f in data["families"]}
    assert fams["Llama-2-7B"]["fp16_mb_per_token"] == 0.5  # the paper's Table 2
    assert fams["Llama-2-70B"]["kv_heads"] == 8 and fams["Falcon-7B"]["kv_heads"] == 1
    assert data["loaded"]["kv_bytes_per_token"] == 46_080
    assert data["samples"] and all(s["measured_bytes"] == s["predicted_bytes"] for s in data["samples"])
    assert data["all_match"] is True


def test_batch_invariance_quick():
    """Each product kind's rows against the same rows of a 256-row batch: the engine's kernels (where built) differ
    in none, as tests/engine/test_kernels.py checks directly; every count within the rows checked."""
    out, data, _ = run_bench("batch_invariance.py")
    products = data["products"]
    assert set(products) == {"torch fp32", "torch bf16", "oneDNN bf16, laid out once", "engine int8",
                             "engine int4 (5-bit)"}
    for name, r in products.items():
        if not r["runs"]:
            assert not name.startswith("torch") and r["why"] in out
            continue
        assert r["rows_checked"] == sum(data["rows"]) * len(data["shapes"])
        assert r["rows_differing"] == sum(r["differing_by_rows"].values()) <= r["rows_checked"]
        assert (r["rows_differing"] == 0) == (r["largest_difference"] == 0)
        if name.startswith("engine"):
            assert r["rows_differing"] == 0


@real_model
def test_load_parts_quick():
    """Every row count's decode step and every fused fill timed; the bound recomputed from the JSON's own steps."""
    out, data, _ = run_bench("load_parts.py", "--fill-ms", "100", "--tokens", "10")
    steps = data["decode_step_ms"]
    assert list(steps) == ["1", "2", "4", "8", "16"]
    assert all(0 < s["min"] <= s["median"] <= s["max"] for s in steps.values())
    fills = data["fused_fills"]
    assert list(fills["fused"]) == ["2", "4", "8"]
    for k, f in fills["fused"].items():
        assert 0 < f["products_ms"]["min"] <= f["products_ms"]["median"] <= f["products_ms"]["max"]
        assert f["apart_ms"] == pytest.approx(int(k) * fills["products_ms"]["median"], abs=0.1)
        saved = (f["apart_ms"] - f["products_ms"]["median"]) / (int(k) * fills["fill_ms"]["median"])
        assert f["saved_of_fills"] == pytest.approx(saved, abs=2e-3)
    s1, s8 = steps["1"]["median"], steps["8"]["median"]
    bound = data["bound"]
    assert bound["from"] == "arguments"
    assert bound["throughput_8_over_1_at_most"] == pytest.approx((100 + 10 * s1) / (100 + 10 * s8 / 8), abs=0.01)
    assert bound["at_most_if_8_rows_cost_1"] == pytest.approx((100 + 10 * s1) / (100 + 10 * s1 / 8), abs=0.01)
    assert "8 clients over 1" in out


@real_model
def test_load_parts_bounds_a_level_with_its_own_fills(tmp_path):
    """The bound reads each level's fills and tokens from bench/load.py's file: (F1 + T1 s1) / (F8 + T8 s8 / 8)."""
    def level(fill_ms, tokens, requests=4):
        return {"engine_ttft_ms": {"mean": fill_ms}, "output_tokens": tokens * requests, "requests": requests,
                "prefilled_tokens": {"p50": 20}}
    result = tmp_path / "load-x.json"
    result.write_text(json.dumps({"machine": {"date": "2026-01-02"}, "servers": {"studio (default arm)": {
        "levels": {"1": level(300.0, 25), "8": level(200.0, 20)}}}}))
    _, data, _ = run_bench("load_parts.py", "--load-result", str(result))
    steps, bound = data["decode_step_ms"], data["bound"]
    s1, s8 = steps["1"]["median"], steps["8"]["median"]
    assert data["fill_tokens"] == 20 and bound["from"] == "load-x.json (2026-01-02)"
    assert bound["throughput_8_over_1_at_most"] == pytest.approx((300 + 25 * s1) / (200 + 20 * s8 / 8), abs=0.01)
    assert bound["at_most_if_8_rows_cost_1"] == pytest.approx((300 + 25 * s1) / (200 + 20 * s1 / 8), abs=0.01)
