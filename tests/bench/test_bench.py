"""Benchmarks in their CI-sized --quick mode: JSON shape and internal consistency, no timing thresholds.

Every summary figure is recomputed here from the per-run figures it summarises (medians and speedups
from each arm's own repetitions, fits with numpy, Wilson intervals as the roots of their quadratic),
and the timings a script reports must fit in the wall time the test measured around it. The same
checks run on the committed results in bench/results/, which the README quotes.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

import re

import numpy as np
import pytest

from bench.needles import judge
from conftest import ROOT

RESULTS = ROOT / "bench" / "results"
real_model = pytest.mark.real_model


def run_bench(script: str, *args: str, timeout: float = 300) -> tuple[str, dict, float]:
    """(stdout, the JSON document it prints last, wall-clock ms of the whole script)."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    wall_ms = (time.perf_counter() - t) * 1000
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.strip().splitlines() if line.strip()]
    return r.stdout, json.loads(lines[-1]), wall_ms  # one JSON document, last


def wilson_roots(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson interval as the two roots p of (k/n - p)^2 = z^2 p (1 - p) / n."""
    a, b, c = 1 + z * z / n, -(2 * k / n + z * z / n), (k / n) ** 2
    d = math.sqrt(max(b * b - 4 * a * c, 0.0))
    return (-b - d) / (2 * a), (-b + d) / (2 * a)


def check_rate(s: dict, found: int, n: int, rate: str = "accuracy") -> None:
    """``s[rate]`` is found / n and ``s["ci95"]`` its Wilson interval, both from the counts."""
    assert s[rate] == pytest.approx(found / n, abs=1e-4)
    assert s["ci95"] == pytest.approx(wilson_roots(found, n), abs=1e-4)


def check_ttft_row(r: dict, reps: int, kv_bytes: int = 46_080) -> None:
    """Medians and speedups of one length, from each arm's own repetitions (not the summary fields);
    ``kv_bytes`` per cached token (the default model's, fp32)."""
    b, c = r["baseline_ttft_ms_all"], r["cached_ttft_ms_all"]
    assert len(b) == len(c) == reps
    assert r["baseline_ttft_ms"] == pytest.approx(statistics.median(b), abs=0.011)
    assert r["cached_ttft_ms"] == pytest.approx(statistics.median(c), abs=0.011)
    assert r["speedup"] == pytest.approx(statistics.median(b) / statistics.median(c), rel=0.01)
    pairs = [x / y for x, y in zip(b, c)]
    assert r["speedup_min"] == pytest.approx(min(pairs), abs=0.01)
    assert r["speedup_max"] == pytest.approx(max(pairs), abs=0.01)
    assert r["cached_tokens"] + r["uncached_tokens"] == r["prompt_tokens"]
    assert r["store_bytes"] >= r["cached_tokens"] * kv_bytes  # the copied KV: every cached token


def timed_ms(rows: list[dict]) -> float:
    """Every repetition a TTFT script timed, in ms."""
    keys = ("baseline_ttft_ms_all", "cached_ttft_ms_all", "floor_ms_all", "nocache_ms_all")
    return sum(sum(r.get(k, ())) for r in rows for k in keys)


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
    assert [r["target_tokens"] for r in rows] == [256, 512]
    for r in rows:
        assert r["prompt_tokens"] <= r["target_tokens"] + 8 and r["uncached_tokens"] < r["cached_tokens"]
        check_ttft_row(r, data["reps"])
        check_floor(r, data["reps"])
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]
    assert 0 < timed_ms(rows) < wall_ms  # the reported milliseconds were spent inside this run


def shape_kv_bytes(d: dict) -> int:
    """KV bytes per token of a --random-shape run: K and V x layers x KV heads x head dim x element bytes."""
    sh = d["shape"]
    head_dim = sh["hidden_size"] // sh["num_attention_heads"]
    return 2 * sh["num_hidden_layers"] * sh["num_key_value_heads"] * head_dim * (4 if d["dtype"] == "float32" else 2)


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


def check_floor(r: dict, reps: int) -> None:
    """The floor figures of one length: min <= median <= max of their own reps, ratios of the medians."""
    for key in ("floor_ms", "nocache_ms"):
        runs = r[f"{key}_all"]
        assert len(runs) == reps and r[f"{key}_min"] == min(runs) and r[f"{key}_max"] == max(runs)
        assert r[f"{key}_min"] <= r[key] <= r[f"{key}_max"]
    assert r["cached_over_floor"] == pytest.approx(r["cached_ttft_ms"] / r["floor_ms"], rel=0.01)
    assert r["floor_over_nocache"] == pytest.approx(r["floor_ms"] / r["nocache_ms"], rel=0.01)


def check_fits(rows: list[dict], fits: dict) -> None:
    """The four fits of scaling.py, refitted here with numpy from the rows."""
    cached, prompt = [r["cached_tokens"] for r in rows], [r["prompt_tokens"] for r in rows]
    for key, xs, ys in (("cached_ttft_vs_cached_tokens_linear", cached, [r["cached_ttft_ms"] for r in rows]),
                        ("baseline_ttft_vs_prompt_tokens_linear", prompt, [r["baseline_ttft_ms"] for r in rows])):
        slope, intercept = np.polyfit(xs, ys, 1)
        f = fits[key]
        assert f["slope_ms_per_token"] == pytest.approx(slope, rel=1e-3, abs=1e-5)
        assert f["intercept_ms"] == pytest.approx(intercept, rel=1e-3, abs=0.01)
        assert f["r2"] == pytest.approx(np.corrcoef(xs, ys)[0, 1] ** 2, abs=1e-4)
    for key, xs, arm in (("cached_ttft_power", cached, "cached"), ("baseline_ttft_power", prompt, "baseline")):
        lx, ly = np.log(xs), np.log([r[f"{arm}_ttft_ms"] for r in rows])
        assert fits[key]["exponent"] == pytest.approx(np.polyfit(lx, ly, 1)[0], abs=1e-3)
        assert fits[key]["r2"] == pytest.approx(np.corrcoef(lx, ly)[0, 1] ** 2, abs=1e-4)


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


def check_fidelity(data: dict) -> None:
    """Each path's summary, from the rows: counts, Wilson interval, TTFT median and range, same text."""
    rows = data["rows"]
    for path, s in data["summary"].items():
        found = sum(r[path]["found"] for r in rows)
        assert s["found"] == found and s["n"] == len(rows)
        check_rate(s, found, len(rows))
        ttfts = [r[path]["ttft_ms"] for r in rows]
        assert s["ttft_ms"] == pytest.approx({"median": statistics.median(ttfts), "min": min(ttfts),
                                              "max": max(ttfts)}, abs=0.051)
        for r in rows:
            if path != "baseline" and r[path]["same_text"]:
                assert r[path]["text"] == r["baseline"]["text"] and r[path]["first_divergence"] is None
                assert r[path]["rouge_l"] == 1.0
            elif path != "baseline":
                assert r[path]["first_divergence"] is not None


@real_model
def test_fidelity_quick():
    _, data, _ = run_bench("fidelity.py")
    assert data["prompts"] == 2 and data["confusable_prompts"] == 2 and data["greedy"] is True
    assert list(data["summary"]) == ["baseline", "isolated", "prefixed", "isolated+sink 3", "isolated+repair 4",
                                     "scaffold"]
    check_fidelity(data)
    for row in data["rows"]:
        assert row["scaffold"]["first_token_kl"] < 1e-4  # joint encoding of every module: exact
        assert row["isolated"]["recomputed_tokens"] == 0 < row["isolated+repair 4"]["recomputed_tokens"]
    assert data["needles"] == "varied"
    for row in data["rows"] + data["confusable_rows"]:  # varied needles: a word answer, judged by whole words
        assert row["number"] and not row["number"].isdigit() and row["question"].startswith("Question:")
        for arm in (a for a, v in row.items() if isinstance(v, dict)):
            said = " " + " ".join(re.findall(r"[a-z0-9]+", row[arm]["text"].lower())) + " "
            assert row[arm]["found"] == (" " + " ".join(re.findall(r"[a-z0-9]+", row["number"].lower())) + " " in said)
            assert not (row[arm]["found"] and row[arm]["confused"])
        blend = row.get("prefixed+blend 25")
        if blend:  # a quarter of the cached tokens recomputed, chosen inside its TTFT
            assert blend["recomputed_tokens"] == round(0.25 * row["cached_tokens"]) > 0
            assert 0 < blend["selection_ms"] < blend["ttft_ms"]
    assert set(data["frontier"]) == {"2"} and set(data["samples"]) == {"travel"}
    travel = data["samples"]["travel"]
    assert travel["prefixed"]["recomputed_tokens"] == 0 < travel["prefixed+repair 4"]["recomputed_tokens"]


def check_compression(data: dict) -> None:
    """Each configuration's counts, Wilson interval and mean agreement / KL with the cached fp32 run, from the rows."""
    rows = data["rows"]
    for name, s in data["summary"].items():
        found = sum(r[name]["found"] for r in rows)
        assert s["found"] == found
        check_rate(s, found, len(rows))
        for key in ("agree_ref", "kl_ref"):
            xs = [r[name][key] for r in rows if r[name].get(key) is not None]
            if xs:
                assert s[key] == pytest.approx(statistics.mean(xs), abs=1e-5)


@real_model
def test_compression_quick():
    _, data, _ = run_bench("compression.py")
    check_compression(data)
    s = data["summary"]
    assert set(s) == {"baseline", "cached fp32", "float16", "int8", "int4", "pyramid 50%", "question 50%"}
    assert s["float16"]["bytes_ratio"] == 0.5  # half precision: exactly half the module bytes
    assert s["int8"]["bytes_ratio"] <= 0.27 and s["int4"]["bytes_ratio"] <= 0.16
    assert s["pyramid 50%"]["bytes_ratio"] <= 0.52 and s["pyramid 50%"]["buffer_ratio"] < 0.9
    assert s["question 50%"]["bytes_ratio"] == 1.0 and s["question 50%"]["buffer_ratio"] < 0.9  # stores whole
    assert all(s[name]["n"] == 2 for name in ("float16", "int8", "int4", "pyramid 50%", "question 50%"))
    for row in data["rows"]:  # the first token is out before question retention thins the buffer
        assert row["question 50%"]["agree_ref"] is True and row["question 50%"]["kl_ref"] < 1e-8
    at = data["at_4k"]["configs"]
    assert at["question 50%"]["buffer_bytes_decoded_over"] < at["fp32 full"]["buffer_bytes_decoded_over"]
    assert at["int8"]["module_store_bytes"] <= 0.27 * at["fp32 full"]["module_store_bytes"]
    assert any(v.startswith("int8:") for v in data["verdicts"])


def check_workload(data: dict) -> None:
    """Each arm's counts, Wilson interval, mean and percentile TTFTs (numpy's linear rule), from the prompts."""
    rows = data["prompts"]
    for arm, s in data["arms"].items():
        found = sum(r[arm]["found"] for r in rows)
        assert s["needle_found"] == found and s["n"] == len(rows)
        check_rate(s, found, len(rows), "needle_accuracy")
        assert s["prefilled_tokens"] == sum(r[arm]["prefilled_tokens"] for r in rows)
        ttfts = [r[arm]["ttft_ms"] for r in rows]
        assert s["mean_ttft_ms"] == pytest.approx(statistics.mean(ttfts), abs=0.011)
        assert s["p50_ttft_ms"] == pytest.approx(np.percentile(ttfts, 50), abs=0.011)
        assert s["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90), abs=0.011)


@real_model
def test_workload_quick():
    out, data, _ = run_bench("workload.py", "--blend", "0.25", timeout=900)  # 24 runs: ~1.5 min on a quiet machine
    assert data["benchmark"] == "workload" and list(data["arms"]) == ["baseline", "prefix", "cached", "blend"]
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
        b = r["blend"]  # a quarter of the modular arm's cached tokens recomputed with the question
        assert b["recomputed_tokens"] == round(0.25 * r["cached_tokens"]) and b["blend_ratio"] == 0.25
        assert b["reused_tokens"] == r["cached_tokens"] - b["recomputed_tokens"]
        assert b["prefilled_tokens"] == r["prompt_tokens"] - r["cached_tokens"] + b["recomputed_tokens"]
        assert b["found"] == judge(b["text"], {"answer": r["answer"], "others": []})[0]
        if r["schema_order"]:  # warmed with every module in schema order: nothing the modular arm reuses breaks
            assert p["reused_tokens"] >= r["cached_tokens"] and not p["broke"]
    # the first prompt out of schema order finds only schema-order prompts cached: it breaks at its first
    # module that departs from schema order (doc0, doc1, ...)
    first = next(r for r in rows if not r["schema_order"])
    departs = next(m for i, m in enumerate(first["imports"]) if m != f"doc{i}")
    assert first["prefix"]["broke"] and first["prefix"]["stopped_at"]["owner"] == departs
    check_workload(data)
    assert data["arms"]["prefix"]["same_answers_as_baseline"] == 6
    assert data["arms"]["prefix"]["cache_bytes"] == rows[-1]["prefix_bytes_after"] > 0
    assert data["arms"]["baseline"]["cache_bytes"] == 0 and data["arms"]["cached"]["cache_bytes"] > 0
    assert "prefix stopped at" in out


def test_committed_results_pass_the_same_checks():
    """The results the README quotes hold together the way a fresh --quick run must."""
    data = {name: json.loads((RESULTS / f"{name}.json").read_text())
            for name in ("ttft", "scaling", "fidelity", "compression", "workload")}
    for d in (data["ttft"], data["scaling"]):
        for r in d["results"]:
            check_ttft_row(r, d["reps"])
            check_floor(r, d["reps"])
    check_fits(data["scaling"]["results"], data["scaling"]["fits"])
    for path in sorted(RESULTS.glob("gpu-ttft-*.json")):  # the lent GPU's runs, the random-weight shape's too
        d = json.loads(path.read_text())
        assert d["machine"]["cuda"] and d["machine"]["gpu"] and d["device"] == "cuda", path.name
        assert d.get("random_weights", False) == path.stem.endswith("-random"), path.name
        kv = shape_kv_bytes(d) if "shape" in d else 46_080 // (1 if d["dtype"] == "float32" else 2)
        for r in d["results"]:
            check_ttft_row(r, d["reps"], kv)
            check_floor(r, d["reps"])
    check_fidelity(data["fidelity"])
    check_compression(data["compression"])
    check_workload(data["workload"])


def test_committed_spanning_results_hold_together():
    """bench/spanning.py's summaries recomputed from its rows: found with Wilson roots, recall means, TTFT over the
    baseline's; and the held-out split ran none of the variants the tune split ruled out."""
    paths = [p for p in sorted(RESULTS.glob("spanning-*.json")) if not p.stem.startswith("spanning-rows-")]
    if not paths:
        pytest.skip("no bench/spanning.py results committed")
    for path in paths:
        d = json.loads(path.read_text())
        for split, rows in d["rows"].items():
            for key, arms in d["summary"][split].items():
                kind, modules, phrasing = key.split("/")
                rs = [r for r in rows if r["set"] == kind and str(r["modules"]) == modules
                      and phrasing in ("every phrasing", r["phrasing"])]
                for arm, s in arms.items():
                    found = sum(r[arm]["found"] for r in rs)
                    assert (s["found"], s["n"]) == (found, len(rs)), (path.name, key, arm)
                    assert s["ci95"] == pytest.approx(wilson_roots(found, len(rs)), abs=1e-4)
                    if "recall" in s:
                        assert s["recall"] == pytest.approx(statistics.mean(r[arm]["recall"] for r in rs), abs=1e-4)
                    if "mean_ttft_vs_baseline" in s:
                        ratio = sum(r[arm]["ttft_ms"] for r in rs) / sum(r["baseline"]["ttft_ms"] for r in rs)
                        assert s["mean_ttft_vs_baseline"] == pytest.approx(ratio, abs=1e-3)
            if split == "heldout":
                assert not {a for r in rows for a in r} & set(d["tune_only"])


def test_fidelity_plot_labels_do_not_pile_up(monkeypatch, tmp_path):
    """Issue 48 item 7: the Fidelity plot's labels of points that sit together are spread so that none covers
    another (they piled up at one spot, unreadable); a point alone keeps its label beside it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from fidelity import frontier_panels, plot_frontier, spread_labels

    cluster = [(0.10, 0.90), (0.11, 0.90), (0.12, 0.90), (0.12, 0.91), (0.13, 0.90), (0.99, 0.90), (0.5, 0.2)]
    sizes = [(0.15, 0.04)] * len(cluster)
    spots = spread_labels(cluster, sizes)
    boxes = [(x, y, x + w, y + h) for (x, y), (w, h) in zip(spots, sizes)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)  # no two overlap
    assert spots[-1] == pytest.approx((0.51, 0.21))  # alone: just beside its point
    assert spots[5][0] + sizes[5][0] < 0.99  # at the right edge: left of its point, inside the axes
    data = json.loads((ROOT / "bench" / "results" / "fidelity.json").read_text())
    out = tmp_path / "frontier.png"
    plot_frontier(frontier_panels(data["frontier"], data["confusable"], data["confusable_modules"]), out, data["model"])
    assert out.stat().st_size > 10_000
