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
    view = studio.encode(schema, "cpu", "prefixed", lambda d, t, label: calls.append((d, t)))
    assert "MB" in view.summary and "per token" in view.summary
    names = [r[0] for r in view.entries]
    assert "(anonymous)" in names and "trip-plan/overseas/kyoto" in names
    assert all(r[2] > 0 for r in view.entries)
    assert calls and calls[-1][0] == calls[-1][1]
    assert view.units and {r[3] for r in view.units} == {"fresh encode"}
    assert all(len(r) == len(h.UNIT_HEADERS) and r[2] > 0 and r[4] >= 0 for r in view.units)
    assert view.counts == {"memory": 0, "disk": 0, "encoded": len(view.units)}
    assert "before" in view.memory and "evictions" in view.memory and "pinned" in view.memory
    again = studio.encode(schema, "cpu", "prefixed")
    assert "nothing was recomputed" in again.summary
    assert {r[3] for r in again.units} == {"memory"} and again.counts["memory"] == len(view.units)


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


# -- module memory: storage precision, compression, budget (issue 5) -----------------------------

def _module_bytes(view) -> int:
    return sum(b for name, b in view.nbytes.items() if name != "(anonymous)")


def test_float16_storage_halves_module_bytes_and_reports_sources(studio, travel):
    schema, _, _ = travel
    full = studio.encode(schema, "cpu", "prefixed", storage_dtype="float32")
    half = studio.encode(schema, "cpu", "prefixed", storage_dtype="float16")
    assert _module_bytes(half) * 2 == _module_bytes(full) > 0
    assert half.nbytes["(anonymous)"] == full.nbytes["(anonymous)"]  # system text stays in the compute dtype
    sources = {r[0]: r[3] for r in half.units}
    assert sources["(anonymous)"] == "memory"  # shared with the fp32 encode
    assert {s for name, s in sources.items() if name != "(anonymous)"} == {"fresh encode"}
    assert half.counts["memory"] == 1 and half.counts["encoded"] == len(half.units) - 1
    assert "fp16" in half.summary


def test_retention_half_stores_at_most_52_percent(studio, travel):
    schema, _, _ = travel
    full = studio.encode(schema, "cpu", "prefixed")
    for method in ("pyramid", "uniform", "recent"):
        comp = studio.encode(schema, "cpu", "prefixed", retention=0.5, method=method)
        assert _module_bytes(comp) <= 0.52 * _module_bytes(full), method
        assert "50 %" in comp.summary
    with pytest.raises(gr.Error, match="retention"):
        studio.encode(schema, "cpu", "prefixed", retention=0)
    with pytest.raises(gr.Error, match="method"):
        studio.encode(schema, "cpu", "prefixed", retention=0.5, method="zip")
    with pytest.raises(gr.Error, match="storage dtype"):
        studio.encode(schema, "cpu", "prefixed", storage_dtype="int2")  # int8 and int4 are valid since issue 10


def test_budget_too_small_is_a_clean_error_and_leaves_no_row(studio, travel):
    schema, prompt, _ = travel
    with pytest.raises(gr.Error, match="budget") as err:
        studio.encode(schema, "cpu", "prefixed", budget_mib=0.001)
    assert "Traceback" not in err.value.message and "MiB" in err.value.message
    with pytest.raises(gr.Error, match="budget"):
        list(studio.compare_stream(schema, prompt, "cpu", "prefixed", 2, budget_mib=0.001))
    for bad in (0, -5, "lots"):
        with pytest.raises(gr.Error, match="budget"):
            studio.encode(schema, "cpu", "prefixed", budget_mib=bad)
    assert studio.runlog.count() == 0
    view = studio.encode(schema, "cpu", "prefixed", budget_mib=64)  # raising it makes the same run work
    assert studio.engine.store("cpu").budget_bytes == 64 * 2**20 and "64.0 MiB" in view.memory
    assert studio.memory_defaults()["budget_mib"] == 64.0


def test_budget_evicts_and_the_readouts_show_it(studio, travel):
    schema, _, _ = travel
    first = studio.encode(schema, "cpu", "prefixed")
    total = sum(first.nbytes.values())
    view = studio.encode(schema, "cpu", "prefixed", storage_dtype="float16", budget_mib=total * 0.9 / 2**20)
    stats = studio.engine.store("cpu").stats()
    assert stats["evictions"] > 0 and stats["pinned"] >= 1
    assert '<tr class="changed"><th>evictions</th>' in view.memory


def test_persistence_is_shown(studio, tiny_lm, tmp_path):
    from engine.session import Engine

    assert "persistence off" in studio.persistence_html()
    on = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"), studio.runlog)
    assert "persistence on" in on.persistence_html() and str(tmp_path / "mods") in on.persistence_html()


