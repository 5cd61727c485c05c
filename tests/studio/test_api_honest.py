"""The API says why documents it did not keep ran as new text (issue 64): in the response's ``pml.note`` and
``pml.uncached_documents``, and in /metrics. Driven by the openai client against a studio served around the tiny
model, as tests/studio/test_api.py does."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.runlog import RunLog
from engine.session import Engine
from studio.api import modes
from tests.studio_fixtures import AUTH, TOKEN, served_studio

MODEL = "tiny-llama"
SNIPPETS = [f"Note {i}: the {name} ferry leaves the north pier at {7 + i} o'clock and takes forty minutes to cross "
            "the bay when the sea is calm." for i, name in enumerate(("Ada", "Brune", "Cyrus", "Dina"))]


@pytest.fixture(scope="module")
def served(tiny_lm, tmp_path_factory):
    log = RunLog(tmp_path_factory.mktemp("api-honest") / "runs.db")
    with served_studio(Engine.from_loaded(tiny_lm), log) as (_, port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0), port


def _chat(client, texts: list[str]):
    return client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, extra_body={"pml": {"arm": "cached"}},
        messages=[{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}])


def _metric(port: int, reason: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pml_api_uncached_documents_total{") and f'reason="{reason}"' in line)


def test_short_documents_get_a_reason_in_the_answer_and_in_metrics(served):
    client, port = served
    assert all(len(s) < modes.MIN_MODULE_CHARS for s in SNIPPETS)  # the 118-133 characters
    before = _metric(port, "short")
    pml = _chat(client, SNIPPETS + ["Which ferry leaves first?"]).model_extra["pml"]
    assert pml["mode"] == "plain" and pml["modules_encoded"] == 0  # what the issue saw, now said
    assert "4 text parts under 256 characters ran as new text" in pml["note"] and "cache_control" in pml["note"]
    assert pml["uncached_documents"] == {"short": 4}
    assert _metric(port, "short") - before == 4

    # long documents beside one short one: the long ones are modules, the short one is named
    long = [s * 3 for s in SNIPPETS[:2]]
    pml = _chat(client, long + [SNIPPETS[2], "Which ferry leaves first?"]).model_extra["pml"]
    assert pml["mode"] == "transparent" and pml["modules_encoded"] == 2
    assert pml["uncached_documents"] == {"short": 1} and "1 text part under" in pml["note"]


def test_a_question_alone_or_documents_long_enough_carry_no_note(served):
    client, _ = served
    pml = _chat(client, ["Which ferry leaves first?"]).model_extra["pml"]
    assert pml["note"] == "" and pml["uncached_documents"] == {}
    pml = _chat(client, [s * 3 for s in SNIPPETS[2:]] + ["Which ferry leaves first?"]).model_extra["pml"]
    assert pml["note"] == "" and pml["uncached_documents"] == {} and pml["modules_encoded"] == 2


def test_an_event_the_studio_does_not_have_gets_a_reason_not_a_traceback(served, caplog):
    """A page from an earlier start names a function index this studio lacks: Gradio's get_fn raised KeyError out
    of the ASGI application (issue 64 item 9); now a 410 says to reload, and the console stays clean."""
    import logging

    _, port = served
    body = {"fn_index": 99_999, "session_hash": "a-page-from-before", "data": [], "event_data": None,
            "trigger_id": None}
    with caplog.at_level(logging.ERROR):
        answer = httpx.post(f"http://127.0.0.1:{port}/gradio_api/queue/join", json=body, headers=AUTH)
    assert answer.status_code == 410 and "reload the page" in answer.json()["detail"], answer.text
    assert "Exception in ASGI application" not in caplog.text and "KeyError" not in caplog.text


# -- issue 74: why nothing was reused, and a repeat named as one ---------------------------------------------------

LONG = [s * 3 for s in SNIPPETS]  # documents of 300+ characters


def _ask(client, messages, arm: str):
    return client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=messages,
                                          extra_body={"pml": {"arm": arm}})


def test_documents_in_the_system_message_are_said_to_run_as_new_text(served):
    """Long documents sent as the system message: the request is plain (a system message is context, never a
    document) and nothing is cached; the note says so and where to send them (it was empty)."""
    client, port = served
    before = _metric(port, "system")
    got = _ask(client, [{"role": "system", "content": LONG[0]}, {"role": "user", "content": "Which ferry is first?"}],
               "cached")
    pml = got.model_extra["pml"]
    assert pml["mode"] == "plain" and got.usage.prompt_tokens_details.cached_tokens == 0
    assert "system message" in pml["note"] and "user message" in pml["note"], pml["note"]
    assert pml["uncached_documents"] == {"system": 1} and _metric(port, "system") - before == 1


def test_the_prefix_arm_says_why_it_reused_only_a_prefix(served):
    """arm=prefix on documents never served in that order reuses only the chat template's opening; the note says
    the prefix arm reuses the longest start shared with an earlier request (it was empty at 3 tokens cached)."""
    client, _ = served
    got = _ask(client, [{"role": "user", "content": [{"type": "text", "text": t} for t in
                                                     (LONG[3], LONG[1], "Which ferry leaves last?")]}], "prefix")
    pml, cached = got.model_extra["pml"], got.usage.prompt_tokens_details.cached_tokens
    assert cached < got.usage.prompt_tokens - 1
    assert f"the prefix arm reused {cached} of {got.usage.prompt_tokens} prompt tokens" in pml["note"], pml["note"]


def test_documents_sent_again_in_another_order_are_a_repeat_as_the_docs_define_it(served):
    """The same documents in another order compile to the same prompt (their positions are fixed), so the routed
    arm reads the earlier answer back: the answer says it is a repeat, and docs/api.md defines "repeat" so (it said
    "an identical earlier request"); another question over the same documents is no repeat."""
    from tests.conftest import ROOT

    client, _ = served
    question = {"type": "text", "text": "Which ferry takes forty minutes?"}
    first = _ask(client, [{"role": "user", "content": [{"type": "text", "text": t} for t in LONG[:3]] + [question]}],
                 "routed").model_extra["pml"]
    assert first["repeat"] is False and first["routed_path"] != "repeat"
    again = _ask(client, [{"role": "user", "content": [{"type": "text", "text": t} for t in
                                                       (LONG[2], LONG[0], LONG[1])] + [question]}], "routed")
    pml = again.model_extra["pml"]
    assert pml["routed_path"] == "repeat" and pml["repeat"] is True
    assert "a repeat" in pml["note"] and "in any order" in pml["note"], pml["note"]
    other = _ask(client, [{"role": "user", "content": [{"type": "text", "text": t} for t in LONG[:3]]
                           + [{"type": "text", "text": "Which ferry leaves at nine?"}]}], "routed").model_extra["pml"]
    assert other["repeat"] is False
    api_md = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    row = next(line for line in api_md.splitlines() if line.startswith("| `routed_path`"))
    assert "`repeat` (an earlier request compiled to the same prompt" in row and "in any order" in row, row
