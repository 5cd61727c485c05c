"""Studio handlers called directly (no server), on the tiny random-weight Llama — Compare tab: streaming arms, columns, divergence marks, errors, repair."""

from __future__ import annotations

import ast
import csv

import gradio as gr
import pytest

from engine.run.events import Token
from engine.config import limit_of
from engine.runlog import RunLog
from studio import builder as b
from studio import arm_views, files, views
from studio.settings import Panel
from studio.state import Studio
from studio.tabs import compare as cmp
from studio.tabs import encode as enc
from studio.tabs import history as hist
from studio.tabs import model as mdl
from studio.tabs import prompt as prm
from studio.tabs import schema as sch
from tests.conftest import ROOT

import html
import json
import sqlite3
from dataclasses import replace
import time
from functools import partial

from engine.arms.compare import Comparison
from tests.studio_fixtures import (CPU, TRAVEL_PROMPT, doc, settings, studio, travel,  # noqa: F401 (fixtures)
                                   write_lock_held)


def test_compare_streams_each_arm_and_records_one_row(studio, travel, monkeypatch):
    schema, prompt, _ = travel
    monkeypatch.setattr(cmp, "UPDATE_EVERY", 0.02)  # the tiny model decodes a whole comparison in ~0.2 s
    stamped = [(time.monotonic(), u) for u in cmp.compare_stream(studio, schema, prompt, 12, settings=settings())]
    updates = [u for _, u in stamped]
    phases = [u.phase for u in updates]
    assert phases[-1] == "done" and updates[0].arms == ("baseline", "prefix", "cached")
    final = updates[-1]
    data = final.result
    assert final.texts == {arm: data[arm]["text"] for arm in ("baseline", "prefix", "cached")}
    assert row_prefix_ok(studio.runlog.get(final.run_id), data)
    streamed = [(t, u) for t, u in stamped if u.phase in ("baseline", "prefix", "cached")]
    assert streamed, "no arm's text was streamed before the end"
    for _, u in streamed:  # every streamed text is the start of the arm's final text
        assert all(data[arm]["text"].startswith(text) for arm, text in u.texts.items()), u.texts
    # coalesced: far fewer updates than the 36 tokens, and never two within the update period (the reader's
    # own clock; the period is what compare_stream waits between two)
    gaps = [b[0] - a[0] for a, b in zip(streamed, streamed[1:])]
    assert len(streamed) < 36 and all(g >= 0.02 * 0.9 for g in gaps), gaps
    row = studio.runlog.get(final.run_id)
    assert row["schema_name"] == "travel" and row["schema_text"] == schema and row["prompt_text"] == prompt
    assert row["arms"]["baseline"]["ttft_ms"] == data["baseline"]["ttft_ms"]
    assert row["arms"]["cached"]["ttft_ms"] == data["cached"]["ttft_ms"]
    assert studio.runlog.count() == 1


def row_prefix_ok(row, data) -> bool:
    """The run log keeps the prefix arm's own figures (not a copy of another arm's)."""
    return (row["arms"]["prefix"]["ttft_ms"] == data["prefix"]["ttft_ms"]
            and row["arms"]["prefix"]["reused_tokens"] == data["prefix"]["reused_tokens"])


def test_divergence_offsets_mark_where_the_texts_part(studio, travel):
    from engine.arms.registry import first_divergence

    schema, prompt, _ = travel
    final = list(cmp.compare_stream(studio, schema, prompt, 6, settings=settings(mode="isolated")))[-1]
    res = final.comparison
    marks = cmp.divergence_offsets(studio, res)
    k = first_divergence(res.baseline.token_ids, res.cached.token_ids)
    if k is None:
        assert marks == {}
    else:
        tok = studio.tokenizer
        assert res.cached.text[:marks["cached"]] == tok.decode(list(res.cached.token_ids[:k]), skip_special_tokens=True)
        assert res.baseline.text[:marks["baseline"]] == \
            tok.decode(list(res.baseline.token_ids[:k]), skip_special_tokens=True)