def test_run_log_records_storage_settings_and_sources(studio, travel):
    schema, prompt, _ = travel
    data = studio.compare_json(schema, prompt, 2, storage_dtype="float16", retention=0.5, method="uniform")
    assert data["storage_dtype"] == "float16" and data["compression"] == {"retention": 0.5, "method": "uniform"}
    row = studio.runlog.runs()[0]
    assert row["storage_dtype"] == "float16" and row["retention"] == 0.5 and row["compression_method"] == "uniform"
    assert row["units_encoded"] > 0 and row["units_memory"] + row["units_disk"] + row["units_encoded"] == \
        data["encode"]["units"]
    assert row["budget_bytes"] == data["store_stats"]["budget_bytes"] and row["evictions"] == 0
    cell = studio.history()[0][4]
    assert "fp16" in cell and "50 % uniform" in cell
    assert "fp16" in h.summary_html(data) and "units:" in h.summary_html(data)
    updates = list(studio.compare_stream(schema, prompt, "cpu", "prefixed", 2, storage_dtype="float16",
                                         retention=0.5, method="uniform"))
    again = updates[-1].result
    assert again["encode"]["encoded"] == 0 and again["encode"]["memory"] == again["encode"]["units"]
    assert studio.runlog.count() == 2


# -- Benchmarks tab (issue 4) -------------------------------------------------------------------

MACHINE = {"date": "2026-01-02", "python": "3.11.7", "torch": "2.13.0+cpu", "threads": 2, "cpu": "x86_64",
           "cuda": False}


def _point(n: int, base: float, cached: float) -> dict:
    return {"target_tokens": n, "prompt_tokens": n - 3, "cached_tokens": n - 35, "uncached_tokens": 32,
            "modules": 2, "store_bytes": 1, "baseline_ttft_ms": base, "cached_ttft_ms": cached,
            "cached_copy_ms": 1.0, "cached_prefill_ms": cached - 2, "cached_sample_ms": 1.0,
            "speedup": round(base / cached, 2), "baseline_decode_ms_per_token": 50.0,
            "cached_decode_ms_per_token": 49.0, "same_text": True}


def _write_results(folder):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    fits = {"cached_ttft_vs_cached_tokens_linear": {"slope_ms_per_token": 0.01, "intercept_ms": 150.0, "r2": 0.98},
            "baseline_ttft_power": {"exponent": 1.21, "r2": 0.99}}
    (folder / "scaling.json").write_text(json.dumps(
        {"benchmark": "scaling", "model": "SmolLM2-135M-Instruct", "dtype": "float32", "reps": 3, "machine": MACHINE,
         "results": [_point(256, 700.0, 160.0), _point(4096, 12000.0, 200.0)], "fits": fits, "gpu": None,
         "gpu_note": "no CUDA device on this machine: GPU storage cases not run"}))
    (folder / "ttft.json").write_text(json.dumps(
        {"benchmark": "ttft", "model": "SmolLM2-135M-Instruct", "reps": 3, "new_tokens": 16, "machine": MACHINE,
         "results": [_point(n, 10.0 * n, 150.0) for n in (512, 1024, 2048, 4096)]}))
    (folder / "memory.json").write_text(json.dumps(
        {"benchmark": "memory", "machine": MACHINE,
         "loaded": {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "kv_bytes_per_token": 46080},
         "families": [{"model": "Llama-2-7B", "layers": 32, "kv_heads": 32, "head_dim": 128,
                       "fp16_bytes_per_token": 524288, "fp16_mb_per_token": 0.5, "fp32_bytes_per_token": 1048576,
                       "fp16_gib_per_4k_tokens": 2.0}],
         "samples": [{"schema": "travel", "stored_tokens": 10, "predicted_bytes": 460800, "measured_bytes": 460800,
                      "match": True, "entries": 3}], "all_match": True}))
    summary = {"baseline": {"accuracy": 0.75, "found": 36, "n": 48, "ci95": [0.61, 0.85]},
               "prefixed": {"accuracy": 0.7, "found": 34, "n": 48, "ci95": [0.57, 0.81],
                            "first_token_agreement": 0.9, "mean_first_token_kl": 0.01, "same_text_rate": 0.5,
                            "median_first_divergence": 4, "mean_rouge_l": 0.8}}
    by = {"baseline": 0.75, "prefixed": 0.7, "n": 16}
    (folder / "compression.json").write_text(json.dumps(
        {"benchmark": "compression", "model": "SmolLM2-135M-Instruct", "prompts": 16, "modules_per_prompt": 4,
         "new_tokens": 28, "machine": MACHINE,
         "summary": {"baseline": {"accuracy": 0.5, "found": 8, "n": 16, "ci95": [0.28, 0.72]},
                     "pyramid 50%": {"accuracy": 0.5, "found": 8, "n": 16, "ci95": [0.28, 0.72], "bytes_ratio": 0.49,
                                     "ttft_ms": 120.0, "agree_ref": 0.9, "kl_ref": 0.02, "agree_base": 0.8,
                                     "kl_base": 0.03}},
         "verdicts": ["retention 50%: pyramid 50%, uniform 40%, recent 30% -> pyramid beats both controls"]}))
    (folder / "fidelity.json").write_text(json.dumps(
        {"benchmark": "fidelity", "model": "SmolLM2-135M-Instruct", "new_tokens": 20, "prompts": 8,
         "machine": MACHINE, "summary": summary, "by_depth": {"0.1": by, "0.9": by}, "by_modules": {"2": by}}))


