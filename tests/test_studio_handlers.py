"""Studio handlers called directly (no server), on the tiny random-weight Llama."""

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
from dataclasses import replace

from engine.comparison import Comparison


def doc(data: dict) -> Comparison:
    """A comparison read back from a (partial) run --json document, as the History tab reads the run log."""
    return Comparison.from_json(data)

TRAVEL_PROMPT = """<prompt schema="travel">
  <trip-plan duration="5 days"><overseas><kyoto/></overseas></trip-plan>
  Which nearby city makes an easy day trip, and how long is the train ride?
</prompt>
"""
CPU = {"storage": "cpu", "mode": "prefixed"}


@pytest.fixture
def studio(tiny_engine, tmp_path):
    return Studio(tiny_engine, RunLog(tmp_path / "runs.db"))


@pytest.fixture
def travel(studio):
    schema, prompt = files.load_sample("travel")
    return schema, prompt, sch.validate(studio, schema).spec


def settings(**kw) -> dict:
    return {**CPU, **kw}


# -- samples and validation ---------------------------------------------------------------------

def test_samples_are_every_schema_file_and_all_validate(studio):
    names = files.sample_names()
    assert "travel" in names and not any(n.endswith(".prompt") for n in names)
    for name in names:
        schema, prompt = files.load_sample(name)
        v = sch.validate(studio, schema)
        assert v.ok, (name, v.problems)
        assert v.rows and v.spec.schema == v.name
        status, tokens = prm.preview(studio, schema, prompt)
        assert "✓" in status, (name, status)
        assert 'class="tok tok-cached"' in tokens


def test_invalid_schema_comes_back_as_line_col_messages(studio):
    text = '<schema name="s">\n  <module name="a">hi</module>\n  <module name="a">again</module>\n</schema>\n'
    v = sch.validate(studio, text)
    assert not v.ok and v.spec is None
    assert v.problems and v.problems[0].startswith("3:")
    assert 3 in v.lines
    assert "3 | <module" in v.problems[0]  # the offending line is quoted
    assert "1 problem(s)" in v.status_html()
    shown = views.highlight_html(text, v.lines)
    assert "#fde2e1" in shown and "#fde2e1" not in views.highlight_html(text)  # only the offending line is red


def test_malformed_and_empty_schema_do_not_raise(studio):
    v = sch.validate(studio, "<schema name='x'><module name='a'>")
    assert not v.ok and v.problems[0].split(":")[0].isdigit()
    assert not sch.validate(studio, "").ok
    assert not sch.validate(studio, "   ").ok


def test_upload_reads_schema_or_prompt(tmp_path):
    schema, prompt = files.load_sample("travel")
    (tmp_path / "s.xml").write_text(schema)
    (tmp_path / "p.xml").write_text(prompt)
    (tmp_path / "x.xml").write_text("<other/>")
    assert files.read_upload(str(tmp_path / "s.xml")) == ("schema", schema)
    assert files.read_upload(str(tmp_path / "p.xml")) == ("prompt", prompt)
    with pytest.raises(gr.Error, match="neither"):
        files.read_upload(str(tmp_path / "x.xml"))


# -- prompt builder -----------------------------------------------------------------------------

def test_builder_composes_the_sample_prompt(travel):
    _, _, spec = travel
    values = {"trip-plan": True, "trip-plan@duration": "5 days", "trip-plan#union0": "trip-plan/overseas",
              "trip-plan/overseas#union0": "trip-plan/overseas/kyoto"}
    text = "Which nearby city makes an easy day trip, and how long is the train ride?"
    assert b.compose_prompt(spec, values, text) == TRAVEL_PROMPT


def test_builder_spec_is_typed_nodes_in_schema_order(travel):
    _, _, spec = travel
    (top,) = spec.tree
    assert isinstance(top, b.ModuleNode) and top.key == "trip-plan" and top.union is None
    assert [(p.name, p.length, p.default) for p in top.params] == [("duration", 4, None),
                                                                    ("travelers", 6, "two adults")]
    (union,) = top.children
    assert isinstance(union, b.UnionNode) and [m.name for m in union.children] == ["domestic", "overseas"]
    inner = spec.unions["trip-plan/overseas#union0"]
    assert [m.name for m in inner.children] == ["lisbon", "kyoto", "reykjavik", "marrakesh"]
    depths = dict(x for sub in spec.walk(lambda n, d, down: [(n.key, d)] + [y for s in down() for y in s])
                  for x in sub)
    assert depths == {"trip-plan": 0, "trip-plan#union0": 1, "trip-plan/domestic": 2, "trip-plan/overseas": 2,
                      "trip-plan/overseas#union0": 3, "trip-plan/overseas/lisbon": 4, "trip-plan/overseas/kyoto": 4,
                      "trip-plan/overseas/reykjavik": 4, "trip-plan/overseas/marrakesh": 4}
    assert set(b.empty_values(spec)) == {"trip-plan", "trip-plan@duration", "trip-plan@travelers",
                                         "trip-plan#union0", "trip-plan/domestic@city", "trip-plan/overseas#union0"}


