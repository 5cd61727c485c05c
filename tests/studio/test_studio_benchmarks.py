"""Studio handlers called directly (no server), on the tiny random-weight Llama — Benchmarks tab: results read from a folder, commands, the live scaling run."""

from __future__ import annotations

import ast
import csv

import gradio as gr
import pytest

from engine.runlog import RunLog
from studio import builder as b
from studio import files, views
from studio.settings import Panel
from studio.state import Studio
from studio.tabs import compare as cmp
from studio.tabs import encode as enc
from studio.tabs import history as hist
from studio.tabs import model as mdl
from studio.tabs import prompt as prm
from studio.tabs import schema as sch
from tests.conftest import ROOT

from tests.studio_fixtures import CPU, TRAVEL_PROMPT, doc, settings, studio, travel  # noqa: F401 (fixtures)

MACHINE = {"date": "2026-01-02", "python": "3.11.7", "torch": "2.13.0+cpu", "threads": 2, "cpu": "x86_64",
           "cuda": False}


def _point(n: int, base: float, cached: float) -> dict:
    return {"target_tokens": n, "prompt_tokens": n - 3, "cached_tokens": n - 35, "uncached_tokens": 32,
            "modules": 2, "store_bytes": 1, "baseline_ttft_ms": base, "cached_ttft_ms": cached,
            "cached_copy_ms": 1.0, "cached_prefill_ms": cached - 2, "cached_sample_ms": 1.0,
            "speedup": round(base / cached, 2), "baseline_decode_ms_per_token": 50.0,
            "cached_decode_ms_per_token": 49.0, "same_text": True}


def _write_results(folder):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    fits = {"cached_ttft_vs_cached_tokens_linear": {"slope_ms_per_token": 0.01, "intercept_ms": 150.0, "r2": 0.98},
            "baseline_ttft_power": {"exponent": 1.21, "r2": 0.99}}
    (folder / "scaling.json").write_text(json.dumps(
        {"benchmark": "scaling", "model": "SmolLM2-135M-Instruct", "dtype": "float32", "reps": 5, "machine": MACHINE,
         "results": [_point(256, 700.0, 160.0), _point(4096, 12000.0, 200.0)], "fits": fits, "gpu": None,
         "gpu_note": "no CUDA device on this machine: GPU storage cases not run"}))
    (folder / "ttft.json").write_text(json.dumps(
        {"benchmark": "ttft", "command": "python bench/ttft.py", "model": "SmolLM2-135M-Instruct", "reps": 5,
         "new_tokens": 16, "machine": MACHINE, "results": [_point(n, 10.0 * n, 150.0) for n in (512, 1024, 2048, 4096)]}))
    (folder / "memory.json").write_text(json.dumps(
        {"benchmark": "memory", "machine": MACHINE,
         "loaded": {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "kv_bytes_per_token": 46080},
         "families": [{"model": "Llama-2-7B", "layers": 32, "kv_heads": 32, "head_dim": 128,
                       "fp16_bytes_per_token": 524288, "fp16_mb_per_token": 0.5, "fp32_bytes_per_token": 1048576,
                       "fp16_gib_per_4k_tokens": 2.0}],
         "samples": [{"schema": "travel", "stored_tokens": 10, "predicted_bytes": 460800, "measured_bytes": 460800,
                      "match": True, "entries": 3}], "all_match": True}))
    summary = {"baseline": {"accuracy": 0.75, "found": 36, "n": 48, "ci95": [0.61, 0.85]},
               "prefixed": {"accuracy": 0.7, "found": 34, "n": 48, "ci95": [0.57, 0.81],
                            "first_token_agreement": 0.9, "mean_first_token_kl": 0.01, "same_text_rate": 0.5,
                            "median_first_divergence": 4, "mean_rouge_l": 0.8}}
    by = {"baseline": 0.75, "prefixed": 0.7, "n": 16}
    (folder / "compression.json").write_text(json.dumps(
        {"benchmark": "compression", "model": "SmolLM2-135M-Instruct", "prompts": 16, "modules_per_prompt": 4,
         "new_tokens": 28, "machine": MACHINE,
         "summary": {"baseline": {"accuracy": 0.5, "found": 8, "n": 16, "ci95": [0.28, 0.72]},
                     "pyramid 50%": {"accuracy": 0.5, "found": 8, "n": 16, "ci95": [0.28, 0.72], "bytes_ratio": 0.49,
                                     "ttft_ms": 120.0, "agree_ref": 0.9, "kl_ref": 0.02, "agree_base": 0.8,
                                     "kl_base": 0.03}},
         "verdicts": ["retention 50%: pyramid 50%, uniform 40%, recent 30% -> pyramid beats both controls"]}))
    (folder / "fidelity.json").write_text(json.dumps(
        {"benchmark": "fidelity", "model": "SmolLM2-135M-Instruct", "new_tokens": 20, "prompts": 8,
         "machine": MACHINE, "summary": summary, "by_depth": {"0.1": by, "0.9": by}, "by_modules": {"2": by}}))


