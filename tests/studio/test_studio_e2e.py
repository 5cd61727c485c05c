"""End to end: the studio served on 127.0.0.1, a comparison through gradio_client, the row it leaves."""

from __future__ import annotations

import urllib.request

from tests.conftest import SAMPLES, free_port
from tests.studio_fixtures import AUTH, TOKEN, served_studio


def test_compare_through_gradio_client_records_a_row(tiny_engine, tmp_path):
    import sqlite3

    from gradio_client import Client

    from engine.cache.encode import count_units
    from engine.runlog import RunLog
    from engine.arms.registry import Sampling
    runlog = RunLog(tmp_path / "runs.db", timeout=0.5)
    schema = (SAMPLES / "travel.xml").read_text()
    prompt = (SAMPLES / "travel.prompt.xml").read_text()
    # behind the same guard as `make run`: gradio_client reaches the /compare API with the launch token
    with served_studio(tiny_engine, runlog) as (demo, port):
        client = Client(f"http://127.0.0.1:{port}/", verbose=False, headers=AUTH)
        data = client.predict(schema, prompt, 4, "cpu", "prefixed", 0.0, api_name="/compare")  # the 6-argument call
        half = client.predict(schema, prompt, 4, "cpu", "isolated", 0.0, "float16", 0.5, "recent", api_name="/compare")
        other = sqlite3.connect(runlog.path)
        other.execute("BEGIN IMMEDIATE")  # another program holds the run log's write lock past the timeout
        unlogged = client.predict(schema, prompt, 2, api_name="/compare")
        other.rollback()
        other.close()
        api = client.view_api(print_info=False, return_format="dict")

    params = {p["parameter_name"]: p for p in api["named_endpoints"]["/compare"]["parameters"]}
    for name, default in (("storage_dtype", "float32"), ("retention", 1.0), ("compression", "pyramid")):
        assert params[name]["parameter_has_default"] and params[name]["parameter_default"] == default
    assert list(api["named_endpoints"]) == ["/compare"]

    # the document equals what the engine returns for the same run (texts are greedy, so equal)
    direct = tiny_engine.compare(schema, prompt, Sampling(4)).to_json()
    assert set(data) == set(direct) | {"logged"}  # run --json's keys, plus whether the run was logged
    assert data["logged"] == {"ok": True, "run_id": 1, "error": None, "pending": 0, "flushed": 0, "dropped": 0}
    assert half["logged"]["run_id"] == 2
    assert unlogged["logged"]["ok"] is False and unlogged["logged"]["pending"] == 1  # the client is told
    assert "locked by another writer" in unlogged["logged"]["error"] and unlogged["baseline"]["text"]
    for key in ("model", "schema", "storage", "mode", "prompt_tokens", "cached_tokens", "uncached_tokens",
                "store_bytes", "storage_dtype", "compression", "arms", "same_text", "first_divergence", "sampling"):
        assert data[key] == direct[key], key
    assert data["baseline"]["text"] == direct["baseline"]["text"] and data["cached"]["text"] == direct["cached"]["text"]
    assert (half["mode"], half["storage_dtype"], half["compression"]) == \
        ("isolated", "float16", {"retention": 0.5, "method": "recent"})
    assert half["store_bytes"] < data["store_bytes"]

    rows = runlog.runs()
    assert len(rows) == 2  # both logged API calls, not the direct engine call (the third waits in memory)
    row = rows[-1]
    assert row["schema_name"] == "travel" and row["schema_text"] == schema and row["prompt_text"] == prompt
    assert row["arms"]["baseline"]["ttft_ms"] == data["baseline"]["ttft_ms"]
    assert row["arms"]["cached"]["text"] == data["cached"]["text"]
    assert row["storage_dtype"] == "float32" and row["retention"] == 1.0 and row["compression_method"] == "pyramid"
    units = count_units(tiny_engine.layout(schema))
    assert (row["units_memory"], row["units_disk"], row["units_encoded"]) == (0, 0, units)


def test_serve_binds_localhost_without_share_and_loads_no_model(tmp_path, monkeypatch):
    from engine.devices import cache_root
    from studio.launch import StudioOptions, serve

    (tmp_path / "models").symlink_to(cache_root() / "models")  # the converted default model, not a new copy
    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path))
    port = free_port()
    demo = serve(StudioOptions(port=port, preload=False, token=TOKEN), block=False)
    try:
        assert demo.share is False or demo.share is None
        assert demo.server_name == "127.0.0.1"
        page = urllib.request.Request(f"http://127.0.0.1:{port}/", headers=AUTH)
        with urllib.request.urlopen(page, timeout=10) as resp:
            assert resp.status == 200
        assert not demo.studio.engine.loaded
        assert demo.studio.engine._codec is not None  # the tokenizer is loaded before the page is served
        assert demo.studio.runlog.path == tmp_path / "runs.db"
    finally:
        demo.close()
