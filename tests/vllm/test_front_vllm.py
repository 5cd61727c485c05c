"""The PML front (``pml-studio api --upstream URL``) in front of a real vLLM server: the official openai client,
streamed and not, transparent and explicit PML; two fronts started apart share vLLM's prefix cache; a vLLM that
stops answering is an OpenAI error and the front serves on. Run by ``make test-vllm`` (marker ``vllm``).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from engine.model import SMALL_MODEL
from engine.model.packaged import find_packaged
from engine.session import Engine
from tests.conftest import ROOT, free_port
from tests.studio_fixtures import AUTH, TOKEN, TRAVEL_PROMPT

pytestmark = pytest.mark.vllm
START_S = 180  # a front's start: imports and the tokenizer (a readiness wait, not a timing assertion)


@pytest.fixture(scope="module")
def local_model(vllm_server) -> str:
    """The studio's model that the upstream serves (the front checks their tokenizers agree at its start)."""
    return vllm_server.model if find_packaged(vllm_server.model) else SMALL_MODEL


@contextmanager
def front(upstream: str, model: str, tmp_path, key: str | None = None):
    """``pml-studio api --upstream`` as a user starts it, on a free port (``key``: the upstream's API key, as
    $PML_UPSTREAM_API_KEY); yields (openai client, port, process); terminated in every exit path."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PML_UPSTREAM_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "studio.cli", "api", "--upstream", upstream, "--model", model,
                             "--port", str(port), "--db", str(tmp_path / f"front-{port}.db")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "PML_STUDIO_TOKEN": TOKEN, **({"PML_UPSTREAM_API_KEY": key} if key else {})})
    try:
        end = time.monotonic() + START_S
        while not _answers(port):
            assert proc.poll() is None, f"the front exited: {proc.communicate()[0]}"
            assert time.monotonic() < end, "the front did not start"
            time.sleep(0.2)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=600), \
            port, proc
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def served(vllm_server, local_model, tmp_path_factory):
    with front(vllm_server.url, local_model, tmp_path_factory.mktemp("front")) as (client, port, _):
        yield client, port


BLOCK = 128  # vLLM's CPU build caches whole blocks of 128 tokens (16 on GPUs): at most 127 tokens go uncached


def essays(tag: str, n: int = 3, readings: int = 12) -> list[str]:
    """Documents no earlier run sent (``tag`` is fresh) of ~20 tokens a reading, long enough to be modules."""
    return [f"Report {tag}-{k}: " + " ".join(f"Station {tag}-{k} logged reading {i} of the river gauge at dawn."
                                             for i in range(readings)) for k in range(n)]


def chat(client, model: str, docs, question: str, **kw):
    content = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": question}]
    return client.chat.completions.create(
        model=model, max_tokens=kw.pop("max_tokens", 12), temperature=0,
        messages=[{"role": "system", "content": "Answer from the reports."}, {"role": "user", "content": content}],
        **kw)


def streamed(stream) -> tuple[str, object]:
    chunks = list(stream)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


def test_the_official_client_through_the_front_streamed_and_not(served, vllm_server):
    client, _ = served
    docs = essays(secrets.token_hex(4))
    whole = chat(client, vllm_server.model, docs, "Which station logged reading 7?")
    text, usage = streamed(chat(client, vllm_server.model, docs[::-1], "Which station logged reading 7?",
                                stream=True, stream_options={"include_usage": True}))
    assert whole.choices[0].message.content and text == whole.choices[0].message.content  # greedy, the same ids
    assert whole.model_extra["pml"]["mode"] == "transparent" and whole.model_extra["pml"]["arm"] == "vllm"
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > usage.prompt_tokens - BLOCK  # the second sight


def test_explicit_pml_answers_as_vllm_answers_the_baselines_ids(served, vllm_server, local_model):
    """The front's answer equals vLLM's own answer to the ids the baseline arm prefills for that PML."""
    client, _ = served
    schema = (ROOT / "sample_schemas" / "travel.xml").read_text()
    ids = Engine(model=local_model, persist=False).prepare(schema, TRAVEL_PROMPT).plan.token_ids
    direct = httpx.post(f"{vllm_server.url}/v1/completions", timeout=600, json={
        "model": vllm_server.model, "prompt": ids, "max_tokens": 16, "temperature": 0}).json()
    ask = dict(model=vllm_server.model, max_tokens=16, temperature=0, messages=[{"role": "user", "content": "-"}],
               extra_body={"pml": {"schema": schema, "prompt": TRAVEL_PROMPT}})
    whole = client.chat.completions.create(**ask)
    text, _ = streamed(client.chat.completions.create(stream=True, **ask))
    assert whole.choices[0].message.content == text == direct["choices"][0]["text"]
    assert whole.usage.prompt_tokens == len(ids) == direct["usage"]["prompt_tokens"]


def test_line_separators_in_vllms_answer_are_text(served, vllm_server):
    """A real vLLM streams U+2028 as its raw bytes (it gave a 502: the reader split lines on it). Few-shot turns
    make the model answer with it; streamed and not, the answer holds it, as vLLM's own does."""
    client, _ = served
    turns = []
    for word in ("cat", "dog", "sun", "map", "red"):
        turns += [{"role": "user", "content": word}, {"role": "assistant", "content": f"{word}\u2028{word}"}]
    turns.append({"role": "user", "content": "box"})
    whole = client.chat.completions.create(model=vllm_server.model, messages=turns, max_tokens=8, temperature=0)
    text, _ = streamed(client.chat.completions.create(model=vllm_server.model, messages=turns, max_tokens=8,
                                                      temperature=0, stream=True))
    assert "\u2028" in whole.choices[0].message.content and text == whole.choices[0].message.content


