"""Studio handlers called directly (no server), on the tiny random-weight Llama — History tab: the run log's table, plot, export, reopening and the settings it records."""

from __future__ import annotations

import ast
import csv
import os
import sqlite3
from contextlib import contextmanager
from types import SimpleNamespace

import gradio as gr
import pytest

from engine.runlog import RunLog
from engine.words import speed_words
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

from tests.studio_fixtures import CPU, TRAVEL_PROMPT, doc, settings, studio, travel  # noqa: F401 (fixtures)


def test_history_rows_plot_export_and_reopen(studio, travel, tmp_path):
    schema, prompt, _ = travel
    data = cmp.compare_json(studio, schema, prompt, 2, settings=settings(storage_dtype="float16"))
    rows = hist.rows(studio)
    assert len(rows) == 1 and rows[0][2] == "travel" and len(rows[0]) == len(hist.headers())
    cells = dict(zip(hist.headers(), rows[0]))
    assert cells["Baseline TTFT"] == f"{data['baseline']['ttft_ms']:.0f} ms"
    same = "same" if data["same_text"] else f"diverges at {data['first_divergence']}"
    assert cells["Modular cache TTFT"] == (f"{data['cached']['ttft_ms']:.0f} ms · {speed_words(data['speedup'])} · "
                                           f"{same} · {data['cached']['reused_tokens']:,} reused")  # what it reused, not the
    assert cells["prompt tokens"] == data["prompt_tokens"]  # schema's module tokens
    assert f"{data['prefix']['reused_tokens']:,} reused" in cells["Prefix cache TTFT"]
    detail = hist.run_detail(studio, rows[0][0])  # the logged run, drawn by the Compare tab's views
    assert detail.count('class="col-head"') == 3 and speed_words(data["speedup"]) in detail
    assert hist.rows(studio, "doc_qa") == []
    plot = hist.plot_points(studio, "all")
    assert sorted(zip(plot["arm"], plot["TTFT ms"])) == [(title, round(data[arm]["ttft_ms"])) for arm, title in
                                                         (("baseline", "Baseline"), ("cached", "Modular cache"),
                                                          ("prefix", "Prefix cache"))]
    assert hist.schemas(studio) == ["all", "travel"]
    out = hist.export_csv(studio, "all", tmp_path)
    assert [r["schema_name"] for r in csv.DictReader(open(out))] == ["travel"]
    row = hist.open_run(studio, str(rows[0][0]))
    assert row["schema_text"] == schema and row["prompt_text"] == prompt
    assert hist.stored_settings(row) == {"storage": "cpu", "mode": "contextual", "storage_dtype": "float16",
                                         "retention": 1.0, "method": "pyramid", "arms": ["baseline", "prefix", "cached"]}
    for bad, match in (("", "select a run"), (None, "select a run"), ("abc", "not a run id"), ("999", "no run 999")):
        with pytest.raises(gr.Error, match=match):
            hist.open_run(studio, bad)


def test_no_header_word_is_cut_and_the_plot_reads_whole_milliseconds_by_arm():
    """Gradio breaks a word wider than its column ("Modula / r cache TTFT"): at the studio's width every header's
    longest word fits its column. The plot's axes are whole numbers and its legend is titled "arm"."""
    heads, widths = hist.headers(), hist.column_widths()
    assert len(widths) == len(heads) and sum(float(w.rstrip("%")) for w in widths) == pytest.approx(100, abs=0.1)
    for head, width in zip(heads, widths):
        column_px = float(width.rstrip("%")) / 100 * hist.TABLE_PX
        longest = max(head.split(), key=len)
        assert len(longest) * hist.CHAR_PX + hist.PAD_PX <= column_px, f"{head!r}: '{longest}' is cut"
    assert "Modular cache TTFT" in heads

    plot = hist.ttft_plot()
    assert (plot.x, plot.y, plot.color) == ("prompt tokens", "TTFT ms", "arm") and plot.color_title in (None, "arm")
    assert plot.x_axis_format == plot.y_axis_format == ",d"  # d3: "1,025", never "193.000000"
    assert plot.height is None  # a fixed height clips the legend under the axis
    assert set(plot.color_map) == {v.title for v in arm_views.views()}
    points = hist.plot_points_of([{"id": 1, "prompt_tokens": 193, "schema_name": "s",
                                   "arms": {"cached": {"ttft_ms": 193.4}, "gone": {"ttft_ms": 1.6}}}])
    assert list(points.columns) == hist.PLOT_COLUMNS and "path" not in points.columns
    assert points.values.tolist() == [[193, 193, "Modular cache", 1, "s"], [193, 2, "gone", 1, "s"]]


