"""What the benchmark tests share: running a benchmark in its CI-sized --quick mode, and the checks that
recompute each summary figure from the per-run figures it summarises (medians and speedups from each arm's own
repetitions, fits with numpy, Wilson intervals as the roots of their quadratic). The same checks run on the
committed results in bench/results/, which the README quotes.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import runpy
import statistics
import sys
import time

import numpy as np
import pytest
import torch

from bench.common import QUICK_MODEL
from conftest import ROOT
from engine.model import MODEL_ENV

RESULTS = ROOT / "bench" / "results"
real_model = pytest.mark.real_model


def run_bench(script: str, *args: str) -> tuple[str, dict, float]:
    """(stdout, the JSON document it prints last, wall-clock ms of the whole script) of ``bench/script --quick``.

    Run in this process, as ``python bench/script`` runs it (``__main__``, its folder first on the path): a child
    process would import torch and transformers again for every script, the larger part of a quick run. Without
    the suite's $PML_STUDIO_MODEL, as a user runs it: --quick must choose its model itself, and the JSON's "model"
    must name it (issue 65)."""
    path = ROOT / "bench" / script
    argv, threads, env = sys.argv, torch.get_num_threads(), dict(os.environ)
    sys.argv = [str(path), "--quick", *args]
    os.environ.pop(MODEL_ENV, None)
    sys.path.insert(0, str(path.parent))
    out = io.StringIO()
    t = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as err:
        assert err.code in (None, 0), f"{script} exited with {err.code!r}"
    finally:
        sys.argv = argv
        sys.path.remove(str(path.parent))
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)
    wall_ms = (time.perf_counter() - t) * 1000
    lines = [line for line in out.getvalue().strip().splitlines() if line.strip()]
    data = json.loads(lines[-1])  # one JSON document, last
    if not {"--model", "--random-shape"} & set(args):
        assert data.get("model", data.get("loaded", {}).get("model")) == QUICK_MODEL, f"{script} --quick ran another model"
    return out.getvalue(), data, wall_ms


def wilson_roots(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson interval as the two roots p of (k/n - p)^2 = z^2 p (1 - p) / n."""
    a, b, c = 1 + z * z / n, -(2 * k / n + z * z / n), (k / n) ** 2
    d = math.sqrt(max(b * b - 4 * a * c, 0.0))
    return (-b - d) / (2 * a), (-b + d) / (2 * a)


def check_rate(s: dict, found: int, n: int, rate: str = "accuracy") -> None:
    """``s[rate]`` is found / n and ``s["ci95"]`` its Wilson interval, both from the counts."""
    assert s[rate] == pytest.approx(found / n, abs=1e-4)
    assert s["ci95"] == pytest.approx(wilson_roots(found, n), abs=1e-4)


def check_ratio(got: float, num_ms: float, den_ms: float, places: int) -> None:
    """``got`` is a ratio rounded to ``places`` of two times the JSON gives to 0.01 ms: the slack is those roundings
    and no more (a fixed 1% fails a tiny model's sub-millisecond times and ratios below 0.5)."""
    q = num_ms / den_ms
    slack = 0.5 * 10 ** -places + q * (0.0051 / num_ms + 0.0051 / den_ms) + 1e-9
    assert abs(got - q) <= slack, (got, num_ms, den_ms)


def check_ttft_row(r: dict, reps: int, kv_bytes: int = 46_080) -> None:
    """Medians and speedups of one length, from each arm's own repetitions (not the summary fields);
    ``kv_bytes`` per cached token (the default model's, fp32)."""
    b, c = r["baseline_ttft_ms_all"], r["cached_ttft_ms_all"]
    assert len(b) == len(c) == reps
    assert r["baseline_ttft_ms"] == pytest.approx(statistics.median(b), abs=0.011)
    assert r["cached_ttft_ms"] == pytest.approx(statistics.median(c), abs=0.011)
    check_ratio(r["speedup"], statistics.median(b), statistics.median(c), places=2)
    pairs = [x / y for x, y in zip(b, c)]
    assert r["speedup_min"] == pytest.approx(min(pairs), abs=0.01)
    assert r["speedup_max"] == pytest.approx(max(pairs), abs=0.01)
    assert r["cached_tokens"] + r["uncached_tokens"] == r["prompt_tokens"]
    assert r["store_bytes"] >= r["cached_tokens"] * kv_bytes  # the copied KV: every cached token


def timed_ms(rows: list[dict]) -> float:
    """Every repetition a TTFT script timed, in ms."""
    keys = ("baseline_ttft_ms_all", "cached_ttft_ms_all", "floor_ms_all", "nocache_ms_all")
    return sum(sum(r.get(k, ())) for r in rows for k in keys)


def shape_kv_bytes(d: dict) -> int:
    """KV bytes per token of a --random-shape run: K and V x layers x KV heads x head dim x element bytes."""
    sh = d["shape"]
    head_dim = sh["hidden_size"] // sh["num_attention_heads"]
    return 2 * sh["num_hidden_layers"] * sh["num_key_value_heads"] * head_dim * (4 if d["dtype"] == "float32" else 2)


def check_floor(r: dict, reps: int) -> None:
    """The floor figures of one length: min <= median <= max of their own reps, ratios of the medians."""
    for key in ("floor_ms", "nocache_ms"):
        runs = r[f"{key}_all"]
        assert len(runs) == reps and r[f"{key}_min"] == min(runs) and r[f"{key}_max"] == max(runs)
        assert r[f"{key}_min"] <= r[key] <= r[f"{key}_max"]
    check_ratio(r["cached_over_floor"], r["cached_ttft_ms"], r["floor_ms"], places=3)
    check_ratio(r["floor_over_nocache"], r["floor_ms"], r["nocache_ms"], places=3)


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