def test_compare_json_is_the_engines_document(studio, travel):
    from engine.arms.registry import Sampling

    schema, prompt, _ = travel
    data = cmp.compare_json(studio, schema, prompt, 4, settings=settings(storage_dtype="float16"))
    direct = studio.engine.compare(schema, prompt, Sampling(4),
                                   config=studio.engine.config.with_(storage_dtype="float16")).to_json()
    assert set(data) == set(direct) | {"logged"}  # the API's document is run --json's, plus one key
    assert data["logged"] == {"ok": True, "run_id": 1, "error": None, "pending": 0, "flushed": 0, "dropped": 0}
    stored = json.loads(studio.runlog.get(1)["result_json"])
    assert "logged" not in stored and set(stored) == set(direct)  # the log keeps run --json's document
    for key in ("model", "schema", "prompt_tokens", "cached_tokens", "store_bytes", "storage_dtype", "arms",
                "same_text", "first_divergence"):
        assert data[key] == direct[key], key
    assert data["baseline"]["text"] == direct["baseline"]["text"] and data["cached"]["text"] == direct["cached"]["text"]
    assert studio.runlog.count() == 1  # the direct engine call is not recorded


def test_arm_columns_follow_the_arms_that_ran():
    base = {"text": "a", "ttft_ms": 100.0, "copy_ms": 0.0, "prefill_ms": 99.0, "prefill_tokens": 300,
            "decode_ms_per_token": 50.0, "new_tokens": 2, "peak_rss_bytes": 9e8, "cuda_peak_bytes": None}
    data = {"arms": ["baseline", "prefix", "cached"], "cached_tokens": 280, "baseline": base,
           "prefix": {**base, "ttft_ms": 40.0, "reused_tokens": 200, "prefilled_tokens": 100, "prefill_tokens": 100,
                      "warmed_with": {"summary": "schema-order warm-up (3 modules, 516 tokens) + 0 earlier runs",
                                      "warmup": {"schema": "travel", "modules": ["flights", "hotels", "visas"],
                                                 "tokens": 516}, "earlier_runs": 0}},
           "cached": {**base, "ttft_ms": 10.0, "prefill_tokens": 20, "reused_tokens": 280}}
    c = doc(data)
    assert "200 reused · 100 prefilled" in views.metrics_html(c, "prefix")
    chip = views.metrics_html(c, "prefix")
    assert "2.5× faster" in chip and "held before this run: schema-order warm-up (3 modules, 516 tokens)" in chip
    assert "{" not in chip.split("held before this run")[1].split("</span>")[0]  # the summary, not the JSON object
    assert "280 reused · 20 prefilled" in views.metrics_html(c, "cached") and "10.0×" in views.metrics_html(c,
                                                                                                             "cached")
    assert "0 reused · 300 prefilled" in views.metrics_html(c, "baseline")
    assert "KV copy" not in views.metrics_html(c, "baseline") and "KV copy" in views.metrics_html(c, "cached")
    two = {**data, "arms": ["baseline", "cached"], "prefix": None}
    assert "appear here after a run" in views.metrics_html(doc(two), "prefix")
    from engine.arms.registry import arm_names

    # one column per registered arm, in column order (an arm added as one file gets its column too)
    assert [v.arm for v in arm_views.views()] == list(arm_names())
    assert list(arm_names())[:4] == ["baseline", "prefix", "cached", "blend"]


