"""Studio handlers called directly (no server), on the tiny random-weight Llama — Prompt tab: the builder, the preview and the token view."""

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


def test_builder_composes_the_sample_prompt(travel):
    _, _, spec = travel
    values = {"trip-plan": True, "trip-plan@duration": "5 days", "trip-plan#union0": "trip-plan/overseas",
              "trip-plan/overseas#union0": "trip-plan/overseas/kyoto"}
    text = "Question: how long is the train ride from Kyoto to Nara, and what is Nara known for? Answer in one sentence."
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


def test_the_editors_read_back_that_a_pick_already_moved_past_leaves_the_pick(studio, travel):
    """A click in the builder blurs the prompt editor: its read-back carries the text from before the click. On a
    loaded machine it ran after the click's update, and its older pick won the builder (tests/studio/
    test_browser_trust.py, item 7); the text the pick was applied to is no news. Any other text is read."""
    from studio.tabs.prompt import builder_updates

    _, prompt, spec = travel
    before = b.next_state(spec, prompt, None)
    keys = list(before.values)
    union = next(k for k in keys if "#union" in k and before.values[k])
    other = next(n.key for n in spec.unions[union].children if n.key != before.values[union])
    shown = [other if k == union else before.values[k] for k in keys]
    out = builder_updates(studio, spec, keys, union, prompt, before, *shown, before.text)
    picked = out[1]
    assert picked.values[union] == other and picked.picked_over == prompt and out[0] != prompt
    assert b.next_state(spec, prompt, picked) is None  # the late read-back: the pick stays
    again = b.next_state(spec, out[0], picked)
    assert again is not None and again.values[union] == other  # the editor's text after the pick is read
    edited = prompt.replace("?", "?!", 1)
    assert b.next_state(spec, edited, picked).values[union] == before.values[union]  # a hand edit is read too
    # the new-text box's change sent with the text from before the pick (its redraw came first) keeps the pick
    late = builder_updates(studio, spec, keys, None, prompt, picked, *shown, before.text + " More.")
    assert f"<{other.split('/')[-1]}" in late[0] and "More." in late[0]


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