def test_picking_a_nested_module_picks_its_parents_and_unpicking_clears(travel):
    _, _, spec = travel
    values = b.normalise(spec, {"trip-plan/overseas#union0": "trip-plan/overseas/lisbon"},
                         "trip-plan/overseas#union0")
    assert values["trip-plan"] is True and values["trip-plan#union0"] == "trip-plan/overseas"
    assert b.imported_modules(spec, values) == ["trip-plan", "trip-plan/overseas", "trip-plan/overseas/lisbon"]
    values["trip-plan"] = False
    cleared = b.normalise(spec, values, "trip-plan")
    assert cleared["trip-plan#union0"] == b.NONE and cleared["trip-plan/overseas#union0"] == b.NONE
    assert b.imported_modules(spec, cleared) == []
    assert b.compose_prompt(spec, cleared, "hi") == '<prompt schema="travel">\n  hi\n</prompt>\n'


def test_switching_a_union_clears_what_was_picked_in_the_other_member(travel):
    _, _, spec = travel
    values = b.normalise(spec, {"trip-plan/overseas#union0": "trip-plan/overseas/kyoto"}, "trip-plan/overseas#union0")
    values["trip-plan#union0"] = "trip-plan/domestic"
    switched = b.normalise(spec, values, "trip-plan#union0")
    assert switched["trip-plan/overseas#union0"] == b.NONE
    assert b.imported_modules(spec, switched) == ["trip-plan", "trip-plan/domestic"]


def test_typing_an_argument_imports_its_module(travel):
    _, _, spec = travel
    values, text = b.apply_change(spec, {"trip-plan/domestic@city": "Porto"}, "", "trip-plan/domestic@city")
    assert b.imported_modules(spec, values) == ["trip-plan", "trip-plan/domestic"]
    assert '<domestic city="Porto"/>' in text
    values, _ = b.apply_change(spec, {"trip-plan/domestic@city": "  "}, "", "trip-plan/domestic@city")
    assert b.imported_modules(spec, values) == []  # blank text imports nothing


def test_hand_written_prompts_read_back_into_the_builder(studio):
    for name in files.sample_names():
        schema, prompt = files.load_sample(name)
        spec = sch.validate(studio, schema).spec
        values, text = b.selection_from_prompt(spec, prompt)
        again = b.compose_prompt(spec, values, text)
        assert b.selection_from_prompt(spec, again) == (values, text), name
        assert "✓" in prm.preview(studio, schema, again)[0], name


def test_unreadable_prompt_leaves_the_builder_alone(travel):
    _, prompt, spec = travel
    assert b.selection_from_prompt(spec, "<prompt schema='travel'><nope/></prompt>") is None
    assert b.selection_from_prompt(spec, "<prompt schema='other'/>") is None
    assert b.selection_from_prompt(spec, "<prompt") is None
    first = b.next_state(spec, prompt, None)
    assert first.nonce == 1 and first.values["trip-plan"] is True
    assert b.next_state(spec, "<prompt", first) is None  # typing: the builder keeps what it shows
    other = b.BuilderSpec("other", ())
    assert b.next_state(other, "<prompt", first) == b.BuilderState(other, {}, "", 2)  # a new schema: empty


def test_builder_state_is_hashable_as_gradio_tracks_it(studio, travel):
    from gradio.utils import deep_hash

    schema, prompt, spec = travel
    state = b.next_state(spec, prompt, None)
    same = b.BuilderState(spec, dict(reversed(list(state.values.items()))), state.text, state.nonce)
    assert deep_hash(state) == deep_hash(same)
    assert deep_hash(sch.validate(studio, schema).spec) == deep_hash(spec)  # same schema: no change event
    assert deep_hash(state) != deep_hash(b.next_state(spec, prompt, state))  # a new nonce is a change