def test_compare_view_shows_a_column_per_arm_that_ran(studio, travel, monkeypatch):
    from types import SimpleNamespace

    schema, prompt, _ = travel
    plan = studio.engine.plan(studio.layout(schema), prompt)
    tok = studio.tokenizer
    ids = {"baseline": tok.encode(" Nara, by train"), "prefix": tok.encode(" Nara, by train"),
           "cached": tok.encode(" Nara, by bus")}
    runs = {arm: SimpleNamespace(token_ids=tuple(t), text=tok.decode(t)) for arm, t in ids.items()}
    base = {"ttft_ms": 100.0, "copy_ms": 0.0, "prefill_ms": 99.0, "prefill_tokens": 300, "decode_ms_per_token": None,
            "new_tokens": 4, "peak_rss_bytes": 9e8, "cuda_peak_bytes": None}
    data = {"arms": ["baseline", "prefix", "cached"], "cached_tokens": 280, "prompt_tokens": 300, "speedup": 10.0,
            "same_text": False, "first_divergence": 3, "first_token_agree": True, "first_token_kl": 0.01,
            "storage": "cpu", "mode": "prefixed", "storage_dtype": "float32",
            **{arm: {**base, "text": runs[arm].text, "reused_tokens": 7, "prefilled_tokens": 293, "prefill_tokens": 293}
               for arm in ("baseline", "prefix", "cached")}}
    read = doc(data)
    arms = {a: replace(r, run=replace(r.run, token_ids=runs[a.value].token_ids)) for a, r in read.arms.items()}
    comparison = replace(read, arms=arms, plan=plan)

    def fake_stream(*args, **kw):
        yield cmp.CompareUpdate("prefix", {"baseline": "x", "prefix": "y", "cached": ""}, tuple(data["arms"]))
        yield cmp.CompareUpdate("done", {a: runs[a].text for a in runs}, tuple(data["arms"]), "", data, 1, comparison)

    monkeypatch.setattr(cmp, "compare_stream", fake_stream)
    streaming, done = list(cmp._stream_ui(studio, Panel({}), schema, prompt, 4, 0.0))
    columns = [done[1 + 3 * i: 4 + 3 * i] for i in range(len(arm_views.views()))]  # (column, text, metrics) per arm
    # the arms that ran have a column; the others (blend, and any arm registered after it) are hidden
    assert [c[0].visible for c in columns] == [v.arm in data["arms"] for v in arm_views.views()]
    assert [c[0].visible for c in columns][:4] == [True, True, True, False]
    assert "caret" in streaming[1 + 3 * 1 + 1] and "caret" not in streaming[1 + 1]  # the prefix arm is generating
    marks = cmp.divergence_offsets(studio, comparison)
    k = next(i for i, (x, y) in enumerate(zip(ids["baseline"], ids["cached"])) if x != y)
    assert "prefix" not in marks and marks["cached"] == marks["baseline"] == len(tok.decode(ids["cached"][:k])) > 0
    assert '<mark class="diverge">' in columns[2][1] and '<mark class="diverge">' not in columns[1][1]
    assert "7 reused · 293 prefilled" in columns[1][2]  # the arm's own prefill count
    data2 = {**data, "arms": ["baseline", "cached"], "prefix": None}
    monkeypatch.setattr(cmp, "compare_stream", lambda *a, **k: iter(
        [cmp.CompareUpdate("done", {}, ("baseline", "cached"), "", data2, 1,
                           replace(comparison, arms={a: r for a, r in comparison.arms.items() if a != "prefix"}))]))
    (done,) = list(cmp._stream_ui(studio, Panel({}), schema, prompt, 4, 0.0))
    assert [done[1 + 3 * i].visible for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("schema_text,prompt_text,match", [
    (None, "<prompt schema='travel'><nope/></prompt>", "unknown module"),
    ("<schema name='x'>", None, "malformed"),
])
def test_failing_run_is_a_gr_error_and_leaves_no_row(studio, travel, schema_text, prompt_text, match):
    schema, prompt, _ = travel
    args = (schema_text or schema, prompt_text or prompt)
    with pytest.raises(gr.Error, match=match):
        list(cmp.compare_stream(studio, *args, 2, settings=settings()))
    with pytest.raises(gr.Error, match=match):
        cmp.compare_json(studio, *args, 2)
    assert studio.runlog.count() == 0


def test_crash_mid_run_is_a_gr_error_without_traceback_and_no_row(studio, travel, monkeypatch):
    schema, prompt, _ = travel

    def broken(*args, **kw):
        yield Token("baseline", 0, "partial", "partial")
        raise RuntimeError("simulated out of memory")

    monkeypatch.setattr(studio.engine, "events", broken)
    seen = []
    with pytest.raises(gr.Error) as err:
        for upd in cmp.compare_stream(studio, schema, prompt, 2, settings=settings()):
            seen.append(upd)
    assert "simulated out of memory" in err.value.message and "Traceback" not in err.value.message
    assert any(u.texts.get("baseline") == "partial" for u in seen)
    assert studio.runlog.count() == 0


def test_bad_sampling_settings_are_gr_errors(studio, travel):
    schema, prompt, _ = travel
    with pytest.raises(gr.Error, match="max new tokens must be a whole number from 1 to"):
        list(cmp.compare_stream(studio, schema, prompt, 0))
    with pytest.raises(gr.Error, match="temperature"):
        cmp.compare_json(studio, schema, prompt, 2, temperature=-1)
    with pytest.raises(gr.Error, match="whole number"):
        cmp.compare_json(studio, schema, prompt, "many")


NON_NUMBERS = [float("nan"), float("inf"), float("-inf"), 2**70, -2**70, "1e400", "abc", "0x10"]


@pytest.mark.parametrize("value", NON_NUMBERS)
def test_non_finite_and_huge_values_from_the_page_or_the_api_are_named_gr_errors(studio, travel, value):
    """/compare (compare_json), the Compare button (compare_stream) and sampling_of name the setting; no row."""
    schema, prompt, _ = travel
    cases = [(field, partial(cmp.sampling_of, **{"max_new_tokens": 2, field: value}))
             for field in ("max_new_tokens", "temperature", "top_p", "seed")]
    cases += [("max_new_tokens", partial(cmp.compare_json, studio, schema, prompt, value)),
              ("temperature", lambda: list(cmp.compare_stream(studio, schema, prompt, 2, value, settings())))]
    cases += [(field, partial(cmp.compare_json, studio, schema, prompt, 2, settings=settings(**{field: value})))
              for field in ("retention", "budget_mib", "repair", "sink", "blend")]
    for field, call in cases:
        with pytest.raises(gr.Error) as err:
            call()
        message = err.value.message
        assert message.startswith(f"{limit_of(field).name} must be ") and "e.g." in message, (field, message)
        assert "Traceback" not in message
    assert studio.runlog.count() == 0


def test_repair_setting_reaches_the_run_and_the_token_view(studio, travel):
    schema, prompt, _ = travel
    data = cmp.compare_json(studio, schema, prompt, 2, settings=settings(mode="isolated", repair=4.0, sink=0))
    assert data["repair"] == 4 and data["cached"]["recomputed_tokens"] == len(data["cached"]["recomputed_positions"]) > 0
    summary = views.summary_html(doc(data))
    assert f"{data['cached']['recomputed_tokens']} cached tokens recomputed" in summary
    marks = views.token_marks(doc(data))
    assert marks["recomputed"] == set(data["cached"]["recomputed_positions"])
    off = cmp.compare_json(studio, schema, prompt, 2, settings=settings(mode="isolated", repair=0))
    assert off["cached"]["recomputed_tokens"] == 0 and "recomputed" not in views.summary_html(doc(off))
    with pytest.raises(gr.Error, match="repair must be a whole number from 0 to 64"):
        cmp.compare_json(studio, schema, prompt, 2, settings=settings(repair=65))


def test_compare_columns_show_the_kv_each_arm_held():
    from engine.arms.registry import RunResult
    from studio.views import kv_rows, metrics_html

    base = {"kv_held_bytes": 4_000_000, "kv_buffer_used_bytes": 4_000_000, "kv_store_bytes": 0}
    cached = {"kv_held_bytes": 7_000_000, "kv_buffer_used_bytes": 4_000_000, "kv_store_bytes": 3_000_000,
              "kv_buffer_bytes_after_retention": 2_000_000}
    assert kv_rows(RunResult.from_json("baseline", base), "baseline") == [("KV held", "4.0 MB (prompt buffer)")]
    rows = dict(kv_rows(RunResult.from_json("cached", cached), "cached"))
    assert rows["KV held"] == "7.0 MB (modules 3.0 + buffer 4.0)"
    assert rows["decoded over"].startswith("2.0 MB after retention (50%")
    assert kv_rows(RunResult.from_json("prefix", {"kv_held_bytes": 0}), "prefix") == []  # an old run-log row
    run = dict(cached, ttft_ms=10.0, prefill_tokens=3, prefill_ms=5.0, new_tokens=2, peak_rss_bytes=1e9,
               decode_ms_per_token=2.0)
    assert "modules 3.0 + buffer 4.0" in metrics_html(doc({"cached": run}), "cached")


# -- a run the run log cannot take is reported, kept, and written with the next -------------------------

def runs_in(path) -> list[tuple]:
    """(id, created_at, result_json) of every run, read with plain sqlite3 (not the RunLog under test)."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("select id, created_at, result_json from runs order by id").fetchall()
    finally:
        conn.close()


def as_stored(data: dict) -> dict:
    """The API's answer as the run log stores it: the run --json document, without ``logged``."""
    return json.loads(json.dumps({k: v for k, v in data.items() if k != "logged"}))


def test_a_run_the_locked_log_cannot_take_is_reported_kept_and_written_with_the_next(tiny_engine, tmp_path,
                                                                                      monkeypatch):
    from studio import state

    path = tmp_path / "runs.db"
    studio = Studio(tiny_engine, RunLog(path, timeout=0.2))
    times = iter(f"2026-01-01T00:00:0{i}+00:00" for i in range(1, 4))
    monkeypatch.setattr(state, "utc_now", lambda: next(times))  # the time each run finished
    schema, prompt = files.load_sample("travel")
    with write_lock_held(path):
        first = cmp.compare_json(studio, schema, prompt, 2, settings=settings())
        page = list(cmp._stream_ui(studio, Panel({}), schema, prompt, 2, 0.0))[-1]
        assert runs_in(path) == []  # nothing reached the file
    logged = first["logged"]
    assert logged["ok"] is False and logged["run_id"] is None and logged["pending"] == 1
    assert f"the run log {path} is locked by another writer (waited 0.2 s)" in logged["error"]
    assert "--db another.db" in logged["error"] and "kept in memory (1 waiting" in logged["error"]
    assert as_stored(first).keys() == first.keys() - {"logged"}  # every run --json key is still there
    summary, status = page[0], page[-1]
    assert '<span class="pml-chip warn">' in summary and "kept in memory (2 waiting" in summary
    assert "locked by another writer" in summary and "2 not logged" in status and "pml-chip warn" in status
    notice = hist._refresh_ui(studio, tmp_path, "all")[-1]
    assert "2 finished runs are not in the run log yet" in html.unescape(notice) and "locked" in notice
    third = cmp.compare_json(studio, schema, prompt, 2, settings=settings())  # the lock is gone
    assert third["logged"] == {"ok": True, "run_id": 3, "error": None, "pending": 0, "flushed": 2, "dropped": 0}
    stored = runs_in(path)
    assert [(i, t) for i, t, _ in stored] == [(1, "2026-01-01T00:00:01+00:00"), (2, "2026-01-01T00:00:02+00:00"),
                                              (3, "2026-01-01T00:00:03+00:00")]  # in order, each with its own time
    assert [json.loads(doc) for *_, doc in stored] == [as_stored(first), as_stored(page[-2]), as_stored(third)]
    conn = sqlite3.connect(path)
    assert conn.execute("select count(*) from arm_runs").fetchone()[0] == 3 * len(first["arms"])
    conn.close()
    assert hist.notice_html(studio) == "" and "not logged" not in studio.status_html()


def test_the_api_reports_a_log_from_a_newer_version_and_leaves_it_unchanged(tiny_engine, tmp_path):
    from tests.engine.test_runlog import files_of, newer_database

    path = tmp_path / "runs.db"
    newer_database(path)
    before = files_of(path)
    studio = Studio(tiny_engine, RunLog(path))
    schema, prompt = files.load_sample("travel")
    data = cmp.compare_json(studio, schema, prompt, 2, settings=settings())
    logged = data["logged"]
    assert logged["ok"] is False and logged["pending"] == 0  # it can never be written: nothing kept for it
    assert "newer PML Studio (schema version 99, this one knows 2)" in logged["error"] and str(path) in logged["error"]
    assert [r[0] for r in hist.rows(studio)] == [7]  # History lists what it can read
    assert "newer PML Studio" in hist.notice_html(studio) and "read-only" in studio.status_html()
    assert files_of(path) == before
