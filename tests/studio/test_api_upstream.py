"""The PML front for vLLM (``pml-studio api --upstream URL``, studio/api/front.py), against a vLLM stand-in
(tests/upstream_standin.py) that records what the front sends. The client is the official openai package.

What the front sends is checked against independent computations: the token ids the baseline arm prefills for the
same PML (``Engine.prepare``), and, for transparent requests, the text those ids decode to, written out here from
the chat template's tags and the documents in canonical order. The small model's tokenizer only: its weights never
load (``Engine.loaded`` stays False).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine.model import SMALL_MODEL
from engine.session import Engine
from studio.api import modes
from studio.api.front import ARM
from tests.conftest import ROOT, free_port
from tests.studio_fixtures import AUTH, TOKEN, TRAVEL_PROMPT, served_api
from tests.upstream_standin import StandIn

SERVED = "smol-on-vllm"  # the stand-in's served model name, unlike the local one
SYSTEM = "Answer from the essays."


def essay(name: str) -> str:
    return f"Essay {name}: " + " ".join(f"{name} wrote note {i} about rivers, maps and weather." for i in range(6))


ESSAYS = [essay(n) for n in ("Ada", "Brune", "Cyrus")]


@pytest.fixture(scope="module")
def engine():
    """The small model's Engine: a front uses its tokenizer only."""
    return Engine(model=SMALL_MODEL, persist=False)


@pytest.fixture(scope="module")
def standin(engine):
    with StandIn(engine.codec.encode, SERVED) as upstream:
        yield upstream


def front(engine, url: str):
    """What `pml-studio api --upstream URL` serves, on a free port; yields the port."""
    return served_api(engine, None, upstream=url)


@pytest.fixture(scope="module")
def served(engine, standin):
    with front(engine, standin.url) as port:
        yield client_for(port), port


