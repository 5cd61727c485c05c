"""Studio handlers called directly (no server), on the tiny random-weight Llama."""

from __future__ import annotations

import csv

import gradio as gr
import pytest

from engine.runlog import RunLog
from studio import handlers as h
from studio.handlers import NONE, Studio

TRAVEL_PROMPT = """<prompt schema="travel">
  <trip-plan duration="5 days"><overseas><kyoto/></overseas></trip-plan>
  Which nearby city makes an easy day trip, and how long is the train ride?
</prompt>
"""


@pytest.fixture
def studio(tiny_engine, tmp_path):
    return Studio(tiny_engine, RunLog(tmp_path / "runs.db"))


@pytest.fixture
def travel(studio):
    schema, prompt = h.load_sample("travel")
    return schema, prompt, studio.validate(schema).spec


# -- samples and validation ---------------------------------------------------------------------

def test_samples_are_every_schema_file_and_all_validate(studio):
    names = h.sample_names()
    assert "travel" in names and not any(n.endswith(".prompt") for n in names)
    for name in names:
        schema, prompt = h.load_sample(name)
        v = studio.validate(schema)
        assert v.ok, (name, v.problems)
        assert v.rows and v.spec["schema"] == v.name
        status, tokens = studio.preview(schema, prompt)
        assert "✓" in status, (name, status)
        assert 'class="tok tok-cached"' in tokens


def test_invalid_schema_comes_back_as_line_col_messages(studio):
    text = '<schema name="s">\n  <module name="a">hi</module>\n  <module name="a">again</module>\n</schema>\n'
    v = studio.validate(text)
    assert not v.ok and v.spec is None
    assert v.problems and v.problems[0].startswith("3:")
    assert 3 in v.lines
    assert "3 | <module" in v.problems[0]  # the offending line is quoted
    assert "error" in v.status_html() or "problem" in v.status_html()
    shown = h.highlight_html(text, v.lines)
    assert "#fde2e1" in shown  # the offending line is highlighted


def test_malformed_and_empty_schema_do_not_raise(studio):
    v = studio.validate("<schema name='x'><module name='a'>")
    assert not v.ok and v.problems[0].split(":")[0].isdigit()
    assert not studio.validate("").ok
    assert not studio.validate("   ").ok


def test_upload_reads_schema_or_prompt(tmp_path):
    schema, prompt = h.load_sample("travel")
    (tmp_path / "s.xml").write_text(schema)
    (tmp_path / "p.xml").write_text(prompt)
    (tmp_path / "x.xml").write_text("<other/>")
    assert h.read_upload(str(tmp_path / "s.xml")) == ("schema", schema)
    assert h.read_upload(str(tmp_path / "p.xml")) == ("prompt", prompt)
    with pytest.raises(gr.Error):
        h.read_upload(str(tmp_path / "x.xml"))


# -- prompt builder -----------------------------------------------------------------------------

def test_builder_composes_the_sample_prompt(travel):
    _, _, spec = travel
    values = {"trip-plan": True, "trip-plan@duration": "5 days", "trip-plan#union0": "trip-plan/overseas",
              "trip-plan/overseas#union0": "trip-plan/overseas/kyoto"}
    text = "Which nearby city makes an easy day trip, and how long is the train ride?"
    assert h.compose_prompt(spec, values, text) == TRAVEL_PROMPT


def test_builder_widgets_nest_params_and_unions(travel):
    _, _, spec = travel
    ws = {w["key"]: w for w in h.widgets(spec)}
    assert ws["trip-plan"]["type"] == "module" and ws["trip-plan"]["depth"] == 0
    assert ws["trip-plan@duration"]["len"] == 4
    assert ws["trip-plan@travelers"]["default"] == "two adults"
    assert [c[0] for c in ws["trip-plan/overseas#union0"]["choices"]] == ["none", "lisbon", "kyoto", "reykjavik",
                                                                          "marrakesh"]
    assert ws["trip-plan/overseas#union0"]["depth"] > ws["trip-plan#union0"]["depth"]


def test_picking_a_nested_module_picks_its_parents_and_unpicking_clears(travel):
    _, _, spec = travel
    values = h.normalise(spec, {"trip-plan/overseas#union0": "trip-plan/overseas/lisbon"},
                         "trip-plan/overseas#union0")
    assert values["trip-plan"] is True and values["trip-plan#union0"] == "trip-plan/overseas"
    assert h.imported_modules(spec, values) == ["trip-plan", "trip-plan/overseas", "trip-plan/overseas/lisbon"]
    values["trip-plan"] = False
    cleared = h.normalise(spec, values, "trip-plan")
    assert cleared["trip-plan#union0"] == NONE and cleared["trip-plan/overseas#union0"] == NONE
    assert h.compose_prompt(spec, cleared, "hi") == '<prompt schema="travel">\n  hi\n</prompt>\n'


