"""Benchmarks in their CI-sized --quick mode: JSON shape and internal consistency, no timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.real_model


def run_bench(script: str, *args: str) -> tuple[str, dict]:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
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
        assert r["cached_ttft_ms"] >= r["cached_copy_ms"] >= 0
        assert r["speedup"] == pytest.approx(r["baseline_ttft_ms"] / r["cached_ttft_ms"], rel=0.01)
        assert r["store_bytes"] >= r["cached_tokens"] * 46_080
        assert len(r["baseline_ttft_ms_all"]) == len(r["cached_ttft_ms_all"]) == data["reps"]
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]
