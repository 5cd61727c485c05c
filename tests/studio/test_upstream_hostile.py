"""The API's front against an upstream that misbehaves (tests/hostile_upstream.py): whatever it sends, the front's
memory stays bounded, every request ends within its deadline with an OpenAI-shaped error, a client that leaves
frees its place at once, and the next ordinary request is answered as usual. Clients: the official openai package,
and httpx where a client must give up early.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.run.remote import Limits
from engine.session import Engine
from studio.api.upstream import UpstreamOptions
from tests import hostile_upstream as hostile
from tests.studio_fixtures import AUTH, TOKEN, served_api
from tests.studio.test_api_upstream import SERVED, engine, standin  # noqa: F401  (its module fixtures)
from tests.upstream_standin import StandIn
LIMITS = Limits(idle_s=2.0, answer_s=8.0, check_s=2.0)  # short deadlines, so that a stalled upstream costs seconds
MAX_GROWTH = 256 << 20  # what an upstream's answer may add to the front's resident memory
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def port(engine, standin):
    with served_api(engine, None, upstream=UpstreamOptions(standin.url, limits=LIMITS)) as port:
        yield port


@pytest.fixture
def hostile_answer(standin):
    """``answer(path, fn)``: the stand-in answers ``path`` with ``fn`` for this test only."""
    yield lambda path, fn: standin.answer.__setitem__(path, fn)
    standin.answer.clear()


def client_for(port: int, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=timeout)


def post(port: int, stream: bool = False, timeout: float = 30, **kw) -> httpx.Response:
    body = {"model": SERVED, "messages": USER, "max_tokens": 4, "temperature": 0, "stream": stream, **kw}
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=AUTH, timeout=timeout)


def stream_error(response: httpx.Response) -> dict | None:
    """A stream's error event (the stream had begun), or a refusal's body."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json().get("error")
    for line in response.text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            import json
            return json.loads(line[6:])["error"]
    return None


