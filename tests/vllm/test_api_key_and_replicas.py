"""Two vLLM replicas behind vllm-router (tools/replicas.py), each requiring an API key, with the PML front before
them (docs/scale-out.md): the front's key reaches vLLM and a request without it is refused; the front's routing key
keeps a document set on one replica; one replica killed mid-answer: that answer ends in an error and is not run
again, the router moves the set to the other replica and the front serves on. Then two studio workers behind the
router share one module store. Run by ``make test-vllm`` (marker ``vllm``); named to run before the other vLLM
tests, so that its two replicas are stopped before their session's server starts (~3.7 GB each).
"""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import openai
import pytest

from engine.model import SMALL_MODEL
from tests.studio_fixtures import AUTH, TOKEN
from tests.vllm.test_front_vllm import chat, essays, front
from tools.replicas import ROUTER, kill, prompt_tokens, studio_fleet, vllm_fleet
from tools.vllm_serve import VLLM_PYTHON, ServeError

pytestmark = pytest.mark.vllm
KEY = "replica-key-" + secrets.token_hex(8)
SERVED = "default"  # tools/vllm_serve.py serves the tests' model under its packaged key


@pytest.fixture(scope="module")
def fleet():
    if not VLLM_PYTHON.exists() or not ROUTER.exists():
        pytest.skip("no vLLM or no router: run `make vllm router`")
    try:
        with vllm_fleet(2, "consistent_hash", SERVED, api_key=KEY) as started:
            yield started
    except ServeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def routed(fleet, tmp_path_factory):
    """The front before the router, with the replicas' key."""
    with front(fleet.url, SMALL_MODEL, tmp_path_factory.mktemp("front"), key=KEY) as (client, port, _):
        yield client, port


def test_the_upstream_key_reaches_vllm_and_a_request_without_it_is_refused(fleet, routed, tmp_path):
    replica = fleet.workers[0].url
    body = {"model": SERVED, "prompt": [1, 2, 3], "max_tokens": 1}
    assert httpx.post(f"{replica}/v1/completions", json=body, timeout=120).status_code == 401
    assert httpx.post(f"{replica}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    client, _ = routed  # the front with the key, through the router
    assert chat(client, SERVED, essays(secrets.token_hex(4), 2), "Which station logged reading 2?").choices
    with front(replica, SMALL_MODEL, tmp_path) as (keyless, _, _):  # the front without it: refused, said so
        with pytest.raises(openai.APIStatusError) as refused:
            chat(keyless, SERVED, essays(secrets.token_hex(4), 2), "Which station logged reading 2?")
    assert refused.value.status_code in (502, 503) and KEY not in str(refused.value.body)


def test_the_fronts_key_keeps_a_document_set_on_one_replica(fleet, routed):
    client, _ = routed
    docs = essays(secrets.token_hex(4))
    before = prompt_tokens(fleet.workers)
    chat(client, SERVED, docs, "Which station logged reading 7?")
    again = chat(client, SERVED, docs[::-1], "Which station logged reading 9?")  # another order and question
    after = prompt_tokens(fleet.workers)
    grew = [b != a for a, b in zip(before, after)]
    assert grew.count(True) == 1  # one replica prefilled both
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * again.usage.prompt_tokens - 128


def test_a_replica_killed_mid_answer_the_router_moves_its_set_and_nothing_is_answered_twice(fleet, routed):
    client, _ = routed
    docs = essays(secrets.token_hex(4))
    before = prompt_tokens(fleet.workers)
    chat(client, SERVED, docs, "Which station logged reading 1?", max_tokens=2)
    owner = next(i for i, (a, b) in enumerate(zip(before, prompt_tokens(fleet.workers))) if b != a)
    survivor = 1 - owner
    seen, ended = [], {}

    def long_answer():
        try:
            stream = chat(client, SERVED, docs, "Repeat every report word for word.", max_tokens=400, stream=True)
            for chunk in stream:
                seen.append(chunk)
            ended["finished"] = True
        except openai.APIError as err:  # the front ends a broken stream with OpenAI's error object
            ended["error"] = err

    asking = threading.Thread(target=long_answer)
    asking.start()
    until = time.monotonic() + 300
    while not seen and asking.is_alive() and time.monotonic() < until:
        time.sleep(0.01)
    alive_before = prompt_tokens(fleet.workers)[survivor]
    kill(fleet.workers[owner])
    asking.join(300)
    assert "error" in ended and "finished" not in ended, ended  # what the client sees: its answer broke off
    assert prompt_tokens(fleet.workers)[survivor] == alive_before  # and it was not run again elsewhere
    for question in ("Which station logged reading 4?", "Which station logged reading 5?"):  # the front serves on
        answer = chat(client, SERVED, docs, question)
        assert answer.choices[0].message.content is not None
    assert prompt_tokens(fleet.workers)[survivor] > alive_before and answer.usage.prompt_tokens_details.cached_tokens > 0


def test_two_studio_workers_behind_the_router_reuse_each_others_encodings(tmp_path):
    if not ROUTER.exists():
        pytest.skip("no router: run `make router`")
    docs = essays(secrets.token_hex(4), 2)
    with studio_fleet(2, "round_robin", tmp_path / "modules", TOKEN, SMALL_MODEL) as fleet:
        answers = []
        for question in ("Which station logged reading 1?", "Which station logged reading 2?"):  # one each
            body = {"model": SMALL_MODEL, "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": [
                *({"type": "text", "text": d} for d in docs), {"type": "text", "text": question}]}]}
            got = httpx.post(f"{fleet.url}/v1/chat/completions", json=body, headers=AUTH, timeout=300)
            assert got.status_code == 200, got.text
            answers.append(got.json()["pml"])
    assert answers[0]["modules_encoded"] == 2 and answers[1]["modules_encoded"] == 0
    assert answers[1]["modules_reused"] == 2
