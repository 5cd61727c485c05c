"""bench/workload.py in --quick mode: what each arm prefilled, reused and found over a mixed workload."""

from __future__ import annotations

from bench.needles import judge
from benchchecks import check_workload, real_model, run_bench


@real_model
def test_workload_quick():
    out, data, _ = run_bench("workload.py", "--blend", "0.25")  # 24 runs: ~1.5 min on a quiet machine
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
