"""The Compare tab's Stop button and the caps on max new tokens; rough edges of the Schema and Model tabs and the
header; no traceback on the console for a user's error through ``/compare`` (issue 37, items 8 and 9)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import gradio as gr
import pytest

from engine.runlog import RunLog
from engine.session import Engine
from studio import live
from studio import state as st
from studio.app import build_app
from studio.tabs import compare as cmp
from studio.tabs import model as mdl
from studio.tabs import schema as sch
from tests import studio_fixtures as fixtures
from tests.studio_fixtures import served_studio, settings, studio, travel  # noqa: F401 (fixtures)

AUTH = getattr(fixtures, "AUTH", {})  # the launch token's header, where the studio has one


# -- Stop ---------------------------------------------------------------------------------------

def test_stop_ends_the_sessions_compare_within_a_token_and_the_next_compare_is_whole(studio, travel, monkeypatch):
    schema, prompt, _ = travel
    whole = cmp.compare_json(studio, schema, prompt, 12, settings=settings())
    shown = []
    show = live.LiveRun.show

    def pressed_at_the_fourth_token(self, arm, text, message):  # the Stop button, while the 4th token shows
        show(self, arm, text, message)
        shown.append(arm)
        if len(shown) == 4:
            assert cmp.stop_ui(SimpleNamespace(session_hash="page-1"))[0] != gr.skip()

    monkeypatch.setattr(live.LiveRun, "show", pressed_at_the_fourth_token)
    updates = list(cmp.compare_stream(studio, schema, prompt, 12, settings=settings(), owner="page-1"))
    last = updates[-1]
    assert last.phase == "stopped" and last.message == cmp.STOPPED and last.result is None
    assert len(shown) < 4 + 3  # the arms decode as one batch: the step under way ends, nothing after it
    assert all(whole[arm]["text"].startswith(text) for arm, text in last.texts.items())
    assert studio.runlog.count() == 1  # the whole run only: the stopped one is not logged
    monkeypatch.setattr(live.LiveRun, "show", show)
    again = list(cmp.compare_stream(studio, schema, prompt, 12, settings=settings(), owner="page-1"))[-1]
    assert again.phase == "done" and studio.runlog.count() == 2
    assert {arm: again.result[arm]["text"] for arm in again.arms} == {arm: whole[arm]["text"]
                                                                          for arm in again.arms}


def test_stop_asks_only_its_own_sessions_unfinished_runs():
    mine, other, done = live.RUNS.open(("cached",), "a"), live.RUNS.open(("cached",), "b"), live.RUNS.open((), "a")
    done.finish()
    api = live.RUNS.open(("cached",))  # the API's runs have no session: no page can stop them
    assert "Stopped" in cmp.stop_ui(SimpleNamespace(session_hash="a"))[0]
    assert mine.stop.is_set() and not other.stop.is_set() and not done.stop.is_set() and not api.stop.is_set()
    assert cmp.stop_ui(SimpleNamespace(session_hash=""))[0] == gr.skip() and not api.stop.is_set()


def test_the_stop_button_stops_outside_the_queue_and_cancels_the_compare_event(tiny_engine, tmp_path):
    demo = build_app(tiny_engine, RunLog(tmp_path / "runs.db"))
    fns = list(demo.fns.values())
    compare = next(f for f in fns if getattr(f.fn, "__name__", "") == "stream")
    stop = next(f for f in fns if f.fn is cmp.stop_ui)
    button = demo.blocks[stop.targets[0][0]]
    assert isinstance(button, gr.Button) and button.value == "Stop" and stop.queue is False
    cancel = next(f for f in fns if f.targets == stop.targets and f.cancels)
    assert compare._id in cancel.cancels


# -- caps on max new tokens ---------------------------------------------------------------------

def test_max_new_tokens_above_the_studio_cap_is_refused_by_name(studio, travel):
    schema, prompt, _ = travel
    assert studio.max_new_tokens_cap == st.MAX_NEW_TOKENS_CAP == 2048
    for call in (lambda: cmp.compare_json(studio, schema, prompt, 30000),
                 lambda: list(cmp.compare_stream(studio, schema, prompt, 30000, settings=settings()))):
        with pytest.raises(gr.Error, match="max new tokens is 30000, above this studio's cap of 2048.*"
                                           "--max-new-tokens-cap"):
            call()
    assert studio.runlog.count() == 0


def test_max_new_tokens_past_the_context_says_the_most_this_prompt_allows(tiny_engine, tmp_path, travel):
    schema, prompt, _ = travel
    roomy = st.Studio(tiny_engine, RunLog(tmp_path / "roomy.db"), max_new_tokens_cap=10**6)
    with pytest.raises(gr.Error) as err:
        cmp.compare_json(roomy, schema, prompt, 5000)
    most = int(re.search(r"at most (\d+) new tokens fit after this prompt", err.value.message).group(1))
    plan = tiny_engine.plan(tiny_engine.layout(schema), prompt)
    assert most == tiny_engine.codec.max_positions - max(plan.max_position + 1, plan.prompt_tokens)
    tiny_engine.plan(tiny_engine.layout(schema), prompt, max_new_tokens=most)  # fits
    assert roomy.runlog.count() == 0


def test_the_cap_is_a_serve_option_and_an_environment_variable(tiny_engine, tmp_path, monkeypatch):
    from engine.cli import build_parser
    from studio import cli, launch

    parse = lambda *argv: build_parser(cli.EXTRA, arm_options=False).parse_args(["serve", *argv])  # noqa: E731
    assert parse().max_new_tokens_cap is None and parse("--max-new-tokens-cap", "64").max_new_tokens_cap == 64
    with pytest.raises(SystemExit):
        parse("--max-new-tokens-cap", "0")
    monkeypatch.setenv("PML_STUDIO_MAX_NEW_TOKENS_CAP", "96")
    assert parse().max_new_tokens_cap == 96
    given = {}
    monkeypatch.setattr(launch, "serve", lambda options: given.update(vars(options)) or 0)
    assert cli.serve(parse("--max-new-tokens-cap", "64")) == 0 and given["max_new_tokens_cap"] == 64
    demo = build_app(tiny_engine, RunLog(tmp_path / "runs.db"), max_new_tokens_cap=16)
    assert demo.studio.max_new_tokens_cap == 16
    slider = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "max-new-tokens")
    assert slider.maximum == 16


# -- rough edges --------------------------------------------------------------------------------

def test_a_schema_name_longer_than_a_file_name_validates_and_downloads(studio, tmp_path):
    name = "n" * 300
    schema = f'<schema name="{name}"><system>You plan trips.</system><module name="m">Kyoto.</module></schema>'
    status, *_, ok, file, _, _ = sch._validate_ui(studio, tmp_path, schema, None)
    assert ok and name in status
    assert file.parent == tmp_path and len(file.name.encode()) <= 255 and file.read_text() == schema
    other = sch.download_name("n" * 299 + "m")
    assert other != file.name  # two long names keep apart


def test_the_model_tab_counts_packed_weights(tokenizer_bundle, tmp_path):
    from engine.model.load import wrap_model
    from engine.model.weights import quantize_weights
    from tests.engine.test_stop_and_finite import tiny_llama

    model = tiny_llama(tokenizer_bundle[1])
    fp32 = sum(p.numel() for p in model.parameters())
    quantize_weights(model, "int8")
    lm = wrap_model(model, tokenizer_bundle[1], "tiny-int8", weights="int8")
    rows = dict(mdl.model_info(st.Studio(Engine.from_loaded(lm), RunLog(tmp_path / "runs.db"))))
    assert rows["parameters"] == f"{fp32:,}"


def test_the_header_says_loaded_once_the_model_is(tiny_engine, tmp_path):
    """The header is built before the background load ends: on page load and while a load is under way the page
    asks again, and then says loaded."""
    lm, tiny_engine._lm = tiny_engine._lm, None  # as at start, before the background load
    demo = build_app(tiny_engine, RunLog(tmp_path / "runs.db"))
    status = next(b for b in demo.blocks.values() if isinstance(b, gr.HTML) and "pml-chips" in str(b.value))
    assert "loads on first run" in status.value
    tiny_engine._lm = lm  # the load ended
    refreshers = [f for f in demo.fns.values() if status in f.outputs
                  and any(event in ("load", "tick") for _, event in f.targets)]
    assert refreshers
    for f in refreshers:
        out = f.fn()
        html = out[0] if isinstance(out, tuple) else out
        assert "· loaded" in html and "loads on first run" not in html


def test_user_errors_through_compare_print_no_traceback(tiny_engine, tmp_path, travel, capfd):
    from gradio_client import Client

    schema, prompt, _ = travel
    with served_studio(tiny_engine, RunLog(tmp_path / "runs.db")) as (_, port):
        client = Client(f"http://127.0.0.1:{port}/", headers=AUTH or None, verbose=False)
        for args, says in [((schema, "<prompt schema='travel'><nope/></prompt>", 2), "unknown module"),
                           ((schema, prompt, 0), "max new tokens must be"), ((schema, prompt, 30000), "cap of 2048")]:
            capfd.readouterr()
            with pytest.raises(Exception, match=says):
                client.predict(*args, api_name="/compare")
            out = capfd.readouterr()
            assert "Traceback" not in out.err + out.out, says
