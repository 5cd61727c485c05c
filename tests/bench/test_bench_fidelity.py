"""bench/fidelity.py in --quick mode: every summary recomputed from its rows."""

from __future__ import annotations

import re

from benchchecks import check_fidelity, real_model, run_bench


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