def test_completions_through_the_front(served, vllm_server):
    client, _ = served
    docs = essays(secrets.token_hex(4), 2)
    prompt = " # # ".join(docs + ["Question: which station logged reading 3?"])
    whole = client.completions.create(model=vllm_server.model, prompt=prompt, max_tokens=8, temperature=0)
    stream = client.completions.create(model=vllm_server.model, prompt=prompt, max_tokens=8, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    assert whole.object == "text_completion" and whole.usage.completion_tokens >= 1


def test_two_fronts_started_apart_share_vllms_prefix_cache(served, vllm_server, local_model, tmp_path):
    client, _ = served
    docs = essays(secrets.token_hex(4), readings=36)  # ~1,900 tokens: one block uncached is under 7 %
    first = chat(client, vllm_server.model, docs, "Which station logged reading 2?")
    assert first.usage.prompt_tokens_details.cached_tokens < 0.5 * first.usage.prompt_tokens  # new documents
    with front(vllm_server.url, local_model, tmp_path) as (second, _, _):
        again = chat(second, vllm_server.model, [docs[1], docs[2], docs[0]], "Which station logged reading 2?")
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * again.usage.prompt_tokens


def test_a_vllm_that_stops_answering_is_an_openai_error_and_the_front_serves_on(vllm_server, local_model, tmp_path):
    """The front reaches vLLM through a relay; closing the relay is vLLM gone (connection refused), reopening it
    vLLM back. The session's vLLM itself is shared with other tests, so it is not killed here."""
    with Relay(vllm_server.url) as relay, front(relay.url, local_model, tmp_path) as (client, port, proc):
        assert chat(client, vllm_server.model, ["-"], "Say yes.", max_tokens=2).choices[0].message.content
        relay.close()
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as err:
                reply = chat(client, vllm_server.model, ["-"], "Say yes.", max_tokens=2, stream=stream)
                list(reply) if stream else reply
            assert err.value.status_code == 503 and err.value.code == "upstream_unavailable"
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).status_code == 200
        relay.open()
        assert chat(client, vllm_server.model, ["-"], "Say yes.", max_tokens=2).choices[0].message.content
        assert proc.poll() is None


def test_vllms_refusal_is_read_as_an_openai_error(vllm_server):
    """vLLM's own error body (a prompt longer than its context) read as the front passes it on."""
    from studio.api.upstream import refusal

    resp = httpx.post(f"{vllm_server.url}/v1/completions", timeout=60,
                      json={"model": vllm_server.model, "prompt": [1] * 10, "max_tokens": 10 ** 6})
    err = refusal(resp.status_code, resp.content, vllm_server.url)
    assert resp.status_code == err.status == 400 and err.message.startswith("upstream: ") and len(err.message) > 20


class Relay:
    """A TCP relay on a free port of 127.0.0.1 to ``url``'s host and port, closed and opened again on demand."""

    def __init__(self, url: str):
        host, port = url.split("//")[1].split(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def open(self) -> None:
        self._server = socket.create_server(("127.0.0.1", self.port), reuse_port=True)
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def close(self) -> None:
        for s in [self._server, *self._conns]:  # shutdown first: close() alone leaves a blocked accept() listening
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._conns = []

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc):
        self.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _answers(port: int) -> bool:
    """The front listens (its upstream may refuse it: each request then says why)."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