def test_builder_escapes_text_and_arguments(travel):
    _, _, spec = travel
    values = {"trip-plan": True, "trip-plan@duration": 'a "b" & c'}
    out = b.compose_prompt(spec, values, "x < y & z")
    assert 'duration="a &quot;b&quot; &amp; c"' in out and "x &lt; y &amp; z" in out
    back, text = b.selection_from_prompt(spec, out)
    assert back["trip-plan@duration"] == 'a "b" & c' and text == "x < y & z"


def test_param_token_count(studio):
    assert prm.argument_info(studio, "5 days", 4, None) == \
        f"{len(studio.engine.codec.encode('5 days'))} / 4 tokens"
    assert "too long" in prm.argument_info(studio, "a very long argument for a tiny budget", 4, None)
    assert "default “two adults”" in prm.argument_info(studio, "", 6, "two adults")
    assert "required" in prm.argument_info(studio, "", 6, None)


def test_prompt_preview_errors_and_token_classes(studio, travel):
    schema, prompt, _ = travel
    status, tokens = prm.preview(studio, schema, prompt)
    plan = studio.engine.plan(studio.layout(schema), prompt)
    assert f"{plan.prompt_tokens} tokens, {plan.cached_tokens} cached" in status
    legend = tokens.split('<div class="tok-body">')[0]
    assert legend.count('<span class="tok tok-') == 5  # one key per class shown: cached, anon, arg, new, tmpl
    assert tokens.count('" title="') == plan.prompt_tokens  # one span per token, the legend has no titles
    for cls in ("tok-cached", "tok-anon", "tok-arg", "tok-new"):
        assert f"tok {cls}" in tokens
    status, tokens = prm.preview(studio, schema, "<prompt schema='travel'><nope/></prompt>")
    assert "unknown module" in status and tokens == ""
    status, _ = prm.preview(studio, "<schema", prompt)
    assert "Fix the schema" in status


def test_token_view_marks_extra_classes_from_the_run_document(studio, travel):
    schema, prompt, _ = travel
    plan = studio.engine.plan(studio.layout(schema), prompt)
    cached = next(s for s in plan.segments if s.kind == "cached" and s.source == "module")
    picked = set(cached.positions[:3])
    marks = views.token_marks(doc({"cached": {"recomputed_positions": sorted(picked)}}))
    assert marks == {"recomputed": picked}
    html = views.token_view_html(plan, studio.decode_token, marks)
    assert html.count('<span class="tok tok-recomputed" title=') == 3
    assert "recomputed at run time" in html
    assert views.token_marks(doc({"cached": {"text": "x"}})) == {} and views.token_marks(None) == {}


def test_token_view_marks_where_prefix_reuse_stopped(studio, travel):
    import re

    schema, prompt, _ = travel
    plan = studio.engine.plan(studio.layout(schema), prompt)
    stop = views.prefix_stop(doc({"prefix": {"reused_tokens": 5}}))
    assert stop == 5 and views.prefix_stop(doc({"cached": {"text": ""}})) is None
    body = views.token_view_html(plan, studio.decode_token, stop=stop).split('class="tok-body"')[1]
    before = body.split('class="tok-stop"')[0]
    assert len(re.findall(r'<span class="tok tok-', before)) == 5  # the mark sits after the 5 reused tokens
    assert body.count('class="tok-stop"') == 1
    assert "tok-stop" not in views.token_view_html(plan, studio.decode_token)


# -- run settings -------------------------------------------------------------------------------

def test_run_config_from_widget_values(studio):
    base = studio.engine.config
    cfg = studio.run_config(settings(storage_dtype="float16", retention=0.5, method="uniform", budget_mib=64))
    assert (cfg.storage_dtype, cfg.compression.retention, cfg.compression.method) == ("float16", 0.5, "uniform")
    assert cfg.budget_bytes == 64 * 2**20 and studio.engine.store("cpu").budget_bytes == 64 * 2**20
    assert cfg.same_model(base) and cfg.persist == base.persist  # the model and the rest are the engine's
    assert studio.run_config({}) == base  # nothing given: the engine's config
    assert studio.run_config({"mode": "isolated", "budget_mib": ""}).mode == "isolated"
    for bad, match in ((dict(retention=0), "retention"), (dict(method="zip"), "method"),
                       (dict(storage_dtype="int2"), "storage dtype"), (dict(mode="both"), "encoding mode"),
                       (dict(budget_mib="lots"), "budget"), (dict(budget_mib=-5), "budget")):
        with pytest.raises(gr.Error, match=match):
            studio.run_config(settings(**bad))


