"""The OpenAI-compatible API (studio/api/), driven by the official openai client against a served studio.

The studio is served as `make run` serves it (guard and launch token included; the token is the API key) around
the tiny random-weight model. Answers are checked against the engine's own run of the same PML (a second Engine
over the same weights, greedy), reuse against token counts computed here from the documents' text.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.arms.registry import Sampling
from engine.runlog import RunLog
from engine.session import Engine
from studio.api import modes
from studio.api.positions import PositionRegistry
from tests.studio_fixtures import AUTH, TOKEN, TRAVEL_PROMPT, served_studio

MODEL = "tiny-llama"
def essay(name: str) -> str:
    """A document longer than modes.MIN_MODULE_CHARS, unique to ``name``."""
    return f"Essay {name}: " + " ".join(f"{name} wrote note {i} about rivers, maps and the weather of {name}."
                                        for i in range(6))


ESSAYS = [essay(name) for name in ("Ada", "Brune", "Cyrus", "Dina")]


@pytest.fixture(scope="module")
def served(tiny_lm, tmp_path_factory):
    """(openai client, port, run log) of one studio served for this module's tests."""
    log = RunLog(tmp_path_factory.mktemp("api") / "runs.db")
    with served_studio(Engine.from_loaded(tiny_lm), log) as (_, port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0), port, log


@pytest.fixture(scope="module")
def oracle(tiny_lm):
    """The engine's own run of a schema and prompt on the same weights, in a fresh Engine: (text, comparison)."""
    eng = Engine.from_loaded(tiny_lm)

    def run(schema: str, prompt: str, arm: str, max_new: int, stop=()):
        res = eng.compare(schema, prompt, Sampling(max_new_tokens=max_new, stop=tuple(stop)),
                          config=eng.config.with_(arms=(arm,), warmup=False))
        return res.arm(arm).run.text, res
    return run


def chat(client, content, arm="cached", max_tokens=6, **kw):
    messages = [{"role": "system", "content": "Answer from the essays."}, {"role": "user", "content": content}]
    extra = {"pml": {"arm": arm, **kw.pop("pml", {})}}
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra, **kw)


def parts(*texts, marked=()):
    return [{"type": "text", "text": t, **({"cache_control": {"type": "ephemeral"}} if i in marked else {})}
            for i, t in enumerate(texts)]


def logged(log: RunLog, run_id: int) -> dict:
    return log.get(run_id)


# ----------------------------------------------------------------------------------------------
# Shapes and answers
# ----------------------------------------------------------------------------------------------

def test_models_lists_the_served_model(served):
    client, _, _ = served
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL] and listed[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    assert "cached" in listed[0].model_extra["pml"]["arms"]


@pytest.mark.parametrize("arm", ["baseline", "prefix", "cached", "routed"])
def test_chat_answers_as_the_engine_runs_the_same_pml(served, oracle, arm):
    """Non-streamed and streamed answers equal the engine's run of the PML the request became (the run log
    keeps it), for each arm; usage counts the prompt and the answer's tokens."""
    client, _, log = served
    content = parts(ESSAYS[0], ESSAYS[1], "Who wrote about rivers?")
    whole = chat(client, content, arm=arm)
    row = logged(log, whole.model_extra["pml"]["run_id"])
    assert row["source"] == "api" and whole.model_extra["pml"]["arm"] == arm
    text, res = oracle(row["schema_text"], row["prompt_text"], arm, 6)
    assert whole.choices[0].message.content == text and whole.object == "chat.completion"
    assert whole.usage.prompt_tokens == res.prompt.prompt_tokens
    assert whole.usage.completion_tokens == len(res.arm(arm).run.token_ids)
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(chat(client, content, arm=arm, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks[1:-1]][-1] == whole.choices[0].finish_reason


def test_completions_plain_and_streamed(served, oracle):
    client, _, log = served
    made = client.completions.create(model=MODEL, prompt="The river runs", max_tokens=5, temperature=0)
    row = logged(log, made.model_extra["pml"]["run_id"])
    assert made.object == "text_completion" and made.model_extra["pml"]["mode"] == "plain"
    assert made.choices[0].text == oracle(row["schema_text"], row["prompt_text"], made.model_extra["pml"]["arm"], 5)[0]
    streamed = client.completions.create(model=MODEL, prompt="The river runs", max_tokens=5, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == made.choices[0].text


# What vllm-router writes into each request it forwards (read from its forwarded bodies, version 0.1.17)
ROUTER_CHAT = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True}
ROUTER_COMPLETION = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}


def test_a_routers_request_is_answered_and_what_it_cannot_honour_refused(served):
    """Behind vllm-router (docs/scale-out.md) every request carries vLLM's and SGLang's own fields at their
    defaults: answered as without them; a value the engine cannot honour is a 400 naming it."""
    _, port, _ = served
    url, messages = f"http://127.0.0.1:{port}/v1", [{"role": "user", "content": "Name a river."}]
    chat_body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **ROUTER_CHAT}
    assert httpx.post(f"{url}/chat/completions", json=chat_body, headers=AUTH, timeout=60).status_code == 200
    body = {"model": MODEL, "prompt": "A river", "max_tokens": 2, "temperature": 0, **ROUTER_COMPLETION}
    assert httpx.post(f"{url}/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    for field, value in (("ignore_eos", True), ("skip_special_tokens", False), ("continue_final_message", True)):
        refused = httpx.post(f"{url}/chat/completions", json={**chat_body, field: value}, headers=AUTH, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


def test_explicit_pml_by_name_equals_the_engine_run(served, oracle):
    """``pml.schema`` names a sample schema; the answer is the engine's on that schema and prompt."""
    from studio.files import load_sample

    client, _, _ = served
    schema, _ = load_sample("travel")
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "(see pml)"}],
                                         max_tokens=5, temperature=0,
                                         extra_body={"pml": {"schema": "travel", "prompt": TRAVEL_PROMPT,
                                                             "arm": "cached"}})
    assert got.model_extra["pml"]["mode"] == "explicit"
    assert got.choices[0].message.content == oracle(schema, TRAVEL_PROMPT, "cached", 5)[0]