@pytest.mark.parametrize("bad, match", [
    ("99999999999999999999999", "there is no run 99999999999999999999999 in"),  # past SQLite's integers
    (str(2**63), "there is no run 9223372036854775808 in"), ("0", "there is no run 0 in"),
    ("9" * 5000, r"there is no run 9{27}\.\.\. in"),  # longer than Python turns into an int
    ("-1", "'-1' is not a run id"), ("1.5", "'1.5' is not a run id"), ("1e3", "'1e3' is not a run id"),
    ("abc", "'abc' is not a run id"), ("nan", "'nan' is not a run id"), ("²", "'²' is not a run id"),
    ("", "select a run"), ("   ", "select a run"), (None, "select a run"), (float("inf"), "'inf' is not a run id"),
])
def test_every_bad_run_id_is_a_named_message(studio, bad, match):
    with pytest.raises(gr.Error, match=match) as err:
        hist.open_run(studio, bad)
    assert "click a row" in err.value.message or "select a run" in err.value.message
    assert "run" in hist._detail_ui(studio, bad)  # the detail pane shows it inline instead of raising
    assert studio.runlog.get(2**70) is None and studio.runlog.get(-1) is None  # the library call too


def test_reopen_fills_the_panel_widgets_it_knows_in_panel_order(studio, travel):
    schema, prompt, _ = travel
    cmp.compare_json(studio, schema, prompt, 3, 0.5, settings(mode="isolated", retention=0.5))
    rid = hist.rows(studio)[0][0]
    fields = ["mode", "budget_mib", "storage", "retention"]
    out = hist._open_ui(studio, fields, "compare", rid)
    assert out[:4] == (schema, prompt, 3, 0.5)
    assert out[4] == "isolated" and out[5] is not None and out[6] == "cpu" and out[7] == 0.5
    assert out[5] == gr.skip()  # the run log keeps no budget: that widget is left alone


def test_run_log_records_storage_settings_and_sources(studio, travel):
    schema, prompt, _ = travel
    chosen = settings(storage_dtype="float16", retention=0.5, method="uniform")
    data = cmp.compare_json(studio, schema, prompt, 2, settings=chosen)
    assert data["storage_dtype"] == "float16" and data["compression"] == {"retention": 0.5, "method": "uniform"}
    row = studio.runlog.runs()[0]
    assert row["storage_dtype"] == "float16" and row["retention"] == 0.5 and row["compression_method"] == "uniform"
    from engine.cache.encode import count_units

    units = count_units(studio.layout(schema))
    assert row["units_encoded"] == units and row["units_memory"] == 0 and row["units_disk"] == 0
    assert row["budget_bytes"] == studio.engine.store("cpu").budget_bytes and row["evictions"] == 0
    cell = hist.rows(studio)[0][4]
    assert "fp16" in cell and "50 % uniform" in cell
    assert "fp16" in views.summary_html(doc(data)) and "units:" in views.summary_html(doc(data))
    again = list(cmp.compare_stream(studio, schema, prompt, 2, settings=chosen))[-1].result
    assert again["encode"]["encoded"] == 0 and again["encode"]["memory"] == units
    assert studio.runlog.count() == 2


# -- runs the run log cannot take: kept in memory, shown as waiting, written later ----------------------

def schemas_in(path) -> list[str]:
    """The schema name of every run, in id order, read with plain sqlite3 (not the RunLog under test)."""
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("select schema_name from runs order by id")]
    finally:
        conn.close()


@contextmanager
def read_only(path, how: str):
    """The run log's file made read-only, then writable again.

    ``mode``: the file 0444 and its folder 0555 (root writes anyway, so that case is skipped for root);
    ``header``: the database's write-version byte set above 2, which SQLite itself takes as read-only.
    """
    if how == "mode":
        os.chmod(path, 0o444)
        os.chmod(path.parent, 0o555)
    else:
        data = bytearray(path.read_bytes())
        data[18] = 3
        path.write_bytes(bytes(data))
    try:
        yield
    finally:
        if how == "mode":
            os.chmod(path.parent, 0o755)
            os.chmod(path, 0o644)
        else:
            data = bytearray(path.read_bytes())
            data[18] = 2  # WAL, as RunLog left it
            path.write_bytes(bytes(data))


