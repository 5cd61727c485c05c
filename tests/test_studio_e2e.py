"""End to end: the studio served on 127.0.0.1, a comparison through gradio_client, the row it leaves."""

from __future__ import annotations

import socket
import sqlite3
import urllib.request

import pytest

from tests.conftest import SAMPLES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.real_model
def test_compare_through_gradio_client_records_a_row(real_engine, tmp_path):
    from gradio_client import Client

    from engine.runlog import RunLog
    from studio.app import build_app

    runlog = RunLog(tmp_path / "runs.db")
    demo = build_app(real_engine, runlog)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        schema = (SAMPLES / "travel.xml").read_text()
        prompt = (SAMPLES / "travel.prompt.xml").read_text()
        data = client.predict(schema, prompt, 4, "cpu", "prefixed", 0.0, api_name="/compare")
        api = client.view_api(print_info=False, return_format="dict")
    finally:
        demo.close()

    params = {p["parameter_name"]: p for p in api["named_endpoints"]["/compare"]["parameters"]}
    for name, default in (("storage_dtype", "float32"), ("retention", 1.0), ("compression", "pyramid")):
        assert params[name]["parameter_has_default"] and params[name]["parameter_default"] == default
    assert data["storage_dtype"] == "float32" and data["compression"]["retention"] == 1.0
    assert data["model"] == "SmolLM2-135M-Instruct" and data["schema"] == "travel"
    assert data["storage"] == "cpu" and data["mode"] == "prefixed"
    assert data["prompt_tokens"] == data["cached_tokens"] + data["uncached_tokens"] > data["uncached_tokens"] > 0
    assert 1 <= data["baseline"]["new_tokens"] <= 4 and 1 <= data["cached"]["new_tokens"] <= 4
    assert data["baseline"]["ttft_ms"] > 0 and data["cached"]["ttft_ms"] > 0
    assert data["sampling"]["max_new_tokens"] == 4 and data["sampling"]["temperature"] == 0.0
    for key in ("speedup", "same_text", "first_divergence", "first_token_agree", "first_token_kl", "store_bytes"):
        assert key in data

    conn = sqlite3.connect(runlog.path)
    conn.row_factory = sqlite3.Row
    rows = conn.execute("select * from runs").fetchall()
    conn.close()
    assert len(rows) == 1
    row = rows[0]
    assert row["schema_name"] == "travel" and row["schema_text"] == schema and row["prompt_text"] == prompt
    assert row["model"] == data["model"] and row["prompt_tokens"] == data["prompt_tokens"]
    assert row["baseline_ttft_ms"] == data["baseline"]["ttft_ms"]
    assert row["cached_ttft_ms"] == data["cached"]["ttft_ms"]
    assert row["baseline_text"] == data["baseline"]["text"] and row["cached_text"] == data["cached"]["text"]
    assert row["speedup"] == data["speedup"] and row["same_text"] == int(data["same_text"])
    assert row["storage_dtype"] == "float32" and row["retention"] == 1.0 and row["compression_method"] == "pyramid"
    assert row["units_memory"] + row["units_disk"] + row["units_encoded"] == data["encode"]["units"]


def test_serve_binds_localhost_without_share_and_loads_no_model(tmp_path, monkeypatch):
    from studio.launch import serve

    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path))
    port = free_port()
    demo = serve(port=port, block=False)
    try:
        assert demo.share is False or demo.share is None
        assert demo.server_name == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            assert resp.status == 200
        assert not demo.studio.engine.loaded
        assert demo.studio.runlog.path == tmp_path / "runs.db"
    finally:
        demo.close()