def client_for(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def ask(client, content, **kw):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    return client.chat.completions.create(model=SERVED, messages=messages, max_tokens=kw.pop("max_tokens", 8),
                                          temperature=0, **kw)


def canonical(docs) -> list[str]:
    """The documents in the order the transparent mode renders a new set: by their key (modes.document_key)."""
    return sorted(docs, key=lambda d: hashlib.sha256(d.encode()).hexdigest()[:16])


def contains(ids: list[int], run: list[int]) -> bool:
    return any(ids[i:i + len(run)] == run for i in range(len(ids) - len(run) + 1))


# ----------------------------------------------------------------------------------------------
# What the front sends
# ----------------------------------------------------------------------------------------------

def test_transparent_chat_sends_the_documents_in_canonical_order_as_token_ids(served, standin, engine):
    client, _ = served
    question = "Who wrote note 3?"
    answer = ask(client, parts(*ESSAYS, question))
    sent = standin.sent[-1]
    ids = sent["prompt"]
    tok = engine.tokenizer
    docs = canonical(ESSAYS)
    expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{''.join(docs)}{question}<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tok.decode(ids) == expected
    for doc in docs:  # each document tokenized alone, as the module it is: not the text re-tokenized whole
        assert contains(ids, tok.encode(doc, add_special_tokens=False))
    assert sent["model"] == SERVED and sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (sent["max_tokens"], sent["temperature"]) == (8, 0) and "seed" not in sent
    assert answer.choices[0].message.content == "".join(standin.reply)
    assert answer.model == SERVED and answer.model_extra["pml"]["arm"] == ARM
    assert answer.model_extra["pml"]["mode"] == "transparent"
    assert answer.usage.prompt_tokens == len(ids) and not engine.loaded

    ask(client, parts(ESSAYS[2], ESSAYS[0], ESSAYS[1], question))  # another order: the same ids, reused by vLLM
    again = ask(client, parts(ESSAYS[1], ESSAYS[2], ESSAYS[0], question))
    assert standin.sent[-1]["prompt"] == standin.sent[-2]["prompt"] == ids
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16


def test_explicit_pml_sends_the_ids_the_baseline_arm_prefills(served, standin, engine):
    """``pml-studio run``'s baseline prefills ``Engine.prepare(schema, prompt).plan.token_ids``: the same ids."""
    client, _ = served
    schema = (ROOT / "sample_schemas" / "travel.xml").read_text()
    for stream in (False, True):
        got = client.chat.completions.create(model=SERVED, max_tokens=3, temperature=0.7, seed=11, stream=stream,
                                             messages=[{"role": "user", "content": "(see pml)"}],
                                             extra_body={"pml": {"schema": "travel", "prompt": TRAVEL_PROMPT}})
        text = "".join(c.choices[0].delta.content or "" for c in got if c.choices) if stream else \
            got.choices[0].message.content
        assert text == "".join(standin.reply[:3])
        sent = standin.sent[-1]
        assert sent["prompt"] == engine.prepare(schema, TRAVEL_PROMPT).plan.token_ids
        assert (sent["max_tokens"], sent["temperature"], sent["seed"]) == (3, 0.7, 11)
    assert not engine.loaded


def test_streamed_chat_in_openai_shapes_with_vllms_cached_tokens(served, standin):
    client, _ = served
    question = "Which essay names maps?"
    ask(client, parts(*ESSAYS[:2], question))
    chunks = list(ask(client, parts(*ESSAYS[:2], question), stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(standin.reply)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    ids = standin.sent[-1]["prompt"]
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(ids)
    assert usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16 > 0.9 * len(ids) - 16
    assert all(c.object == "chat.completion.chunk" and c.model == SERVED for c in chunks)


def test_completions_streamed_and_not(served, standin, engine):
    client, _ = served
    prompt = f"{ESSAYS[0]}{modes.SEPARATOR}{ESSAYS[1]}{modes.SEPARATOR}Question: who wrote about weather?"
    whole = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == "".join(standin.reply[:2])
    assert whole.choices[0].finish_reason == "length" and whole.model_extra["pml"]["mode"] == "transparent"
    ids = standin.sent[-1]["prompt"]
    assert engine.tokenizer.decode(ids) == ("".join(canonical(ESSAYS[:2])) + "Question: who wrote about weather?"
                                           "<|im_start|>assistant\n")
    streamed = list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert standin.sent[-1]["prompt"] == ids


def test_two_fronts_render_one_document_set_alike(engine, standin, served):
    """Stateless: a second front, started apart, sends the first one's ids for the same documents, so the
    upstream's prefix cache serves the second from what the first sent."""
    first, _ = served
    docs = [essay(n) for n in ("Eda", "Faro", "Gus")]
    ask(first, parts(*docs, "Who wrote note 5?"))
    with front(engine, standin.url) as port:
        second = ask(client_for(port), parts(docs[2], docs[1], docs[0], "Who wrote note 5?"))
    assert standin.sent[-1]["prompt"] == standin.sent[-2]["prompt"]
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * second.usage.prompt_tokens


# ----------------------------------------------------------------------------------------------
# Refusals and faults
# ----------------------------------------------------------------------------------------------

def route_key(ids: list[int]) -> str:
    """The routing key of a prompt whose shared prefix is ``ids`` (the front's rule, computed here from the ids)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]


def session_of(standin) -> str | None:
    return {k.lower(): v for k, v in standin.headers[-1].items()}.get("x-session-id")


def test_the_routing_key_is_a_hash_of_the_prefix_through_the_first_document(served, standin, engine):
    """X-Session-ID: the same for one document set in any order and any question, a hash (no text), the ids through
    the first document in canonical order; another first document, another key; no documents, no key."""
    client, _ = served
    tok = engine.tokenizer
    ask(client, parts(*ESSAYS, "Who wrote note 1?"))
    key = session_of(standin)
    ask(client, parts(ESSAYS[2], ESSAYS[1], ESSAYS[0], "Which essay names maps?"), stream=True)
    assert session_of(standin) == key and len(key) == 32 and int(key, 16) >= 0
    first = canonical(ESSAYS)[0]
    head = tok.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n", add_special_tokens=False)
    prefix = head + tok.encode(first, add_special_tokens=False)
    assert standin.sent[-1]["prompt"][:len(prefix)] == prefix and key == route_key(prefix)

    others = [d for d in ESSAYS if d != first]  # a subset without the first document: another first, another key
    ask(client, parts(*others, "Who wrote note 2?"))
    second = canonical(others)[0]
    assert session_of(standin) == route_key(head + tok.encode(second, add_special_tokens=False)) != key

    ask(client, "What is a river?")  # no documents: no key (the router then balances as it likes)
    assert session_of(standin) is None
    client.completions.create(model=SERVED, prompt=" # # ".join([*ESSAYS, "Who wrote note 4?"]), max_tokens=2)
    assert session_of(standin) == route_key(tok.encode(first, add_special_tokens=False))


def test_health_answers_a_routers_check_without_the_token(served):
    _, port = served
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401  # the rest keeps its guard


def test_an_upstream_refusal_is_passed_on(served, standin):
    client, _ = served
    standin.refuse = (400, {"error": {"message": "This model's maximum context length is 4096 tokens.",
                                      "type": "BadRequestError", "param": "prompt", "code": 400}})
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "Hello")
    assert err.value.status_code == 400 and "maximum context length is 4096" in err.value.message
    assert err.value.body["type"] == "BadRequestError" and err.value.body["param"] == "prompt"
    assert ask(client, "Hello").choices[0].message.content == "".join(standin.reply)  # serving on


def test_what_the_front_refuses_never_reaches_the_upstream(served, standin):
    client, _ = served
    before = len(standin.sent)
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "Hi", extra_body={"pml": {"arm": "cached"}})
    assert err.value.code == "unknown_arm" and "vllm" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, parts(ESSAYS[0] * 40, "Why?"), max_tokens=2048)
    assert err.value.code == "context_length_exceeded" and "4096" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"pml": {"schema": "no_such_schema", "prompt": "<prompt/>"}})
    assert err.value.code == "schema_not_found"
    assert len(standin.sent) == before


def test_a_stream_broken_by_the_upstream_ends_with_an_error_event(served, standin):
    client, _ = served
    standin.break_after = 2
    try:
        stream = ask(client, "Hello", stream=True)
        texts = []
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                texts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
    finally:
        standin.break_after = None
    assert "".join(texts) == "".join(standin.reply[:2]) and "the engine died" in str(err.value.message)
    assert ask(client, "Hello").choices[0].message.content == "".join(standin.reply)


def test_an_upstream_that_is_down_is_a_503_and_the_front_serves_when_it_is_back(engine):
    with StandIn(engine.codec.encode, SERVED) as first, front(engine, first.url) as port:
        client = client_for(port)
        assert ask(client, "Hi").choices[0].message.content
        first.stop()
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as err:
                list(ask(client, "Hi", stream=stream)) if stream else ask(client, "Hi")
            assert err.value.status_code == 503 and err.value.code == "upstream_unavailable"
            assert first.url in err.value.message
        with StandIn(engine.codec.encode, SERVED, port=first.port) as back:
            assert ask(client, "Hi").choices[0].message.content == "".join(back.reply)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
        assert 'pml_api_requests_total{arm="vllm",endpoint="/v1/chat/completions",mode="plain",status="200"} 2.0' \
            in metrics
    assert not engine.loaded


def test_an_upstream_with_another_tokenizer_is_refused(engine):
    from studio.api.serve import check_upstream
    from studio.api.upstream import UpstreamError

    with StandIn(lambda text: [t + 1 for t in engine.codec.encode(text)], SERVED) as other:
        with pytest.raises(UpstreamError, match="tokenizer differs from this front's"):
            check_upstream(other.url, engine.codec)
        with front(engine, other.url) as port:
            with pytest.raises(openai.InternalServerError) as err:
                ask(client_for(port), "Hi")
        assert err.value.status_code == 503 and err.value.code == "upstream_mismatch" and other.sent == []


def test_models_names_the_upstreams_model(served, standin):
    client, _ = served
    card = client.models.list().data[0]
    assert card.id == SERVED and card.model_extra["pml"]["upstream"] == standin.url
    assert card.model_extra["pml"]["arms"] == [ARM] and card.model_extra["pml"]["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------

def test_pml_studio_api_upstream_serves_and_refuses_a_mismatch(engine, tmp_path, capsys):
    """`pml-studio api --upstream URL` as a user starts it: its start lines; another tokenizer: one line, exit 2."""
    from studio.api.serve import ServeOptions, serve

    with StandIn(engine.codec.encode, SERVED) as good, \
            StandIn(lambda text: engine.codec.encode(text)[::-1], SERVED) as bad:
        assert serve(ServeOptions(upstream=bad.url, port=free_port(), db=str(tmp_path / "a.db"))) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("pml-studio: error: ") and "tokenizer differs" in err
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "studio.cli", "api", "--upstream", good.url, "--port",
                                 str(port), "--db", str(tmp_path / "b.db")], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "PML_STUDIO_TOKEN": TOKEN})
        try:
            _wait_for(lambda: _answers(port) or proc.poll() is not None, timeout=180)
            assert ask(client_for(port), "Hi").choices[0].message.content == "".join(good.reply)
        finally:
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
        assert f"upstream {good.url} serves '{SERVED}'" in out and "weights are not loaded" in out


def test_the_studios_api_forwards_with_the_upstream_option(engine, standin, tmp_path):
    """`pml-studio serve --upstream URL`: the API on the studio's port is the front; the page's engine stays
    unloaded (the studio then preloads nothing: StudioOptions.preload)."""
    from engine.cli import build_parser
    from engine.runlog import RunLog
    from studio.cli import EXTRA
    from studio.launch import StudioOptions
    from tests.studio_fixtures import served_studio

    with served_studio(engine, RunLog(tmp_path / "runs.db"), api={"upstream": standin.url}) as (_, port):
        got = ask(client_for(port), parts(*ESSAYS[:2], "Who wrote about maps?"))
    assert got.model_extra["pml"]["arm"] == ARM and got.choices[0].message.content == "".join(standin.reply)
    assert engine.tokenizer.decode(standin.sent[-1]["prompt"]).count("Essay ") == 2 and not engine.loaded
    args = build_parser(EXTRA).parse_args(["serve", "--upstream", standin.url])
    assert StudioOptions.from_args(args).preload is False


def test_the_upstream_option_exists_for_api_and_serve():
    from engine.cli import build_parser
    from studio.cli import EXTRA

    for command in ("api", "serve"):
        args = build_parser(EXTRA).parse_args([command, "--upstream", "http://10.0.0.5:8000"])
        assert args.upstream == "http://10.0.0.5:8000"


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=AUTH, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_for(ready, timeout: float = 60.0) -> None:
    """Poll ``ready()`` until it holds (a readiness wait, not a timing assertion)."""
    end = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.05)


def test_the_front_reads_the_upstreams_stream_with_the_engines_reader():
    """The stream the vllm arm's test reads (tests/engine/test_sse.py): pieces, then the upstream's error event as
    its refusal and an event that is not JSON or a stream without [DONE] as a 502, each in this API's words."""
    import asyncio

    from engine.run.remote import Piece
    from studio.api.errors import ApiError
    from studio.api.upstream import Upstream
    from tests.engine.test_sse import STREAM, served_by

    body = {"prompt": [1, 2, 3], "max_tokens": 4}

    async def read(raw: bytes):
        upstream = Upstream("http://up.test", None, transport=served_by(raw))
        try:
            return [e async for e in upstream.complete(body) if isinstance(e, Piece)]
        finally:
            await upstream.aclose()

    assert asyncio.run(read(STREAM)) == [Piece("a"), Piece("b")]
    died = b'data: {"error": {"message": "the engine died", "type": "InternalServerError", "code": 500}}\n\n'
    for tail, status, said in [(died, 500, "upstream: the engine died"),
                               (b"data: {x\n\n", 502, "the upstream http://up.test sent an event that is not JSON: {x"),
                               (b"", 502, "the upstream http://up.test ended its stream without [DONE]")]:
        with pytest.raises(ApiError) as err:
            asyncio.run(read(STREAM.split(b"data: [DONE]")[0] + tail))
        assert (err.value.status, err.value.message) == (status, said)
