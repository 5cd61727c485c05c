"""The OpenAI-compatible API under bad input and load: hostile requests get named errors and the server keeps
serving; concurrent streams each get their own answer; a client that leaves stops its run; a full queue is a 429;
``pml-studio api`` serves the same routes without the page. Clients: the official openai client, and httpx where a
request must be malformed on purpose.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.run.events import FirstToken, Token
from engine.runlog import RunLog
from engine.session import Engine
from studio.streaming import on_engine_thread_soon
from tests.studio_fixtures import AUTH, TOKEN, served_api, served_studio

MODEL = "tiny-llama"
DOC = "The harbour of Vell keeps three ferries, each named after a wind: " + "north, south and east. " * 12
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def served(tiny_lm, tmp_path_factory):
    """(port, engine, run log) of one studio served for this module's tests."""
    log = RunLog(tmp_path_factory.mktemp("api-faults") / "runs.db")
    engine = Engine.from_loaded(tiny_lm)
    with served_studio(engine, log) as (_, port):
        yield port, engine, log


def client_for(port: int, key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


def body(**kw) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **kw}


# (what, request, status, error code): each a request a careless or hostile program could send
HOSTILE = [
    ("bad JSON", {"content": b'{"model": "tiny-llama", "messages": ['}, 400, "invalid_json"),
    ("a JSON list", {"json": [1, 2]}, 422, "invalid_type"),
    ("an empty body", {"content": b""}, 422, "invalid_type"),
    ("messages not a list", {"json": body(messages="hi")}, 422, "invalid_type"),
    ("no messages", {"json": body(messages=[])}, 400, "invalid_value"),
    ("max_tokens as text", {"json": body(max_tokens="many")}, 422, "invalid_type"),
    ("huge max_tokens", {"json": body(max_tokens=10**12)}, 400, "invalid_value"),
    ("max_tokens 0", {"json": body(max_tokens=0)}, 400, "invalid_value"),
    ("temperature 5", {"json": body(temperature=5)}, 400, "invalid_value"),
    ("temperature as text", {"json": body(temperature="hot")}, 422, "invalid_type"),
    ("top_p 0", {"json": body(top_p=0)}, 400, "invalid_value"),
    ("seed as text", {"json": body(seed="x")}, 422, "invalid_type"),
    ("n=2", {"json": body(n=2)}, 400, "unsupported_parameter"),
    ("logprobs", {"json": body(logprobs=True)}, 400, "unsupported_parameter"),
    ("tools", {"json": body(tools=[{"type": "function", "function": {"name": "f"}}])}, 400, "unsupported_parameter"),
    ("json mode", {"json": body(response_format={"type": "json_object"})}, 400, "unsupported_parameter"),
    ("an unknown parameter", {"json": body(top_k=5)}, 400, "unknown_parameter"),
    ("an unknown model", {"json": body(model="gpt-9")}, 404, "model_not_found"),
    ("no model", {"json": {"messages": USER}}, 422, "invalid_type"),
    ("a tool message", {"json": body(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])}, 400,
     "unsupported_parameter"),
    ("an image part", {"json": body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])}, 400, "unsupported_content"),
    ("five stop strings", {"json": body(stop=["a", "b", "c", "d", "e"])}, 400, "invalid_value"),
    ("an unknown arm", {"json": body(pml={"arm": "fastest"})}, 400, "unknown_arm"),
    ("a schema without its prompt", {"json": body(pml={"schema": "travel"})}, 400, "missing_parameter"),
    ("an unknown schema", {"json": body(pml={"schema": "nowhere", "prompt": '<prompt schema="nowhere"/>'})}, 400,
     "schema_not_found"),
    ("broken PML", {"json": body(pml={"schema": "<schema name='x'><module>", "prompt": "<prompt schema='x'/>"})},
     400, "invalid_pml"),
    ("a prompt over the context", {"json": body(messages=[{"role": "user", "content": "word " * 3000}])}, 400,
     "context_length_exceeded"),
    ("an answer over the context", {"json": body(max_tokens=2048)}, 400, "context_length_exceeded"),
    ("token ids as a prompt", {"json": {"model": MODEL, "prompt": [[1, 2, 3]]}, "path": "/v1/completions"}, 400,
     "unsupported_parameter"),
    ("a 10 MB body", {"content": b"x" * (10 << 20)}, 413, "request_too_large"),
    ("a foreign Host", {"json": body(), "headers": {**AUTH, "Host": "attacker.example"}}, 403, "forbidden"),
    ("no key", {"json": body(), "headers": {}}, 401, "invalid_api_key"),
    ("a wrong key", {"json": body(), "headers": {"Authorization": "Bearer not-the-token-0123456789"}}, 401,
     "invalid_api_key"),
    ("GET on a POST route", {"method": "GET"}, 405, "method_not_allowed"),
    ("an unknown route", {"json": body(), "path": "/v1/embeddings"}, 404, "not_found"),
]