def test_settings_widgets_offer_the_engines_choices(tmp_path, tiny_engine):
    from engine.config import labelled
    from studio.app import build_app

    demo = build_app(tiny_engine, RunLog(tmp_path / "r.db"))
    by_id = {c.elem_id: c for c in demo.blocks.values() if getattr(c, "elem_id", None)}
    assert [tuple(c) for c in by_id["storage-dtype"].choices] == [tuple(c) for c in labelled("storage_dtype")]
    assert [tuple(c) for c in by_id["compression-method"].choices] == [tuple(c) for c in labelled("method")]
    radios = [c for c in demo.blocks.values() if isinstance(c, gr.Radio)]
    assert [tuple(c) for c in labelled("mode")] in [[tuple(x) for x in r.choices] for r in radios]


# -- encode and compare -------------------------------------------------------------------------

def test_encode_reports_bytes_per_module(studio, travel):
    schema, _, _ = travel
    calls = []
    view = enc.encode(studio, schema, settings(), lambda d, t, label: calls.append((d, t)))
    lay = studio.layout(schema)
    tokens = lay.entry_tokens()
    per_token = studio.engine.kv_bytes_per_token()  # from the model config alone
    assert {r[0]: r[1] for r in view.entries} == {k: v for k, v in tokens.items() if k in view.nbytes}
    assert "(anonymous)" in view.nbytes and "trip-plan/overseas/kyoto" in view.nbytes
    for name, nbytes in view.nbytes.items():
        assert nbytes == tokens[name] * per_token, name  # fp32, nothing dropped
    assert calls and calls[-1][0] == calls[-1][1]
    assert {r[3] for r in view.units} == {"fresh encode"}
    assert view.counts == {"memory": 0, "disk": 0, "encoded": len(view.units)}
    assert "before" in view.memory and "evictions" in view.memory and "pinned" in view.memory
    again = enc.encode(studio, schema, settings())
    assert "nothing was recomputed" in again.summary
    assert {r[3] for r in again.units} == {"memory"} and again.counts["memory"] == len(view.units)


def test_encode_on_gpu_without_cuda_is_a_gr_error(studio, travel):
    from engine.session import gpu_status

    if gpu_status()[0]:
        pytest.skip("a CUDA device is present")
    with pytest.raises(gr.Error, match="CUDA"):
        enc.encode(studio, travel[0], settings(storage="cuda"))


def test_compare_streams_each_arm_and_records_one_row(studio, travel):
    schema, prompt, _ = travel
    updates = list(cmp.compare_stream(studio, schema, prompt, 3, settings=settings()))
    phases = [u.phase for u in updates]
    assert phases[-1] == "done" and {"baseline", "prefix", "cached"} <= set(phases)
    assert phases.index("baseline") < phases.index("prefix") < phases.index("cached")
    assert updates[0].arms == ("baseline", "prefix", "cached")
    final = updates[-1]
    data = final.result
    assert final.texts == {arm: data[arm]["text"] for arm in ("baseline", "prefix", "cached")}
    assert row_prefix_ok(studio.runlog.get(final.run_id), data)
    last_streamed = [u for u in updates if u.phase == "cached"][-1]
    assert last_streamed.texts["cached"] == data["cached"]["text"]
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
    from engine.runner import first_divergence

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
    from engine.runner import Sampling

    schema, prompt, _ = travel
    data = cmp.compare_json(studio, schema, prompt, 4, settings=settings(storage_dtype="float16"))
    direct = studio.engine.compare(schema, prompt, Sampling(4),
                                   config=studio.engine.config.with_(storage_dtype="float16")).to_json()
    assert set(data) == set(direct)
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
                                      "warmup": {"schema": "travel", "tokens": 516}, "earlier_runs": 0}},
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
    assert [v.arm for v in views.ARM_VIEWS] == ["baseline", "prefix", "cached"]


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
    columns = [done[1 + 3 * i: 4 + 3 * i] for i in range(len(views.ARM_VIEWS))]  # (column, text, metrics) per arm
    assert [c[0].visible for c in columns] == [True, True, True]
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

    def broken(*args, on_token=None, **kw):
        on_token("baseline", "partial")
        raise RuntimeError("simulated out of memory")

    monkeypatch.setattr(studio.engine, "compare", broken)
    seen = []
    with pytest.raises(gr.Error) as err:
        for upd in cmp.compare_stream(studio, schema, prompt, 2, settings=settings()):
            seen.append(upd)
    assert "simulated out of memory" in err.value.message and "Traceback" not in err.value.message
    assert any(u.texts.get("baseline") == "partial" for u in seen)
    assert studio.runlog.count() == 0