def test_stop_strings_cut_the_answer_where_the_engine_stops(served, oracle):
    client, _, log = served
    free = chat(client, parts(ESSAYS[2], "Name the author."), arm="baseline", max_tokens=8)
    text = free.choices[0].message.content
    stop = text[2:4] if len(text) >= 4 else text[:1]
    cut = chat(client, parts(ESSAYS[2], "Name the author."), arm="baseline", max_tokens=8, stop=[stop])
    row = logged(log, cut.model_extra["pml"]["run_id"])
    engine_text = oracle(row["schema_text"], row["prompt_text"], "baseline", 8, stop=[stop])[0]
    assert cut.choices[0].message.content == engine_text[:engine_text.index(stop)] == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------------------------
# The three ways to name reusable parts
# ----------------------------------------------------------------------------------------------

def test_transparent_documents_are_reused_in_another_order_and_subset(served, tiny_lm):
    """The second request holds two of the first's three documents, in another order: at least 90 % of their
    tokens are reported cached (they were encoded at the first request: it reports none of them cached)."""
    client, _, _ = served
    docs = [essay(name) for name in ("Elif", "Farid", "Gusti")]  # seen by no other test
    first = chat(client, parts(docs[0], docs[1], docs[2], "Who wrote about maps?"))
    second = chat(client, parts(docs[2], docs[0], "Who wrote about the weather?"))
    doc_tokens = [len(tiny_lm.codec.encode(d)) for d in docs]
    assert first.model_extra["pml"]["modules_encoded"] == 3
    assert first.usage.prompt_tokens_details.cached_tokens < min(doc_tokens)
    assert second.model_extra["pml"]["mode"] == "transparent" and second.model_extra["pml"]["modules_encoded"] == 0
    # the first request reused only the text before its documents (the system message): the rest is the documents'
    reused = second.usage.prompt_tokens_details.cached_tokens - first.usage.prompt_tokens_details.cached_tokens
    assert reused >= 0.9 * (doc_tokens[2] + doc_tokens[0])
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens


def test_marked_parts_are_modules_and_short_ones_count(served, tiny_lm):
    """A short part carrying cache_control is a module (transparent mode would leave it as text)."""
    client, _, _ = served
    note = "Dina keeps the ferry timetable."  # far below modes.MIN_MODULE_CHARS
    first = chat(client, parts(note, "When does the ferry leave?", marked=(0,)))
    again = chat(client, parts(note, "Who keeps the timetable?", marked=(0,)))
    assert first.model_extra["pml"]["mode"] == again.model_extra["pml"]["mode"] == "marked"
    assert first.model_extra["pml"]["modules_encoded"] == 1 and again.model_extra["pml"]["modules_reused"] == 1
    assert again.usage.prompt_tokens_details.cached_tokens >= len(tiny_lm.codec.encode(note))
    plain = chat(client, parts(note, "When does the ferry leave?"))
    assert plain.model_extra["pml"]["mode"] == "plain" and plain.model_extra["pml"]["modules_encoded"] == 0