def test_hostile_requests_each_get_a_named_error_and_the_server_keeps_serving(served, capfd):
    port, _, _ = served
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=120) as http:
        for what, req, status, code in HOSTILE:
            method = req.get("method", "POST")
            got = http.request(method, url + req.get("path", "/v1/chat/completions"), json=req.get("json"),
                               content=req.get("content"), headers=req.get("headers", AUTH))
            error = got.json()["error"]
            assert (got.status_code, error["code"]) == (status, code), (what, got.text[:300])
            assert error["message"] and error["type"] and "Traceback" not in got.text, what
        alive = client_for(port).chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0)
    assert alive.choices[0].message.content is not None
    assert "Traceback" not in "".join(capfd.readouterr())


# (what, request, status, error code, the parameter named, words of the message): bodies FastAPI could not read
# (answered http_error) and errors that named the wrong place (or a 500 with a traceback)
EDGES = [
    ("text that is not UTF-8", {"content": b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "caf\xe9"}]}'},
     400, "invalid_json", None, "not UTF-8 text"),
    ("arrays nested 100,000 deep", {"content": b"[" * 100_000 + b"]" * 100_000}, 400, "invalid_json", None,
     "more than 100 levels deep"),
    ("a 5,000-digit number", {"content": b'{"model": "tiny-llama", "max_tokens": ' + b"7" * 5000 + b"}"}, 400,
     "invalid_json", None, "too long to read"),
    ("cache_control of type 5", {"json": body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "doc", "cache_control": {"type": 5}}]}])}, 422,
     "invalid_type", "messages[0].content[1].cache_control.type", "valid string"),
    ("a schema name of 300 characters", {"json": body(pml={"schema": "s" * 300, "prompt": "<prompt schema='s'/>"})},
     400, "schema_not_found", "pml.schema", "(300 characters)"),
]


@pytest.mark.parametrize("what, req, status, code, param, words", EDGES, ids=[e[0] for e in EDGES])
def test_unreadable_bodies_and_odd_values_get_named_errors_at_once(served, capfd, what, req, status, code, param,
                                                                   words):
    port, _, _ = served
    start = time.monotonic()
    got = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=req.get("json"), content=req.get("content"),
                     headers=AUTH, timeout=60)
    error = got.json()["error"]
    assert (got.status_code, error["code"], error["param"]) == (status, code, param), got.text[:300]
    assert words in error["message"] and time.monotonic() - start < 10
    assert "Traceback" not in "".join(capfd.readouterr())


def test_a_schema_with_100000_unknown_attributes_is_a_400_listing_the_first_problems(served):
    """A 1.1 MB schema with 100,000 unknown attributes: the 400 lists the first problems, at their columns, and
    counts the rest (each was located from the text's start: 32 s on the engine thread and an 11 MB body)."""
    from engine.errors import MAX_PROBLEMS

    port, _, _ = served
    head = '<schema name="s"><module name="m" '
    schema = head + " ".join(f'a{i}="v"' for i in range(100_000)) + ">x</module></schema>"
    got = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=AUTH, timeout=300,
                     json=body(pml={"schema": schema, "prompt": '<prompt schema="s"><m/></prompt>'}))
    error = got.json()["error"]
    assert (got.status_code, error["code"], error["param"]) == (400, "invalid_pml", "pml")
    lines = error["message"].splitlines()
    assert len(got.content) < 32_000 and len(lines) == MAX_PROBLEMS + 1
    assert lines[0].startswith(f"request schema:1:{len(head) + 1}: error: <module> has an unknown attribute 'a0'")
    assert lines[-1] == f"... and {100_000 - MAX_PROBLEMS} more problems (fix these first)"
    named = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=AUTH, json=body(model="m" * 1_000_000))
    assert named.status_code == 404 and len(named.content) < 40_000  # a name echoed back is cut in its middle
    assert client_for(port).chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices


# (what, the body's JSON text with a lone surrogate escaped in it, the parameter named): any string a client sends
SURROGATES = [
    ("model", '{"model": "\\udfff", "messages": [{"role": "user", "content": "Hi"}]}', "model"),
    ("stop", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "stop": "\\ud800"}', "stop"),
    ("a stop in a list", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], '
     '"stop": ["ok", "x\\udbff"]}', "stop[1]"),
    ("pml.arm", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], '
     '"pml": {"arm": "\\udfff"}}', "pml.arm"),
    ("pml.schema", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], '
     '"pml": {"schema": "<schema name=\'s\'>\\udfff</schema>", "prompt": "<prompt schema=\'s\'/>"}}', "pml.schema"),
    ("pml.prompt", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], '
     '"pml": {"schema": "travel", "prompt": "<prompt schema=\'travel\'>\\udc00</prompt>"}}', "pml.prompt"),
    ("message content", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi \\ud83d!"}]}',
     "messages[0].content"),
    ("a content part's type", '{"model": "tiny-llama", "messages": [{"role": "user", "content": '
     '[{"type": "\\udfff", "text": "Hi"}]}]}', "messages[0].content[0].type"),
    ("a content part's text", '{"model": "tiny-llama", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "\\ude00 Hi"}]}]}', "messages[0].content[0].text"),
    ("a key", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "pml": {"\\udfff": 1}}',
     "pml"),
]


def test_a_lone_surrogate_in_any_string_is_a_400_naming_its_field_and_counted_as_sent(served, capfd):
    """A string JSON escapes as a lone UTF-16 surrogate has no UTF-8: it used to be a 500 with a traceback (the
    error echoing it could not be written), counted in /metrics as the 404 it never sent. A surrogate pair is a
    character and is answered."""
    port, _, _ = served
    url = f"http://127.0.0.1:{port}"
    before = _requests(port, "400"), _requests(port, "404"), _requests(port, "500")
    for what, text, param in SURROGATES:
        got = httpx.post(url + "/v1/chat/completions", content=text.encode(), headers=AUTH, timeout=60)
        error = got.json()["error"]
        assert (got.status_code, error["code"], error["param"]) == (400, "invalid_value", param), (what, got.text)
        assert "lone UTF-16 surrogate" in error["message"], what
    got = httpx.post(url + "/v1/completions", content=b'{"model": "tiny-llama", "prompt": "\\udfff"}', headers=AUTH)
    assert (got.status_code, got.json()["error"]["param"]) == (400, "prompt")
    after = _requests(port, "400"), _requests(port, "404"), _requests(port, "500")
    assert after == (before[0] + len(SURROGATES), before[1], before[2])  # the completions one: its own endpoint
    paired = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120, content=b'{"model": "tiny-llama", '
                        b'"max_tokens": 2, "messages": [{"role": "user", "content": "Hi \\ud83d\\ude00"}]}')
    assert paired.status_code == 200, paired.text
    assert "Traceback" not in "".join(capfd.readouterr())


def test_the_openai_client_raises_its_own_error_classes(served):
    port, _, _ = served
    with pytest.raises(openai.NotFoundError):
        client_for(port).chat.completions.create(model="gpt-9", messages=USER)
    with pytest.raises(openai.AuthenticationError):
        client_for(port, "not-the-token-0123456789").models.list()
    with pytest.raises(openai.BadRequestError) as err:
        client_for(port).chat.completions.create(model=MODEL, messages=USER, max_tokens=2048, stream=True)
    assert err.value.code == "context_length_exceeded"