def test_bad_sampling_settings_are_gr_errors(studio, travel):
    schema, prompt, _ = travel
    with pytest.raises(gr.Error, match="at least 1"):
        list(cmp.compare_stream(studio, schema, prompt, 0))
    with pytest.raises(gr.Error, match="temperature"):
        cmp.compare_json(studio, schema, prompt, 2, temperature=-1)
    with pytest.raises(gr.Error, match="whole number"):
        cmp.compare_json(studio, schema, prompt, "many")


# -- history and model --------------------------------------------------------------------------

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


def test_reopen_fills_the_panel_widgets_it_knows_in_panel_order(studio, travel):
    schema, prompt, _ = travel
    cmp.compare_json(studio, schema, prompt, 3, 0.5, settings(mode="isolated", retention=0.5))
    rid = hist.rows(studio)[0][0]
    fields = ["mode", "budget_mib", "storage", "retention"]
    out = hist._open_ui(studio, fields, "compare", rid)
    assert out[:4] == (schema, prompt, 3, 0.5)
    assert out[4] == "isolated" and out[5] is not None and out[6] == "cpu" and out[7] == 0.5
    assert out[5] == gr.skip()  # the run log keeps no budget: that widget is left alone


def test_model_panel_does_not_load_a_model(tmp_path):
    from engine.session import Engine

    eng = Engine()
    s = Studio(eng, RunLog(tmp_path / "r.db"))
    rows = dict(mdl.model_info(s))
    assert "not loaded" in rows["status"] and "GPU storage" in rows
    assert str(tmp_path / "r.db") in s.status_html()
    assert not eng.loaded


def test_model_panel_with_a_loaded_model(studio, tiny_lm):
    rows = dict(mdl.model_info(studio))
    assert rows["name"] == "tiny-llama" and rows["dtype"] == "float32"
    assert int(rows["KV bytes per token"].replace(",", "")) == studio.engine.kv_bytes_per_token()
    assert rows["layers · KV heads · head dim"] == "2 · 2 · 16"