def test_completions_chunks_split_by_the_separator_are_modules(served):
    client, _, _ = served
    prompt = modes.SEPARATOR.join([ESSAYS[1], ESSAYS[2], "Question: who wrote about maps?"])
    extra = {"pml": {"arm": "cached"}}
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body=extra)
    swapped = modes.SEPARATOR.join([ESSAYS[2], "Question: whose rivers?"])
    again = client.completions.create(model=MODEL, prompt=swapped, max_tokens=3, temperature=0, extra_body=extra)
    assert again.model_extra["pml"]["mode"] == "transparent" and again.model_extra["pml"]["modules_reused"] == 1
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_the_same_document_gets_the_same_positions_in_any_order(tokenizer_bundle):
    """Pure: the schemas compiled for two requests place each shared document at the same positions."""
    from engine.schema.layout import layout
    from engine.schema.pml import parse_schema

    codec = tokenizer_bundle[2]
    reg = PositionRegistry()

    def spans(texts):
        turns = [modes.Turn("user", tuple(modes.Part(t) for t in texts))]
        c = modes.chat_pml(turns, "auto", codec, reg)
        lay = layout(parse_schema(c.schema), codec)
        return {name: (lay.modules[name].start, lay.modules[name].end) for name in c.documents}

    a, b = spans([ESSAYS[0], ESSAYS[1], ESSAYS[2]]), spans([ESSAYS[2], ESSAYS[0], "q"])
    assert set(b) < set(a) and all(a[k] == b[k] for k in b)
    # transparent mode places new documents by content hash: a set seen first in either order gets one layout
    fresh = [essay(name) for name in ("Lio", "Mara", "Noor")]
    reg = PositionRegistry()
    first = spans(fresh)
    reg = PositionRegistry()
    assert spans(fresh[::-1]) == first


# ----------------------------------------------------------------------------------------------
# Arms, usage, the run log and metrics
# ----------------------------------------------------------------------------------------------

def test_routed_reports_the_modules_it_kept_and_the_tokens_it_left_out(served):
    client, _, _ = served
    chat(client, parts(ESSAYS[0], ESSAYS[2], "Who wrote about maps?"))  # encode both
    got = chat(client, parts(ESSAYS[0], ESSAYS[2], "Who wrote about maps?"), arm="routed")
    pml = got.model_extra["pml"]
    assert pml["arm"] == "routed" and pml["routed_kept"] and set(pml["routed_kept"]) <= {
        f"d_{modes.document_key(ESSAYS[i])}" for i in (0, 2)}
    assert (pml["routed_out_tokens"] == 0) == (len(pml["routed_kept"]) == 2)
    assert got.usage.prompt_tokens_details.cached_tokens <= got.usage.prompt_tokens
    assert chat(client, parts(ESSAYS[0], "Who?")).model_extra["pml"]["routed_out_tokens"] is None  # the cached arm


def test_the_default_arm_keeps_most_documents_cached_on_a_spanning_question_and_all_on_a_reordered_repeat(served,
                                                                                                          tiny_lm):
    """A question about every document (the random model's attention points at no module: every one is kept and
    a share of their tokens recomputed) reports at least 70 % of the document tokens cached; the same documents in
    another order are the same prompt (transparent mode places them in position order), read back from the prefix
    tree: at least 90 %."""
    client, _, _ = served
    docs = [essay(name) for name in ("Hana", "Ivo", "Jala", "Kemal")]  # seen by no other test
    doc_tokens = sum(len(tiny_lm.codec.encode(d)) for d in docs)
    chat(client, parts(*docs, "Who wrote about maps?"))  # their first sight: encoded
    question = "What did each of them write about?"
    span = chat(client, parts(*docs, question), arm=None)
    pml = span.model_extra["pml"]
    assert pml["arm"] == "routed" and pml["modules_encoded"] == 0 and len(pml["routed_kept"]) == 4
    assert pml["routed_path"] == "partial" and 0 < pml["recomputed_tokens"] <= 0.3 * doc_tokens
    assert span.usage.prompt_tokens_details.cached_tokens >= 0.7 * doc_tokens
    again = chat(client, parts(docs[2], docs[0], docs[3], docs[1], question), arm=None)
    pml = again.model_extra["pml"]
    assert pml["routed_path"] == "repeat" and pml["recomputed_tokens"] == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * doc_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens  # nothing prefilled
    assert again.choices[0].message.content == span.choices[0].message.content


