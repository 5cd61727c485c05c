"""bench/compression.py in --quick mode: stored bytes, retention and agreement per configuration."""

from __future__ import annotations

from benchchecks import check_compression, real_model, run_bench


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