def test_loading_a_missing_folder_is_a_gr_error(studio, tmp_path):
    before = studio.engine
    with pytest.raises(gr.Error, match="not a folder"):
        mdl.load_model(studio, str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(gr.Error, match="config.json"):
        mdl.load_model(studio, str(tmp_path / "empty"))
    assert studio.engine is before


def test_build_app_loads_nothing_and_exposes_compare(tmp_path):
    from engine.session import Engine
    from studio.app import build_app

    eng = Engine()
    demo = build_app(eng, RunLog(tmp_path / "r.db"))
    public = [fn.api_name for fn in demo.fns.values() if fn.api_visibility == "public"]
    assert public == ["compare"]
    assert not eng.loaded


def test_studio_functions_are_short_and_use_no_private_engine_names():
    long, private = [], []
    for path in sorted((ROOT / "studio").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    long.append(f"{path.name}:{node.name} ({n} lines)")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                private += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert long == [] and private == []


# -- module memory: storage precision, compression, budget (issue 5) -----------------------------

def _module_bytes(view) -> int:
    return sum(n for name, n in view.nbytes.items() if name != "(anonymous)")


def test_float16_storage_halves_module_bytes_and_reports_sources(studio, travel):
    schema, _, _ = travel
    full = enc.encode(studio, schema, settings(storage_dtype="float32"))
    half = enc.encode(studio, schema, settings(storage_dtype="float16"))
    assert _module_bytes(half) * 2 == _module_bytes(full) > 0
    assert half.nbytes["(anonymous)"] == full.nbytes["(anonymous)"]  # system text stays in the compute dtype
    sources = {r[0]: r[3] for r in half.units}
    assert sources["(anonymous)"] == "memory"  # shared with the fp32 encode
    assert {s for name, s in sources.items() if name != "(anonymous)"} == {"fresh encode"}
    assert half.counts["memory"] == 1 and half.counts["encoded"] == len(half.units) - 1
    assert "fp16" in half.summary


def test_retention_half_stores_at_most_52_percent(studio, travel):
    schema, _, _ = travel
    full = enc.encode(studio, schema, settings())
    for method in ("pyramid", "uniform", "recent"):
        comp = enc.encode(studio, schema, settings(retention=0.5, method=method))
        assert _module_bytes(comp) <= 0.52 * _module_bytes(full), method
        assert "50 %" in comp.summary
    with pytest.raises(gr.Error, match="retention"):
        enc.encode(studio, schema, settings(retention=0))
    with pytest.raises(gr.Error, match="method"):
        enc.encode(studio, schema, settings(retention=0.5, method="zip"))
    with pytest.raises(gr.Error, match="storage dtype"):
        enc.encode(studio, schema, settings(storage_dtype="int2"))  # int8 and int4 are valid since issue 10


def test_budget_too_small_is_a_clean_error_and_leaves_no_row(studio, travel):
    schema, prompt, _ = travel
    with pytest.raises(gr.Error, match="budget") as err:
        enc.encode(studio, schema, settings(budget_mib=0.001))
    assert "Traceback" not in err.value.message and "MiB" in err.value.message
    with pytest.raises(gr.Error, match="budget"):
        list(cmp.compare_stream(studio, schema, prompt, 2, settings=settings(budget_mib=0.001)))
    for bad in (0, -5, "lots"):
        with pytest.raises(gr.Error, match="budget"):
            enc.encode(studio, schema, settings(budget_mib=bad))
    assert studio.runlog.count() == 0
    view = enc.encode(studio, schema, settings(budget_mib=64))  # raising it makes the same run work
    assert studio.engine.store("cpu").budget_bytes == 64 * 2**20 and "64.0 MiB" in view.memory
    assert enc.memory_defaults(studio)["budget_mib"] == 64.0


def test_budget_evicts_and_the_readouts_show_it(studio, travel):
    schema, _, _ = travel
    first = enc.encode(studio, schema, settings())
    total = sum(first.nbytes.values())
    view = enc.encode(studio, schema, settings(storage_dtype="float16", budget_mib=total * 0.9 / 2**20))
    stats = studio.engine.store("cpu").stats()
    assert stats["evictions"] > 0 and stats["pinned"] >= 1
    assert '<tr class="changed"><th>evictions</th>' in view.memory


def test_persistence_is_shown(studio, tiny_lm, tmp_path):
    from engine.session import Engine

    assert "persistence off" in enc.persistence_html(studio)
    on = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"), studio.runlog)
    assert "persistence on" in enc.persistence_html(on) and str(tmp_path / "mods") in enc.persistence_html(on)


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
        {"benchmark": "scaling", "model": "SmolLM2-135M-Instruct", "dtype": "float32", "reps": 5, "machine": MACHINE,
         "results": [_point(256, 700.0, 160.0), _point(4096, 12000.0, 200.0)], "fits": fits, "gpu": None,
         "gpu_note": "no CUDA device on this machine: GPU storage cases not run"}))
    (folder / "ttft.json").write_text(json.dumps(
        {"benchmark": "ttft", "command": "python bench/ttft.py", "model": "SmolLM2-135M-Instruct", "reps": 5,
         "new_tokens": 16, "machine": MACHINE, "results": [_point(n, 10.0 * n, 150.0) for n in (512, 1024, 2048, 4096)]}))
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
    from studio import benchmarks as bm

    folder = tmp_path / "results"
    _write_results(folder)
    head, rows, fits = bm.scaling_view(folder)
    assert "2026-01-02" in head and "2 threads" in head and "`python bench/scaling.py --lengths 256 4096 --reps 5`" \
        in head
    assert "no CUDA device" in head
    assert list(rows["prompt tokens"]) == [253, 4093] and rows["speedup"].iloc[1] == "60.0×"
    assert len(fits) == 2 and "^k" in fits["fit"].iloc[1]
    head, rows = bm.ttft_view(folder)
    assert "`python bench/ttft.py`" in head and len(rows) == 4  # the command the file records
    head, fams, samples = bm.memory_view(folder)
    assert "46,080 KV bytes per token" in head and "equals predicted" in head
    assert fams["MB / token fp32"].iloc[0] == 1.0 and samples["equal"].iloc[0] == "yes"
    head, summary, depth, modules = bm.fidelity_view(folder)
    assert "`python bench/fidelity.py --modules 2 --per-setting 8 --depths 0.1 0.9 --new-tokens 20`" in head
    assert list(summary["path"]) == ["baseline", "prefixed"] and summary["95 % CI"].iloc[0] == "61 % – 85 %"
    assert summary["1st-token agreement"].iloc[1] == "90 %"
    assert list(depth.columns) == ["needle depth", "baseline", "prefixed", "n"] and len(modules) == 1
    head, rows = bm.compression_view(folder)
    assert "pyramid beats both" in head and list(rows["configuration"]) == ["baseline", "pyramid 50%"]
    assert rows["module bytes"].iloc[1] == "49 %" and rows["module bytes"].iloc[0] == "–"