def assert_serves_on(port: int, standin: StandIn) -> None:
    standin.answer.clear()
    answer = client_for(port).chat.completions.create(model=SERVED, messages=USER, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content == "".join(standin.reply)


# ----------------------------------------------------------------------------------------------
# Memory and deadlines (items 1, 3, 5 of issue 71; its second "what must hold" line)
# ----------------------------------------------------------------------------------------------

HOSTILE = {
    "a gzip bomb of one line": (hostile.gzip_bomb(), 502, "upstream_error", "longer than"),
    "a plain 512 MB line": (hostile.long_line(), 502, "upstream_error", "longer than"),
    "an endless stream": (hostile.endless, 502, "upstream_error", "more than the 4 tokens asked for"),
    "1 byte every 3 s": (hostile.trickle(3.0), 504, "upstream_timeout", "did not answer within 2 s"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("stream", [False, True])
def test_whatever_an_upstream_sends_costs_bounded_memory_and_ends_in_time(port, standin, hostile_answer, case,
                                                                          stream):
    fn, status, code, said = HOSTILE[case]
    hostile_answer("/v1/completions", fn)
    started = time.monotonic()
    with hostile.peak_growth() as growth:
        response = post(port, stream=stream)
    took = time.monotonic() - started
    error = stream_error(response)
    assert error is not None and error["code"] == code and said in error["message"], response.text[:500]
    assert response.status_code in ((200, status) if stream else (status,))  # 200: the stream had begun
    assert growth[0] < MAX_GROWTH, f"{case}: the front grew by {growth[0] / 2**20:.0f} MB"
    assert took < LIMITS.answer_s + 5, f"{case}: the request took {took:.1f} s, past its deadline"
    assert_serves_on(port, standin)


def test_the_upstreams_json_answers_are_bounded_too(engine):
    """/v1/models and /tokenize, read whole: a gzip bomb or a 512 MB body there is refused at the limit."""
    for path, fn in [("/v1/models", hostile.gzip_bomb(line=False, kind="application/json")),
                     ("/v1/models", hostile.long_line()),
                     ("/tokenize", hostile.gzip_bomb(line=False, kind="application/json"))]:
        with StandIn(engine.codec.encode, SERVED) as upstream:
            upstream.answer[path] = fn
            with served_api(engine, None, upstream=UpstreamOptions(upstream.url, limits=LIMITS)) as port, \
                    hostile.peak_growth() as growth:
                response = post(port)
            assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error", \
                response.text[:300]
            assert growth[0] < MAX_GROWTH, f"{path}: the front grew by {growth[0] / 2**20:.0f} MB"


def test_clients_that_leave_a_stalled_upstream_free_their_places_at_once(port, standin, hostile_answer):
    """16 clients (the queue's size) give up after 1 s on an upstream that sent headers and one comment: their
    upstream connections close, and the next request is served, not told the queue is full."""
    stall = hostile.Stall()
    hostile_answer("/v1/completions", stall)

    def leave(_):
        try:
            post(port, stream=True, timeout=1.0)
        except httpx.TimeoutException:
            return "left"
        return "answered"

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(leave, range(16))) == ["left"] * 16
    left = time.monotonic()
    standin.answer.clear()
    answer = post(port, timeout=10)
    assert answer.status_code == 200, answer.text[:300]
    assert time.monotonic() - left < 5
    end = time.monotonic() + 5
    while stall.closed < stall.started and time.monotonic() < end:  # a readiness wait: the stand-in sees each close
        time.sleep(0.05)
    # a client that left before its request was rendered and sent never reached the upstream
    assert 0 < stall.started == stall.closed <= 16


def test_waiting_for_an_upstream_that_does_not_answer_counts_in_the_queue(engine):
    """While /v1/models stalls, requests past --max-queue are told 429 at once; the others share one check and are
    all answered 504 at its deadline, together (not one check after another)."""
    stall = hostile.Stall()
    with StandIn(engine.codec.encode, SERVED) as upstream:
        upstream.answer["/v1/models"] = stall
        options = UpstreamOptions(upstream.url, limits=LIMITS)
        with served_api(engine, None, upstream=options, max_queue=4) as port:
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda _: (post(port, timeout=30), time.monotonic() - started), range(8)))
    statuses = sorted(r.status_code for r, _ in answers)
    assert statuses == [429] * 4 + [504] * 4, [r.text[:200] for r, _ in answers]
    assert all(r.json()["error"]["code"] in ("queue_full", "upstream_timeout") for r, _ in answers)
    assert max(t for _, t in answers) < LIMITS.check_s + 5
    assert stall.started == 1  # one check, shared


def test_a_start_does_not_wait_past_the_checks_deadline(engine):
    from studio.api.serve import check_upstream

    with StandIn(engine.codec.encode, SERVED) as upstream:
        upstream.answer["/v1/models"] = hostile.trickle(0.5)
        started = time.monotonic()
        line = check_upstream(UpstreamOptions(upstream.url, limits=LIMITS), engine.codec)
        assert time.monotonic() - started < LIMITS.check_s + 3
    assert "within 2 s" in line and "answered 503 until it does" in line


# ----------------------------------------------------------------------------------------------
# What an upstream's answer holds (items 4, 5 and 8)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_line_separators_inside_the_text_are_text(port, standin, hostile_answer, stream):
    """A real vLLM streams U+2028 and U+0085 as their raw bytes; SSE ends lines at CR and LF only."""
    hostile_answer("/v1/completions", hostile.events(hostile.text("x\u2028y"), hostile.text("\u0085z"),
                                                     lambda body: [hostile.usage(body, 2)]))
    reply = client_for(port).chat.completions.create(model=SERVED, messages=USER, max_tokens=4, temperature=0,
                                                     stream=stream)
    got = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else \
        reply.choices[0].message.content
    assert got == "x\u2028y\u0085z"


