"""Studio handlers called directly (no server), on the tiny random-weight Llama — History tab: the run log's table, plot, export, reopening and the settings it records."""

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


def test_history_rows_plot_export_and_reopen(studio, travel, tmp_path):
    schema, prompt, _ = travel
    data = cmp.compare_json(studio, schema, prompt, 2, settings=settings(storage_dtype="float16"))
    rows = hist.rows(studio)
    assert len(rows) == 1 and rows[0][2] == "travel" and len(rows[0]) == len(hist.HEADERS)
    cells = dict(zip(hist.HEADERS, rows[0]))
    assert cells["Baseline TTFT"] == f"{data['baseline']['ttft_ms']:.0f} ms"
    same = "same" if data["same_text"] else f"diverges at {data['first_divergence']}"
    assert cells["Modular cache TTFT"] == f"{data['cached']['ttft_ms']:.0f} ms · {data['speedup']:.1f}× · {same}"
    detail = hist.run_detail(studio, rows[0][0])  # the logged run, drawn by the Compare tab's views
    assert detail.count('class="col-head"') == 3 and f"{data['speedup']:.1f}×" in detail
    assert hist.rows(studio, "doc_qa") == []
    plot = hist.plot_points(studio, "all")
    assert sorted(zip(plot["path"], plot["TTFT ms"])) == [(arm, data[arm]["ttft_ms"])
                                                          for arm in ("baseline", "cached", "prefix")]
    assert hist.schemas(studio) == ["all", "travel"]
    out = hist.export_csv(studio, "all", tmp_path)
    assert [r["schema_name"] for r in csv.DictReader(open(out))] == ["travel"]
    row = hist.open_run(studio, str(rows[0][0]))
    assert row["schema_text"] == schema and row["prompt_text"] == prompt
    assert hist.stored_settings(row) == {"storage": "cpu", "mode": "prefixed", "storage_dtype": "float16",
                                         "retention": 1.0, "method": "pyramid"}
    for bad, match in (("", "select a run"), (None, "select a run"), ("abc", "not a run id"), ("999", "no run 999")):
        with pytest.raises(gr.Error, match=match):
            hist.open_run(studio, bad)


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
    from engine.encode import count_units

    units = count_units(studio.layout(schema))
    assert row["units_encoded"] == units and row["units_memory"] == 0 and row["units_disk"] == 0
    assert row["budget_bytes"] == studio.engine.store("cpu").budget_bytes and row["evictions"] == 0
    cell = hist.rows(studio)[0][4]
    assert "fp16" in cell and "50 % uniform" in cell
    assert "fp16" in views.summary_html(doc(data)) and "units:" in views.summary_html(doc(data))
    again = list(cmp.compare_stream(studio, schema, prompt, 2, settings=chosen))[-1].result
    assert again["encode"]["encoded"] == 0 and again["encode"]["memory"] == units
    assert studio.runlog.count() == 2