def test_benchmark_commands_are_recorded_or_rebuilt_explicitly():
    from studio import benchmarks as bm

    rows = [{"target_tokens": n} for n in (256, 512)]
    assert bm.command("scaling", {"command": "python bench/scaling.py --quick", "results": rows}) == \
        "python bench/scaling.py --quick"
    assert bm.command("scaling", {"results": rows, "reps": 1, "new_tokens": 2}) == \
        "python bench/scaling.py --lengths 256 512 --reps 1 --new-tokens 2"
    assert bm.command("memory", {"model": "/m"}) == "python bench/memory.py --model /m"
    assert bm.command("memory", {}) == "python bench/memory.py"
    assert not hasattr(bm, "script_defaults")  # the scripts' source is never parsed


def test_benchmarks_tab_without_results(tmp_path):
    from studio import benchmarks as bm

    empty = tmp_path / "none"
    head, rows, fits = bm.scaling_view(empty)
    assert "not run yet: `python bench/scaling.py`" in head and rows.empty and fits.empty
    assert "not run yet: `python bench/memory.py`" in bm.memory_view(empty)[0]
    head, summary, depth, modules = bm.fidelity_view(empty)
    assert "not run yet: `python bench/fidelity.py`" in head and summary.empty and depth.empty
    assert bm.plot_path("scaling", empty) is None and "python bench/scaling.py" in bm.plot_note("scaling", empty)
    (empty / "x").mkdir(parents=True)
    (empty / "ttft.json").write_text("{not json")
    assert "cannot be read" in bm.ttft_view(empty)[0]
    (empty / "fidelity.png").write_bytes(b"png")
    assert bm.plot_path("fidelity", empty) == str(empty / "fidelity.png") and bm.plot_note("fidelity", empty) == ""


def test_scaling_at_small_sizes_runs_the_benchmark_code(tiny_engine):
    from studio import benchmarks as bm

    before = sorted((p.name, p.stat().st_mtime) for p in bm.RESULTS.glob("*")) if bm.RESULTS.exists() else []
    calls = []
    rows, note = bm.run_small_scaling(tiny_engine, [128, 96, 128], lambda d, t, label: calls.append((d, t, label)))
    assert [r["target_tokens"] for r in rows] == [96, 128]
    for r in rows:
        assert 0 < r["cached_tokens"] < r["prompt_tokens"] <= r["target_tokens"]
        assert r["speedup"] == pytest.approx(r["baseline_ttft_ms"] / r["cached_ttft_ms"], rel=0.01)
    assert calls[-1][:2] == (2, 2) and "Not saved" in note
    table, plot = bm.small_rows(rows), bm.small_plot(rows)
    assert list(table.columns) == bm.SMALL_HEADERS and len(table) == 2
    assert sorted(plot["path"]) == ["baseline", "baseline", "cached", "cached"]
    after = sorted((p.name, p.stat().st_mtime) for p in bm.RESULTS.glob("*")) if bm.RESULTS.exists() else []
    assert after == before  # bench/results is the benchmarks' job
    assert len(tiny_engine.store()) == 0  # the run used its own throw-away store


@pytest.mark.parametrize("lengths,match", [([], "at least one"), ([2048], "outside"), (["many"], "not a prompt"),
                                           ([32], "outside")])
def test_scaling_at_small_sizes_rejects_bad_lengths(tiny_engine, lengths, match):
    from studio import benchmarks as bm

    with pytest.raises(gr.Error, match=match):
        bm.run_small_scaling(tiny_engine, lengths)


# -- Import from Python (issue 6) ---------------------------------------------------------------