def test_hand_written_prompts_read_back_into_the_builder(studio):
    for name in h.sample_names():
        schema, prompt = h.load_sample(name)
        spec = studio.validate(schema).spec
        values, text = h.selection_from_prompt(spec, prompt)
        again = h.compose_prompt(spec, values, text)
        assert h.selection_from_prompt(spec, again) == (values, text), name
        assert "✓" in studio.preview(schema, again)[0], name


def test_unreadable_prompt_leaves_the_builder_alone(travel):
    _, _, spec = travel
    assert h.selection_from_prompt(spec, "<prompt schema='travel'><nope/></prompt>") is None
    assert h.selection_from_prompt(spec, "<prompt schema='other'/>") is None
    assert h.selection_from_prompt(spec, "<prompt") is None


def test_builder_escapes_text_and_arguments(travel):
    _, _, spec = travel
    values = {"trip-plan": True, "trip-plan@duration": 'a "b" & c'}
    out = h.compose_prompt(spec, values, "x < y & z")
    assert 'duration="a &quot;b&quot; &amp; c"' in out and "x &lt; y &amp; z" in out
    back, text = h.selection_from_prompt(spec, out)
    assert back["trip-plan@duration"] == 'a "b" & c' and text == "x < y & z"


def test_param_token_count(studio):
    assert studio.param_info("5 days", 4, None).startswith("2 / 4 tokens")
    assert "too long" in studio.param_info("a very long argument for a tiny budget", 4, None)
    assert "default" in studio.param_info("", 6, "two adults")
    assert "required" in studio.param_info("", 6, None)


def test_prompt_preview_errors_and_token_classes(studio, travel):
    schema, prompt, _ = travel
    status, tokens = studio.preview(schema, prompt)
    assert "✓ prompt is valid" in status and "cached" in status
    for cls in ("tok-cached", "tok-anon", "tok-arg", "tok-new"):
        assert f"tok {cls}" in tokens
    status, tokens = studio.preview(schema, "<prompt schema='travel'><nope/></prompt>")
    assert "unknown module" in status and tokens == ""
    status, _ = studio.preview("<schema", prompt)
    assert "Fix the schema" in status


# -- encode and compare -------------------------------------------------------------------------

def test_encode_reports_bytes_per_module(studio, travel):
    schema, _, _ = travel
    calls = []
    summary, rows = studio.encode(schema, "cpu", "prefixed", lambda d, t, label: calls.append((d, t)))
    assert "MB" in summary and "per token" in summary
    names = [r[0] for r in rows]
    assert "(anonymous)" in names and "trip-plan/overseas/kyoto" in names
    assert all(r[2] > 0 for r in rows)
    assert calls and calls[-1][0] == calls[-1][1]
    summary, _ = studio.encode(schema, "cpu", "prefixed")
    assert "nothing was recomputed" in summary


def test_encode_on_gpu_without_cuda_is_a_gr_error(studio, travel):
    from engine.session import gpu_status

    if gpu_status()[0]:
        pytest.skip("a CUDA device is present")
    with pytest.raises(gr.Error, match="CUDA"):
        studio.encode(travel[0], "cuda", "prefixed")


def test_compare_streams_both_columns_and_records_one_row(studio, travel):
    schema, prompt, _ = travel
    updates = list(studio.compare_stream(schema, prompt, "cpu", "prefixed", 3))
    phases = [u.phase for u in updates]
    assert phases[-1] == "done" and "baseline" in phases and "cached" in phases
    assert phases.index("baseline") < phases.index("cached")
    final = updates[-1]
    data = final.result
    assert data["schema"] == "travel" and data["baseline"]["new_tokens"] <= 3
    row = studio.runlog.get(final.run_id)
    assert row["schema_name"] == "travel" and row["schema_text"] == schema and row["prompt_text"] == prompt
    assert row["baseline_ttft_ms"] == data["baseline"]["ttft_ms"] and row["cached_ttft_ms"] == data["cached"]["ttft_ms"]
    assert studio.runlog.count() == 1
    assert "×" in h.summary_html(data)
    b_mark, c_mark = studio.divergence_offsets(final.comparison)
    assert (b_mark is None) == data["same_text"]