def test_benchmarks_tab_reads_results_folder(tmp_path):
    from studio import benchmarks as bm

    folder = tmp_path / "results"
    _write_results(folder)
    head, rows, fits = bm.scaling_view(folder)
    assert "2026-01-02" in head and "2 threads" in head and "`python bench/scaling.py --lengths 256 4096 --reps 5`" \
        in head
    assert "no CUDA device" in head
    assert list(rows["prompt tokens"]) == [253, 4093] and rows["speedup"].iloc[1] == "60.0×"
    assert len(fits) == 2 and "^k" in fits["fit"].iloc[1]
    head, rows = bm.ttft_view(folder)
    assert "`python bench/ttft.py`" in head and len(rows) == 4  # the command the file records
    head, fams, samples = bm.memory_view(folder)
    assert "46,080 KV bytes per token" in head and "equals predicted" in head
    assert fams["MB / token fp32"].iloc[0] == 1.0 and samples["equal"].iloc[0] == "yes"
    head, summary, depth, modules = bm.fidelity_view(folder)
    assert "`python bench/fidelity.py --modules 2 --per-setting 8 --depths 0.1 0.9 --new-tokens 20`" in head
    assert list(summary["path"]) == ["baseline", "prefixed"] and summary["95 % CI"].iloc[0] == "61 % – 85 %"
    assert summary["1st-token agreement"].iloc[1] == "90 %"
    assert list(depth.columns) == ["needle depth", "baseline", "prefixed", "n"] and len(modules) == 1
    head, rows = bm.compression_view(folder)
    assert "pyramid beats both" in head and list(rows["configuration"]) == ["baseline", "pyramid 50%"]
    assert rows["module bytes"].iloc[1] == "49 %" and rows["module bytes"].iloc[0] == "–"


def test_benchmark_commands_are_recorded_or_rebuilt_explicitly():
    from studio import benchmarks as bm

    rows = [{"target_tokens": n} for n in (256, 512)]
    assert bm.command("scaling", {"command": "python bench/scaling.py --quick", "results": rows}) == \
        "python bench/scaling.py --quick"
    assert bm.command("scaling", {"results": rows, "reps": 1, "new_tokens": 2}) == \
        "python bench/scaling.py --lengths 256 512 --reps 1 --new-tokens 2"
    assert bm.command("memory", {"model": "/m"}) == "python bench/memory.py --model /m"
    assert bm.command("memory", {}) == "python bench/memory.py"
    assert not hasattr(bm, "script_defaults")  # the scripts' source is never parsed


def test_benchmarks_tab_without_results(tmp_path):
    from studio import benchmarks as bm

    empty = tmp_path / "none"
    head, rows, fits = bm.scaling_view(empty)
    assert "not run yet: `python bench/scaling.py`" in head and rows.empty and fits.empty
    assert "not run yet: `python bench/memory.py`" in bm.memory_view(empty)[0]
    head, summary, depth, modules = bm.fidelity_view(empty)
    assert "not run yet: `python bench/fidelity.py`" in head and summary.empty and depth.empty
    assert bm.plot_path("scaling", empty) is None and "python bench/scaling.py" in bm.plot_note("scaling", empty)
    (empty / "x").mkdir(parents=True)
    (empty / "ttft.json").write_text("{not json")
    assert "cannot be read" in bm.ttft_view(empty)[0]
    (empty / "frontier.png").write_bytes(b"png")
    assert bm.plot_path("fidelity", empty) == str(empty / "frontier.png") and bm.plot_note("fidelity", empty) == ""


def test_scaling_at_small_sizes_runs_the_benchmark_code(tiny_engine):
    from studio import benchmarks as bm

    before = sorted((p.name, p.stat().st_mtime) for p in bm.RESULTS.glob("*")) if bm.RESULTS.exists() else []
    calls = []
    rows, note = bm.run_small_scaling(tiny_engine, [128, 96, 128], lambda d, t, label: calls.append((d, t, label)))
    assert [r["target_tokens"] for r in rows] == [96, 128]
    for r in rows:
        assert 0 < r["cached_tokens"] < r["prompt_tokens"] <= r["target_tokens"]
        # speedup is written to 2 decimals, from TTFTs written to 3
        assert r["speedup"] == pytest.approx(r["baseline_ttft_ms"] / r["cached_ttft_ms"], rel=0.01, abs=0.005)
    assert calls[-1][:2] == (2, 2) and "Not saved" in note
    table, plot = bm.small_rows(rows), bm.small_plot(rows)
    assert list(table.columns) == bm.SMALL_HEADERS and len(table) == 2
    assert sorted(plot["path"]) == ["baseline", "baseline", "cached", "cached"]
    after = sorted((p.name, p.stat().st_mtime) for p in bm.RESULTS.glob("*")) if bm.RESULTS.exists() else []
    assert after == before  # bench/results is the benchmarks' job
    assert len(tiny_engine.store()) == 0  # the run used its own throw-away store


@pytest.mark.parametrize("lengths,match", [([], "at least one"), ([2048], "outside"), (["many"], "not a prompt"),
                                           ([32], "outside"), ([float("inf")], "not a prompt"),
                                           ([float("nan")], "not a prompt"), ([2**70], "outside")])
def test_scaling_at_small_sizes_rejects_bad_lengths(tiny_engine, lengths, match):
    from studio import benchmarks as bm

    with pytest.raises(gr.Error, match=match):
        bm.run_small_scaling(tiny_engine, lengths)