def test_import_program_fills_schema_and_prompt(studio):
    from tests.conftest import SAMPLES

    imp = files.import_program(str(SAMPLES / "programs" / "travel_program.py"))
    assert imp.ok and imp.roots == ("travel_planner",) and imp.program == "travel_planner"
    assert imp.schema == (SAMPLES / "programs" / "travel_program.xml").read_text()
    assert imp.prompt == (SAMPLES / "programs" / "travel_program.prompt.xml").read_text()
    assert "✓ imported" in imp.status
    assert sch.validate(studio, imp.schema).ok and "✓" in prm.preview(studio, imp.schema, imp.prompt)[0]
    again = files.import_program(str(SAMPLES / "programs" / "travel_program.py"), "travel_planner")
    assert again.schema == imp.schema  # importing twice is fine


def test_import_program_without_example_and_with_several_roots(tmp_path):
    src = ('from engine.programs import prompt_program\n\n@prompt_program\ndef first(x: bool):\n    "A."\n'
           '    if x:\n        "B."\n\n\n@prompt_program\ndef second(y: bool):\n    "C."\n    if y:\n        "D."\n')
    (tmp_path / "two.py").write_text(src)
    imp = files.import_program(str(tmp_path / "two.py"))
    assert imp.ok and imp.roots == ("first", "second") and imp.program == "first" and imp.prompt is None
    assert "no example call" in imp.status and "second" in imp.status
    other = files.import_program(str(tmp_path / "two.py"), "second")
    assert other.program == "second" and 'name="second"' in other.schema
    assert b.empty_prompt("second") == '<prompt schema="second">\n</prompt>\n'
    schema, prompt, _, status, path = sch.on_python(str(tmp_path / "two.py"))
    assert prompt == b.empty_prompt("first") and path == str(tmp_path / "two.py")


def test_import_program_problems_are_inline(tmp_path):
    (tmp_path / "loop.py").write_text('from engine.programs import prompt_program\n\n@prompt_program\n'
                                      'def f(xs):\n    for x in xs:\n        "hi"\n')
    imp = files.import_program(str(tmp_path / "loop.py"))
    assert not imp.ok and imp.schema is None and imp.roots == ()
    assert "5:5:" in imp.status and "loops" in imp.status and "for x in xs" in imp.status
    (tmp_path / "boom.py").write_text("import os\nraise RuntimeError('no')\n")
    assert "2:1:" in files.import_program(str(tmp_path / "boom.py")).status
    (tmp_path / "plain.py").write_text("x = 1\n")
    assert "no @prompt_program" in files.import_program(str(tmp_path / "plain.py")).status
    (tmp_path / "s.xml").write_text("<schema/>")
    assert "not a Python file" in files.import_program(str(tmp_path / "s.xml")).status
    assert "no file" in files.import_program(None).status


def test_restart_with_persistence_encodes_nothing(tiny_lm, travel, tmp_path):
    from engine.session import Engine

    schema, _, _ = travel
    first = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"), RunLog(tmp_path / "a.db"))
    view = enc.encode(first, schema, settings(storage_dtype="float16"))
    assert view.counts["encoded"] == len(view.units)
    restarted = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"),
                       RunLog(tmp_path / "a.db"))
    again = enc.encode(restarted, schema, settings(storage_dtype="float16"))
    assert again.counts == {"memory": 0, "disk": len(view.units), "encoded": 0}
    assert {r[3] for r in again.units} == {"disk"} and "0 unit(s) encoded afresh" in again.summary
    assert '<tr class="changed"><th>disk loads</th>' in again.memory


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


def test_model_panel_says_architecture_attention_and_whether_the_family_is_tested(studio, tiny_lm):
    rows = dict(mdl.model_info(studio))
    assert rows["architecture"].startswith("LlamaForCausalLM")
    assert rows["attention"].startswith("registered PML attention")
    assert rows["sliding window"].startswith("none")
    assert rows["family tested"].startswith("yes")


def test_packaged_picker_names_every_packaged_model_and_refuses_an_uninstalled_one(studio, monkeypatch):
    from engine import models

    keys = [key for _, key in mdl.packaged_choices()]
    assert keys == list(models.PACKAGED)
    monkeypatch.setattr(models, "packaged_models", lambda: [
        {"key": "gemma3-270m", "name": "gemma-3-270m", "installed": False, "converted": False,
         "install": "`make gemma3`", "note": "Gemma 3 270M"}])
    before = studio.engine
    with pytest.raises(gr.Error, match="make gemma3"):
        mdl.load_packaged(studio, "gemma3-270m")
    with pytest.raises(gr.Error, match="pick a packaged model"):
        mdl.load_packaged(studio, None)
    assert studio.engine is before


def test_compare_columns_show_the_kv_each_arm_held():
    from engine.runner import RunResult
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