def bare_studio(path, timeout: float = 0.2) -> Studio:
    """A studio on the run log at ``path`` whose engine is never used (its runs are written as given)."""
    engine = SimpleNamespace(loaded=False, config=SimpleNamespace(model="tiny"))
    return Studio(engine, RunLog(path, timeout=timeout))


@pytest.mark.parametrize("how", [
    pytest.param("mode", marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only file")),
    "header"])
def test_runs_kept_while_the_log_is_read_only_are_written_when_it_is_writable_again(tmp_path, how):
    from tests.engine.test_runlog import fake_comparison

    path = tmp_path / "logs" / "runs.db"
    path.parent.mkdir()
    studio = bare_studio(path)
    assert studio.record(fake_comparison("first"), "s", "p")["run_id"] == 1
    with read_only(path, how):
        reports = [studio.record(fake_comparison(name), "s", "p") for name in ("a", "b")]
    assert schemas_in(path) == ["first"]  # nothing reached the file (read once it is readable again)
    assert [(r["ok"], r["run_id"], r["pending"]) for r in reports] == [(False, None, 1), (False, None, 2)]
    error = reports[-1]["error"]
    assert error.startswith(f"not logged: the run log {path} is read-only") and "writable" in error
    assert "--db another.db" in error and "kept in memory (2 waiting, at most 100)" in error
    notice = hist.notice_html(studio)
    assert "2 finished runs are not in the run log yet" in notice and "read-only" in notice
    assert "2 not logged" in studio.status_html()
    last = studio.record(fake_comparison("c"), "s", "p")
    assert last == {"ok": True, "run_id": 4, "error": None, "pending": 0, "flushed": 2, "dropped": 0}
    assert schemas_in(path) == ["first", "a", "b", "c"]
    assert [r[0] for r in hist.rows(studio)] == [4, 3, 2, 1] and hist.notice_html(studio) == ""


def test_a_full_queue_drops_the_oldest_runs_and_says_so(tmp_path, monkeypatch):
    from studio import state
    from tests.engine.test_runlog import fake_comparison

    monkeypatch.setattr(state, "PENDING_MAX", 3)
    path = tmp_path / "runs.db"
    studio = bare_studio(path)
    other = sqlite3.connect(path)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the log past the timeout
    reports = [studio.record(fake_comparison(f"r{i}"), "s", "p") for i in range(1, 6)]
    other.rollback()
    other.close()
    assert [(r["pending"], r["dropped"]) for r in reports] == [(1, 0), (2, 0), (3, 0), (3, 1), (3, 2)]
    assert "locked by another writer" in reports[-1]["error"]
    assert "2 unlogged runs dropped so far: the studio keeps the last 3" in reports[-1]["error"]
    assert "2 unlogged runs were dropped" in hist.notice_html(studio)
    last = studio.record(fake_comparison("r6"), "s", "p")
    assert last["ok"] and last["flushed"] == 3 and last["pending"] == 0 and last["dropped"] == 2
    assert schemas_in(path) == ["r3", "r4", "r5", "r6"]  # the two oldest were the ones dropped
    assert 'class="pml-chip warn"' not in views.logged_html(last) and "3 earlier runs" in views.logged_html(last)


def test_history_says_why_it_cannot_list_a_log_it_cannot_read(tmp_path):
    path = tmp_path / "runs.db"
    conn = sqlite3.connect(path)  # a newer version's log that keeps its runs in a table this one does not know
    conn.execute("create table runs_v3 (id integer primary key, schema_name text)")
    conn.execute("insert into runs_v3 (schema_name) values ('travel')")
    conn.execute("pragma user_version = 99")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    studio = bare_studio(path)
    table, _, _, _, notice = hist._refresh_ui(studio, tmp_path, "all")
    assert table == [] and f"cannot read runs: the run log {path} cannot be used (no such table: runs)" in notice
    assert "newer PML Studio" in notice and path.read_bytes() == before