def test_eight_concurrent_streaming_clients_each_get_the_answer_they_get_alone(served):
    port, _, _ = served
    client = client_for(port)

    def ask(i: int) -> str:
        arm = ("cached", "baseline")[i % 2]
        stream = client.chat.completions.create(
            model=MODEL, max_tokens=6, temperature=0, stream=True, extra_body={"pml": {"arm": arm}},
            messages=[{"role": "user", "content": [{"type": "text", "text": DOC}, {"type": "text",
                                                                                      "text": f"Question {i}?"}]}])
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    alone = [ask(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone


def test_a_client_that_disconnects_stops_the_decoding(served, monkeypatch):
    """The stream is closed after its first chunks: the engine worker closes the run's generator long before
    max_tokens, at most one token after its stop flag first said stop."""
    from studio.api import service

    port, engine, log = served
    seen: dict = {"tokens": 0, "at_stop": None, "ended": threading.Event()}
    request, stop_asked = engine.request, service.stop_asked

    def watched(*args, **kw):  # the request the scheduler drives, its events counted as they pass
        events = request(*args, **kw)
        try:
            for event in events:
                seen["tokens"] += isinstance(event, (FirstToken, Token))
                yield event
        except GeneratorExit:
            seen["stopped"] = True
            raise
        finally:
            events.close()
            seen["ended"].set()

    def asked(flag):
        said = stop_asked(flag)

        def check():
            if said() and seen["at_stop"] is None:
                seen["at_stop"] = seen["tokens"]
            return said()
        return check

    monkeypatch.setattr(service, "stop_asked", asked)
    monkeypatch.setattr(engine, "request", watched)
    runs_before = log.count()
    stream = client_for(port).chat.completions.create(model=MODEL, messages=USER, max_tokens=1500, temperature=0,
                                                      stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert seen["ended"].wait(120)
    assert "stopped" in seen and seen["tokens"] < 1500
    assert seen["tokens"] - seen["at_stop"] <= 1
    assert log.count() == runs_before  # a stopped run is not logged


def test_a_full_queue_answers_429_and_the_queued_request_is_answered(tiny_lm, tmp_path):
    """With the engine thread held, one request waits (max_queue 1) and the next is refused with 429."""
    engine = Engine.from_loaded(tiny_lm)
    with served_studio(engine, RunLog(tmp_path / "runs.db"), api={"max_queue": 1}) as (_, port):
        gate = threading.Event()
        on_engine_thread_soon(gate.wait)  # the engine thread is busy until the gate opens
        try:
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(client_for(port).chat.completions.create, model=MODEL, messages=USER,
                                    max_tokens=2, temperature=0)
                _wait_for(lambda: _waiting(port) == 1)
                with pytest.raises(openai.RateLimitError) as err:
                    client_for(port).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
                assert err.value.code == "queue_full" and err.value.response.headers["retry-after"] == "1"
                gate.set()
                assert first.result(timeout=120).choices[0].finish_reason in ("stop", "length")
        finally:
            gate.set()


def test_a_model_that_cannot_load_answers_503_and_the_server_stays_up(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with served_api(Engine(model=missing, persist=False), RunLog(tmp_path / "runs.db")) as port:
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as err:
                client_for(port).chat.completions.create(model=missing, messages=USER, max_tokens=2)
            assert err.value.status_code == 503 and err.value.code == "model_unavailable"
            assert "does not exist" in err.value.message


def test_pml_studio_api_serves_the_same_routes_without_the_page(tiny_lm, tmp_path):
    """The headless app (what `pml-studio api` serves with uvicorn): the guard, the API, OpenAI's 404 elsewhere."""
    with served_api(Engine.from_loaded(tiny_lm), RunLog(tmp_path / "runs.db")) as port:
        client = client_for(port)
        assert [m.id for m in client.models.list().data] == [MODEL]
        got = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0)
        assert got.usage.completion_tokens >= 1 and got.model_extra["pml"]["run_id"] is not None
        page = httpx.get(f"http://127.0.0.1:{port}/", headers=AUTH)
        assert page.status_code == 404 and page.json()["error"]["code"] == "not_found"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401


def test_the_api_command_exists_with_its_options():
    from engine.cli import build_parser
    from studio.cli import EXTRA

    args = build_parser(EXTRA).parse_args(["api", "--default-arm", "cached", "--max-queue", "4"])
    assert (args.command, args.default_arm, args.max_queue, args.port) == ("api", "cached", 4, 8000)
    assert not hasattr(args, "share")


def _requests(port: int, status: str, endpoint: str = "/v1/chat/completions") -> float:
    """/metrics' count of ``endpoint``'s requests answered ``status``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    want = f'endpoint="{endpoint}"', f'status="{status}"'
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pml_api_requests_total{") and all(w in line for w in want))


def _waiting(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("pml_api_waiting "))


def _wait_for(ready, timeout: float = 60.0) -> None:
    """Poll ``ready()`` until it holds (a readiness wait, not a timing assertion)."""
    end = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)