def test_benchmarks_tab_reads_results_folder(tmp_path):
    from studio import benchmarks as b

    folder = tmp_path / "results"
    _write_results(folder)
    head, rows, fits = b.scaling_view(folder)
    assert "2026-01-02" in head and "2 threads" in head and "`python bench/scaling.py --lengths 256 4096`" in head
    assert "no CUDA device" in head
    assert list(rows["prompt tokens"]) == [253, 4093] and rows["speedup"].iloc[1] == "60.0×"
    assert len(fits) == 2 and "^k" in fits["fit"].iloc[1]
    head, rows = b.ttft_view(folder)
    assert "`python bench/ttft.py`" in head and len(rows) == 4  # defaults: no flags
    head, fams, samples = b.memory_view(folder)
    assert "46,080 KV bytes per token" in head and "equals predicted" in head
    assert fams["MB / token fp32"].iloc[0] == 1.0 and samples["equal"].iloc[0] == "yes"
    head, summary, depth, modules = b.fidelity_view(folder)
    assert "`python bench/fidelity.py --modules 2 --per-setting 8 --depths 0.1 0.9" in head
    assert list(summary["path"]) == ["baseline", "prefixed"] and summary["95 % CI"].iloc[0] == "61 % – 85 %"
    assert summary["1st-token agreement"].iloc[1] == "90 %"
    assert list(depth.columns) == ["needle depth", "baseline", "prefixed", "n"] and len(modules) == 1
    head, rows = b.compression_view(folder)
    assert "pyramid beats both" in head and list(rows["configuration"]) == ["baseline", "pyramid 50%"]
    assert rows["module bytes"].iloc[1] == "49 %" and rows["module bytes"].iloc[0] == "–"


def test_benchmark_commands_follow_the_scripts_defaults():
    from studio import benchmarks as b

    defaults = b.script_defaults("scaling")
    assert defaults["reps"] >= 1 and 4096 in defaults["lengths"]
    rows = [{"target_tokens": n} for n in defaults["lengths"]]
    assert b.command("scaling", {"results": rows, "reps": defaults["reps"]}) == "python bench/scaling.py"
    assert b.command("scaling", {"results": rows[:2], "reps": 1}) == \
        f"python bench/scaling.py --lengths {rows[0]['target_tokens']} {rows[1]['target_tokens']} --reps 1"
    assert b.command("memory", {"command": "python bench/memory.py --model /m"}) == "python bench/memory.py --model /m"
    assert b.command("memory", {}) == "python bench/memory.py"


def test_benchmarks_tab_without_results(tmp_path):
    from studio import benchmarks as b

    empty = tmp_path / "none"
    head, rows, fits = b.scaling_view(empty)
    assert "not run yet: `python bench/scaling.py`" in head and rows.empty and fits.empty
    assert "not run yet: `python bench/memory.py`" in b.memory_view(empty)[0]
    head, summary, depth, modules = b.fidelity_view(empty)
    assert "not run yet: `python bench/fidelity.py`" in head and summary.empty and depth.empty
    assert b.plot_path("scaling", empty) is None and "python bench/scaling.py" in b.plot_note("scaling", empty)
    (empty / "x").mkdir(parents=True)
    (empty / "ttft.json").write_text("{not json")
    assert "cannot be read" in b.ttft_view(empty)[0]
    (empty / "fidelity.png").write_bytes(b"png")
    assert b.plot_path("fidelity", empty) == str(empty / "fidelity.png") and b.plot_note("fidelity", empty) == ""