def test_tokens_past_max_tokens_are_not_read(port, standin, hostile_answer):
    """8,000 pieces for max_tokens 5: the front stops at the sixth, at once (it read 28,000 in 277 s of CPU)."""
    hostile_answer("/v1/completions", hostile.events(*[hostile.text("p" * 2048)] * 8000))
    with pytest.raises(openai.APIStatusError) as err:
        client_for(port).chat.completions.create(model=SERVED, messages=USER, max_tokens=5, temperature=0)
    assert err.value.status_code == 502 and "more than the 5 tokens asked for" in err.value.message


def test_the_front_cuts_the_stop_string_the_upstream_keeps(port, standin, hostile_answer):
    """The request asks the upstream to keep stop strings in its text (one rule for every client of a server:
    engine/run/remote.py); the front cuts them, streamed or not."""
    hostile_answer("/v1/completions", hostile.events(hostile.text("one, t"), hostile.text("wo. END"),
                                                     hostile.text(" after"), lambda body: [hostile.usage(body, 3)]))
    client = client_for(port)
    whole = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=4, temperature=0, stop=["END"])
    assert whole.choices[0].message.content == "one, two. " and whole.choices[0].finish_reason == "stop"
    assert standin.sent[-1]["include_stop_str_in_output"] is True and standin.sent[-1]["stop"] == ["END"]
    chunks = list(client.chat.completions.create(model=SERVED, messages=USER, max_tokens=4, temperature=0,
                                                 stop=["END"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one, two. "


BAD = {
    "choices a string": lambda body: [{"choices": "abc"}],
    "text a number": lambda body: [{"choices": [{"text": 123}]}],
    "finish_reason a number": lambda body: [{"choices": [{"text": "a", "finish_reason": 5}]}],
    "usage a list": lambda body: [{"choices": [], "usage": [1, 2]}],
    "usage a string": lambda body: [{"choices": [], "usage": "many"}],
    "usage negative": lambda body: [{**hostile.usage(body), "usage": {"prompt_tokens": -5, "completion_tokens": 1}}],
    "usage 1e30": lambda body: [{**hostile.usage(body), "usage": {"prompt_tokens": 1e30, "completion_tokens": 1}}],
    "cached past the prompt": lambda body: [hostile.usage(body, 1, cached=5000)],
    "another prompt count": lambda body: [{"choices": [], "usage": {"prompt_tokens": len(body["prompt"]) + 7,
                                                                     "completion_tokens": 1}}],
}


@pytest.mark.parametrize("case", list(BAD))
def test_fields_of_the_wrong_type_or_range_are_a_502(port, standin, hostile_answer, case):
    hostile_answer("/v1/completions", hostile.events(hostile.text("a"), BAD[case]))
    response = post(port)
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error", response.text[:300]
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    counts = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("pml_api_prompt_tokens_total", "pml_api_cached_tokens_total"))]
    assert all(math.isfinite(n) and 0 <= n < 1e6 for n in counts)
    assert_serves_on(port, standin)


@pytest.mark.parametrize("case", ["NaN", "Infinity"])
def test_json_that_is_not_a_number_is_a_502(port, standin, hostile_answer, case):
    raw = f'data: {{"choices": [], "usage": {{"prompt_tokens": {case}, "completion_tokens": 1}}}}\n\n'.encode()
    hostile_answer("/v1/completions", hostile.events(hostile.text("a"), raw=raw))
    response = post(port)
    assert response.status_code == 502 and "not JSON" in response.json()["error"]["message"], response.text[:300]


@pytest.mark.parametrize("code,extra,status", [(302, {}, 502), (307, {"Location": "http://127.0.0.1:9/v1"}, 502),
                                               (999, {}, 502), (418, {}, 502), (401, {}, 502)])
def test_an_upstream_status_a_client_cannot_act_on_is_a_502(port, standin, hostile_answer, code, extra, status):
    hostile_answer("/v1/completions", hostile.status(code, extra))
    response = post(port)
    assert response.status_code == status and response.json()["error"]["type"] == "server_error", response.text
    assert "Location" not in response.headers
    if code == 401:
        assert response.json()["error"]["code"] == "upstream_auth" and "--upstream-key" in response.text
    assert_serves_on(port, standin)


def test_a_redirect_from_the_upstream_is_never_followed(engine):
    """The upstream's /v1/models and /v1/completions answer 302 to another server: nothing reaches it."""
    with StandIn(engine.codec.encode, "elsewhere") as other, StandIn(engine.codec.encode, SERVED) as upstream:
        reached = []
        other.answer["/v1/models?ssrf=1"] = lambda h, body: reached.append(h.path)
        upstream.answer["/v1/models"] = hostile.status(302, {"Location": f"{other.url}/v1/models?ssrf=1"})
        with served_api(engine, None, upstream=UpstreamOptions(upstream.url, limits=LIMITS)) as port:
            response = post(port)
        assert response.status_code == 502 and "redirect" in response.json()["error"]["message"], response.text
        assert reached == [] and other.sent == []


def test_a_max_model_len_that_is_not_a_number_is_refused_at_the_check(engine):
    with StandIn(engine.codec.encode, SERVED) as upstream:
        upstream.answer["/v1/models"] = hostile.json_answer({"data": [{"id": SERVED, "max_model_len": "abc"}]})
        with served_api(engine, None, upstream=UpstreamOptions(upstream.url, limits=LIMITS)) as port:
            response = post(port)
        assert response.status_code == 502 and "max_model_len" in response.json()["error"]["message"]
        upstream.answer.clear()
        with served_api(engine, None, upstream=UpstreamOptions(upstream.url, limits=LIMITS)) as port:
            assert post(port).status_code == 200


def test_the_upstream_key_is_sent_and_the_clients_token_is_not(engine):
    with StandIn(engine.codec.encode, SERVED) as upstream:
        options = UpstreamOptions(upstream.url, api_key="upstream-secret-1234", limits=LIMITS)
        with served_api(engine, None, upstream=options) as port:
            assert post(port).status_code == 200
        sent = {k.lower(): v for k, v in upstream.headers[-1].items()}
        assert sent.get("authorization") == "Bearer upstream-secret-1234"
        assert TOKEN not in str(sent)
        assert "upstream-secret-1234" not in repr(options)


def test_the_local_apis_vllm_arm_that_cannot_run_is_an_error_not_an_empty_answer(tiny_lm, tmp_path, monkeypatch):
    """``pml.arm: "vllm"`` on the local API: no server given is a 400 saying where to give one; a server that
    refuses is a 502 with its words; neither is an empty 200, and neither is logged as a run."""
    from engine.runlog import RunLog

    engine, log = Engine.from_loaded(tiny_lm), RunLog(tmp_path / "runs.db")
    body = {"model": "tiny-llama", "messages": USER, "max_tokens": 2, "pml": {"arm": "vllm"}}
    monkeypatch.delenv("PML_VLLM_URL", raising=False)
    with served_api(engine, log) as port, \
            StandIn(lambda text: tiny_lm.tokenizer.encode(text, add_special_tokens=False), "served") as upstream:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        none = httpx.post(url, json=body, headers=AUTH, timeout=60)
        assert none.status_code == 400 and none.json()["error"]["code"] == "arm_unavailable", none.text
        assert "PML_VLLM_URL" in none.json()["error"]["message"]
        monkeypatch.setenv("PML_VLLM_URL", upstream.url)
        upstream.refuse = (400, {"error": {"message": "This model's maximum context length is 8 tokens",
                                           "type": "BadRequestError", "code": 400}})
        refused = httpx.post(url, json=body, headers=AUTH, timeout=60)
        assert refused.status_code == 502 and refused.json()["error"]["code"] == "upstream_error", refused.text
        assert "HTTP 400" in refused.json()["error"]["message"] and "maximum context length" in refused.text
    assert log.count() == 0