def test_baseline_reports_nothing_cached(served):
    client, _, _ = served
    got = chat(client, parts(ESSAYS[1], "Who wrote about rivers?"), arm="baseline")
    assert got.usage.prompt_tokens_details.cached_tokens == 0 and got.model_extra["pml"]["mode"] == "plain"


def test_every_request_is_a_run_log_row_and_metrics_count_them(served):
    client, port, log = served
    before = len([r for r in log.runs(limit=None) if r["source"] == "api"])
    got = chat(client, parts(ESSAYS[3], "Who wrote about rivers?"))
    rows = [r for r in log.runs(limit=None) if r["source"] == "api"]
    assert len(rows) == before + 1 and rows[0]["id"] == got.model_extra["pml"]["run_id"]
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    assert "pml_api_requests_total" in metrics and "pml_api_ttft_seconds_bucket" in metrics
    assert "pml_module_store_bytes" in metrics and "pml_api_cached_share_bucket" in metrics
    assert _sample(metrics, "pml_api_requests_total", endpoint="/v1/chat/completions", arm="cached") >= 1
    assert _sample(metrics, "pml_api_cached_tokens_total", arm="cached") >= got.usage.prompt_tokens_details.cached_tokens
    assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 401  # behind the launch token too


def test_first_sight_of_documents_streams_encoding_comments_and_counts_them(served):
    """Issue 48 item 8: while a streamed request's new documents are encoded, the stream carries SSE comments
    (`: encoding 2/3 units: ...`) before its first chunk; the openai client ignores them; /metrics counts them
    and the encoding seconds; a second sight of the same documents encodes nothing and says nothing."""
    client, port, _ = served
    fresh = [essay(name) for name in ("Eero", "Fumiko", "Goran", "Hale")]
    streamed = list(chat(client, parts(fresh[0], fresh[1], "Who wrote about maps?"), stream=True))
    whole = chat(client, parts(fresh[0], fresh[1], "Who wrote about maps?"))
    assert whole.model_extra["pml"]["modules_encoded"] == 0 and whole.model_extra["pml"]["encode_ms"] == 0
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content

    def raw(content) -> list[str]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3,
                "temperature": 0, "stream": True, "pml": {"arm": "cached"}}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            assert r.status_code == 200
            return [line for line in r.iter_lines() if line.strip()]

    lines = raw(parts(fresh[2], fresh[3], "Whose weather?"))
    comments = [i for i, line in enumerate(lines) if line.startswith(": encoding ")]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert comments and max(comments) < first_data, lines[:6]
    total = int(lines[comments[-1]].split()[2].split("/")[1])
    assert lines[comments[-1]].startswith(f": encoding {total}/{total} units")  # the last unit is the last comment
    assert lines[-1] == "data: [DONE]"
    assert not any(line.startswith(":") and "encoding" in line for line in raw(parts(fresh[2], fresh[3], "Whose?")))
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    assert "pml_api_progress_comments_total" in metrics
    assert float(next(line.split()[1] for line in metrics.splitlines()
                      if line.startswith("pml_api_progress_comments_total "))) > len(comments)  # the openai stream's too
    assert _sample(metrics, "pml_api_encode_seconds_total", arm="cached") > 0


def test_history_shows_the_api_source(served, tiny_lm):
    from studio.state import Studio
    from studio.tabs import history

    client, _, log = served
    chat(client, parts(ESSAYS[1], "Whose maps?"))
    assert any(" · api" in str(row[2]) for row in history.rows(Studio(Engine.from_loaded(tiny_lm), log)))


def _sample(text: str, name: str, **labels) -> float:
    """The summed value of metric ``name``'s lines that carry ``labels`` (any others too)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in wanted))


def test_the_default_arm_is_the_one_the_serve_benchmark_decided():
    """docs/api.md's rule picks the default from bench/serve.py's results: the code must follow the measurement."""
    import json
    from pathlib import Path

    from studio.api.defaults import DEFAULT_ARM

    result = Path(__file__).resolve().parents[2] / "bench" / "results" / "serve-qwen2.5-coder-0.5b.json"
    assert json.loads(result.read_text())["default_arm"]["arm"] == DEFAULT_ARM