def test_scaling_at_small_sizes_runs_the_benchmark_code(tiny_engine):
    from studio import benchmarks as b

    before = sorted((p.name, p.stat().st_mtime) for p in b.RESULTS.glob("*")) if b.RESULTS.exists() else []
    calls = []
    rows, note = b.run_small_scaling(tiny_engine, [128, 96, 128], lambda d, t, label: calls.append((d, t, label)))
    assert [r["target_tokens"] for r in rows] == [96, 128]
    for r in rows:
        assert 0 < r["cached_tokens"] < r["prompt_tokens"] <= r["target_tokens"]
        assert r["baseline_ttft_ms"] > 0 and r["cached_ttft_ms"] > 0
    assert calls[-1][:2] == (2, 2) and "Not saved" in note
    table, plot = b.small_rows(rows), b.small_plot(rows)
    assert list(table.columns) == b.SMALL_HEADERS and len(table) == 2
    assert sorted(plot["path"]) == ["baseline", "baseline", "cached", "cached"]
    after = sorted((p.name, p.stat().st_mtime) for p in b.RESULTS.glob("*")) if b.RESULTS.exists() else []
    assert after == before  # bench/results is the benchmarks' job
    assert len(tiny_engine.store()) == 0  # the run used its own throw-away store


@pytest.mark.parametrize("lengths,match", [([], "at least one"), ([2048], "outside"), (["many"], "not a prompt"),
                                           ([32], "outside")])
def test_scaling_at_small_sizes_rejects_bad_lengths(tiny_engine, lengths, match):
    from studio import benchmarks as b

    with pytest.raises(gr.Error, match=match):
        b.run_small_scaling(tiny_engine, lengths)


# -- Import from Python (issue 6) ---------------------------------------------------------------

def test_import_program_fills_schema_and_prompt(studio):
    from tests.conftest import SAMPLES

    imp = h.import_program(str(SAMPLES / "programs" / "travel_program.py"))
    assert imp.ok and imp.roots == ("travel_planner",) and imp.program == "travel_planner"
    assert imp.schema == (SAMPLES / "programs" / "travel_program.xml").read_text()
    assert imp.prompt == (SAMPLES / "programs" / "travel_program.prompt.xml").read_text()
    assert "✓ imported" in imp.status
    assert studio.validate(imp.schema).ok and "✓" in studio.preview(imp.schema, imp.prompt)[0]
    again = h.import_program(str(SAMPLES / "programs" / "travel_program.py"), "travel_planner")
    assert again.schema == imp.schema  # importing twice is fine


def test_import_program_without_example_and_with_several_roots(tmp_path):
    src = ('from engine.programs import prompt_program\n\n@prompt_program\ndef first(x: bool):\n    "A."\n'
           '    if x:\n        "B."\n\n\n@prompt_program\ndef second(y: bool):\n    "C."\n    if y:\n        "D."\n')
    (tmp_path / "two.py").write_text(src)
    imp = h.import_program(str(tmp_path / "two.py"))
    assert imp.ok and imp.roots == ("first", "second") and imp.program == "first" and imp.prompt is None
    assert "no example call" in imp.status and "second" in imp.status
    other = h.import_program(str(tmp_path / "two.py"), "second")
    assert other.program == "second" and 'name="second"' in other.schema
    assert h.empty_prompt("second") == '<prompt schema="second">\n</prompt>\n'


def test_import_program_problems_are_inline(tmp_path):
    (tmp_path / "loop.py").write_text('from engine.programs import prompt_program\n\n@prompt_program\n'
                                      'def f(xs):\n    for x in xs:\n        "hi"\n')
    imp = h.import_program(str(tmp_path / "loop.py"))
    assert not imp.ok and imp.schema is None and imp.roots == ()
    assert "5:5:" in imp.status and "loops" in imp.status and "for x in xs" in imp.status
    (tmp_path / "boom.py").write_text("import os\nraise RuntimeError('no')\n")
    assert "2:1:" in h.import_program(str(tmp_path / "boom.py")).status
    (tmp_path / "plain.py").write_text("x = 1\n")
    assert "no @prompt_program" in h.import_program(str(tmp_path / "plain.py")).status
    (tmp_path / "s.xml").write_text("<schema/>")
    assert "not a Python file" in h.import_program(str(tmp_path / "s.xml")).status
    assert "no file" in h.import_program(None).status


def test_restart_with_persistence_encodes_nothing(tiny_lm, travel, tmp_path):
    from engine.session import Engine

    schema, _, _ = travel
    first = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"), RunLog(tmp_path / "a.db"))
    view = first.encode(schema, "cpu", "prefixed", storage_dtype="float16")
    assert view.counts["encoded"] == len(view.units)
    restarted = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"),
                       RunLog(tmp_path / "a.db"))
    again = restarted.encode(schema, "cpu", "prefixed", storage_dtype="float16")
    assert again.counts == {"memory": 0, "disk": len(view.units), "encoded": 0}
    assert {r[3] for r in again.units} == {"disk"} and "0 unit(s) encoded afresh" in again.summary
    assert '<tr class="changed"><th>disk loads</th>' in again.memory
