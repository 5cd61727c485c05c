"""Benchmarks in their CI-sized --quick mode: JSON shape and internal consistency, no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.real_model


def run_bench(script: str, *args: str, timeout: float = 300) -> tuple[str, dict]:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.strip().splitlines() if line.strip()]
    return r.stdout, json.loads(lines[-1])  # one JSON document, last


def test_ttft_quick():
    out, data = run_bench("ttft.py")
    assert "speedup" in out.splitlines()[0]  # the table comes first
    assert data["benchmark"] == "ttft" and data["ttft_includes_copy"] is True
    rows = data["results"]
    assert [r["target_tokens"] for r in rows] == [256, 512]
    for r in rows:
        assert r["cached_tokens"] + r["uncached_tokens"] == r["prompt_tokens"] <= r["target_tokens"] + 8
        assert r["uncached_tokens"] < r["cached_tokens"]
        assert r["cached_copy_ms"] > 0  # the modules' KV really was copied, inside the timed region
        assert r["speedup"] == pytest.approx(r["baseline_ttft_ms"] / r["cached_ttft_ms"], rel=0.01)
        assert r["store_bytes"] >= r["cached_tokens"] * 46_080
        assert len(r["baseline_ttft_ms_all"]) == len(r["cached_ttft_ms_all"]) == data["reps"]
        check_floor(r, data["reps"])
        pairs = [b / c for b, c in zip(r["baseline_ttft_ms_all"], r["cached_ttft_ms_all"])]
        assert r["speedup_min"] == pytest.approx(min(pairs), abs=0.01)
        assert r["speedup_max"] == pytest.approx(max(pairs), abs=0.01)
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]


def check_floor(r: dict, reps: int) -> None:
    """The floor figures of one length: min <= median <= max of their own reps, ratios of the medians."""
    for key in ("floor_ms", "nocache_ms"):
        runs = r[f"{key}_all"]
        assert len(runs) == reps and r[f"{key}_min"] == min(runs) and r[f"{key}_max"] == max(runs)
        assert r[f"{key}_min"] <= r[key] <= r[f"{key}_max"]
    assert r["cached_over_floor"] == pytest.approx(r["cached_ttft_ms"] / r["floor_ms"], rel=0.01)
    assert r["floor_over_nocache"] == pytest.approx(r["floor_ms"] / r["nocache_ms"], rel=0.01)


def test_scaling_quick():
    out, data = run_bench("scaling.py")
    rows = data["results"]
    assert len(rows) == 3 and data["ttft_includes_copy"] is True
    for r in rows:
        parts = r["cached_copy_ms"] + r["cached_prefill_ms"] + r["cached_sample_ms"]
        assert parts <= r["cached_ttft_ms"] * 1.05 + 1  # the split adds up (medians of each part)
        check_floor(r, data["reps"])
    fits = data["fits"]
    assert 0 <= fits["cached_ttft_vs_cached_tokens_linear"]["r2"] <= 1
    assert "exponent" in fits["baseline_ttft_power"] and "exponent" in fits["cached_ttft_power"]
    assert data["gpu"] is None or isinstance(data["gpu"], dict)
    assert "grows as tokens^" in out


def test_memory_quick():
    _, data = run_bench("memory.py")
    fams = {f["model"]: f for f in data["families"]}
    assert fams["Llama-2-7B"]["fp16_mb_per_token"] == 0.5  # the paper's Table 2
    assert fams["Llama-2-70B"]["kv_heads"] == 8 and fams["Falcon-7B"]["kv_heads"] == 1
    assert data["loaded"]["kv_bytes_per_token"] == 46_080
    assert data["samples"] and all(s["measured_bytes"] == s["predicted_bytes"] for s in data["samples"])
    assert data["all_match"] is True


def test_fidelity_quick():
    _, data = run_bench("fidelity.py")
    assert data["prompts"] == 2 and data["confusable_prompts"] == 2 and data["greedy"] is True
    summary = data["summary"]
    assert list(summary) == ["baseline", "isolated", "prefixed", "isolated+sink 3", "isolated+repair 4", "scaffold"]
    for path, s in summary.items():
        assert s["n"] == 2 and 0 <= s["accuracy"] <= 1 and s["ci95"][0] <= s["accuracy"] <= s["ci95"][1]
        assert s["found"] == sum(r[path]["found"] for r in data["rows"])
        assert s["ttft_ms"]["min"] <= s["ttft_ms"]["median"] <= s["ttft_ms"]["max"]
    for row in data["rows"]:
        assert row["scaffold"]["first_token_kl"] < 1e-4  # joint encoding of every module: exact
        assert row["isolated"]["recomputed_tokens"] == 0 < row["isolated+repair 4"]["recomputed_tokens"]
        for path in ("prefixed", "isolated", "scaffold", "isolated+repair 4"):
            assert 0 <= row[path]["rouge_l"] <= 1
            if row[path]["same_text"]:
                assert row[path]["text"] == row["baseline"]["text"] and row[path]["first_divergence"] is None
            else:
                assert row[path]["first_divergence"] is not None
    for row in data["confusable_rows"]:
        assert len(row["number"]) == 7 and not (row["isolated"]["found"] and row["isolated"]["confused"])
    assert set(data["frontier"]) == {"2"} and set(data["samples"]) == {"travel"}
    travel = data["samples"]["travel"]
    assert travel["prefixed"]["recomputed_tokens"] == 0 < travel["prefixed+repair 4"]["recomputed_tokens"]


def test_compression_quick():
    _, data = run_bench("compression.py")
    s = data["summary"]
    assert set(s) == {"baseline", "cached fp32", "float16", "int8", "int4", "pyramid 50%", "question 50%"}
    assert s["float16"]["bytes_ratio"] == 0.5  # half precision: exactly half the module bytes
    assert s["int8"]["bytes_ratio"] <= 0.27 and s["int4"]["bytes_ratio"] <= 0.16
    assert s["pyramid 50%"]["bytes_ratio"] <= 0.52 and s["pyramid 50%"]["buffer_ratio"] < 0.9
    assert s["question 50%"]["bytes_ratio"] == 1.0 and s["question 50%"]["buffer_ratio"] < 0.9  # stores whole
    for name in ("float16", "int8", "int4", "pyramid 50%", "question 50%"):
        assert 0 <= s[name]["agree_ref"] <= 1 and s[name]["kl_ref"] >= 0 and s[name]["n"] == 2
        assert s[name]["found"] == sum(r[name]["found"] for r in data["rows"])
    for row in data["rows"]:  # the first token is out before question retention thins the buffer
        assert row["question 50%"]["agree_ref"] is True and row["question 50%"]["kl_ref"] < 1e-8
    at = data["at_4k"]["configs"]
    assert at["question 50%"]["buffer_bytes_decoded_over"] < at["fp32 full"]["buffer_bytes_decoded_over"]
    assert at["int8"]["module_store_bytes"] <= 0.27 * at["fp32 full"]["module_store_bytes"]
    assert any(v.startswith("int8:") for v in data["verdicts"])


def test_workload_quick():
    out, data = run_bench("workload.py", timeout=900)  # 18 runs of three arms: ~1 min on a quiet machine
    assert data["benchmark"] == "workload" and list(data["arms"]) == ["baseline", "prefix", "cached"]
    rows = data["prompts"]
    assert len(rows) == 6 and any(r["schema_order"] for r in rows) and not all(r["schema_order"] for r in rows)
    assert data["warmup"]["modules"] == [f"doc{i}" for i in range(8)]
    for r in rows:
        assert 2 <= len(r["imports"]) <= 4 and r["asked"] in r["imports"]
        assert r["baseline"]["prefilled_tokens"] == r["prompt_tokens"] and r["baseline"]["reused_tokens"] == 0
        p = r["prefix"]
        assert p["prefilled_tokens"] == r["prompt_tokens"] - p["reused_tokens"] >= 1
        assert p["found"] == r["baseline"]["found"] and p["text"] == r["baseline"]["text"]  # exact reuse
        assert p["stopped_at"]["token"] == p["reused_tokens"]
        assert r["cached"]["prefilled_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        assert p["broke"] == (p["reused_tokens"] < r["cached_tokens"])
        if r["schema_order"]:  # warmed with every module in schema order: nothing the modular arm reuses breaks
            assert p["reused_tokens"] >= r["cached_tokens"] and not p["broke"]
    # the first prompt out of schema order finds only schema-order prompts cached: it breaks at its first
    # module that departs from schema order (doc0, doc1, ...)
    first = next(r for r in rows if not r["schema_order"])
    departs = next(m for i, m in enumerate(first["imports"]) if m != f"doc{i}")
    assert first["prefix"]["broke"] and first["prefix"]["stopped_at"]["owner"] == departs
    for arm, s in data["arms"].items():
        assert s["n"] == 6 and s["needle_found"] == sum(r[arm]["found"] for r in rows)
        assert s["prefilled_tokens"] == sum(r[arm]["prefilled_tokens"] for r in rows)
        assert s["ci95"][0] <= s["needle_accuracy"] <= s["ci95"][1]
        assert s["p50_ttft_ms"] <= s["p90_ttft_ms"] and min(r[arm]["ttft_ms"] for r in rows) <= s["mean_ttft_ms"]
    assert data["arms"]["prefix"]["same_answers_as_baseline"] == 6
    assert data["arms"]["prefix"]["cache_bytes"] == rows[-1]["prefix_bytes_after"] > 0
    assert data["arms"]["baseline"]["cache_bytes"] == 0 and data["arms"]["cached"]["cache_bytes"] > 0
    assert "prefix stopped at" in out