def test_compare_json_is_the_cli_document(studio, travel):
    schema, prompt, _ = travel
    data = studio.compare_json(schema, prompt, max_new_tokens=2)
    for key in ("model", "storage", "mode", "schema", "prompt_tokens", "cached_tokens", "uncached_tokens",
                "store_bytes", "baseline", "cached", "speedup", "same_text", "first_divergence",
                "first_token_agree", "first_token_kl"):
        assert key in data
    assert studio.runlog.count() == 1


@pytest.mark.parametrize("schema_text,prompt_text,match", [
    (None, "<prompt schema='travel'><nope/></prompt>", "unknown module"),
    ("<schema name='x'>", None, "malformed"),
])
def test_failing_run_is_a_gr_error_and_leaves_no_row(studio, travel, schema_text, prompt_text, match):
    schema, prompt, _ = travel
    args = (schema_text or schema, prompt_text or prompt)
    with pytest.raises(gr.Error, match=match):
        list(studio.compare_stream(*args, "cpu", "prefixed", 2))
    with pytest.raises(gr.Error, match=match):
        studio.compare_json(*args, max_new_tokens=2)
    assert studio.runlog.count() == 0


def test_crash_mid_run_is_a_gr_error_without_traceback_and_no_row(studio, travel, monkeypatch):
    schema, prompt, _ = travel

    def broken(*args, on_token=None, **kw):
        on_token("baseline", "partial")
        raise RuntimeError("simulated out of memory")

    monkeypatch.setattr(studio.engine, "compare", broken)
    seen = []
    with pytest.raises(gr.Error) as err:
        for upd in studio.compare_stream(schema, prompt, "cpu", "prefixed", 2):
            seen.append(upd)
    assert "simulated out of memory" in err.value.message and "Traceback" not in err.value.message
    assert any(u.baseline_text == "partial" for u in seen)
    assert studio.runlog.count() == 0


def test_bad_sampling_settings_are_gr_errors(studio, travel):
    schema, prompt, _ = travel
    with pytest.raises(gr.Error, match="at least 1"):
        list(studio.compare_stream(schema, prompt, "cpu", "prefixed", 0))
    with pytest.raises(gr.Error, match="temperature"):
        studio.compare_json(schema, prompt, 2, temperature=-1)


# -- history and model --------------------------------------------------------------------------

def test_history_rows_plot_export_and_reopen(studio, travel, tmp_path):
    schema, prompt, _ = travel
    studio.compare_json(schema, prompt, max_new_tokens=2)
    rows = studio.history()
    assert len(rows) == 1 and rows[0][2] == "travel" and len(rows[0]) == len(h.HISTORY_HEADERS)
    assert studio.history("doc_qa") == []
    plot = studio.history_plot("all")
    assert sorted(plot["path"]) == ["baseline", "cached"]
    assert studio.history_schemas() == ["all", "travel"]
    out = studio.export_csv("all", tmp_path)
    assert [r["schema_name"] for r in csv.DictReader(open(out))] == ["travel"]
    row = studio.open_run(str(rows[0][0]))
    assert row["schema_text"] == schema and row["prompt_text"] == prompt
    for bad in ("", None, "abc", "999"):
        with pytest.raises(gr.Error):
            studio.open_run(bad)


def test_model_panel_does_not_load_a_model(tmp_path):
    from engine.session import Engine

    eng = Engine()
    s = Studio(eng, RunLog(tmp_path / "r.db"))
    rows = dict(s.model_info())
    assert "not loaded" in rows["status"] and "GPU storage" in rows
    assert str(tmp_path / "r.db") in s.status_html()
    assert not eng.loaded


def test_model_panel_with_a_loaded_model(studio):
    rows = dict(studio.model_info())
    assert rows["name"] == "tiny-llama" and rows["dtype"] == "float32"
    assert int(rows["KV bytes per token"].replace(",", "")) > 0


def test_loading_a_missing_folder_is_a_gr_error(studio, tmp_path):
    before = studio.engine
    with pytest.raises(gr.Error, match="not a folder"):
        studio.load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(gr.Error, match="config.json"):
        studio.load_model(str(tmp_path / "empty"))
    assert studio.engine is before


def test_build_app_loads_nothing_and_exposes_compare(tmp_path):
    from engine.session import Engine
    from studio.app import build_app

    eng = Engine()
    demo = build_app(eng, RunLog(tmp_path / "r.db"))
    public = [fn.api_name for fn in demo.fns.values() if fn.api_visibility == "public"]
    assert public == ["compare"]
    assert not eng.loaded
