"""A request's body is parsed as JSON once (by ApiRoute, which also refuses what it cannot read) and validated
from that value, with FastAPI's words: the errors a client reads are those FastAPI's own body parsing gave."""

from __future__ import annotations

import json

import pytest
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from studio.api.errors import ApiError
from studio.api.metrics import Metrics
from studio.api.routes import ApiRoute, create_api

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


class Refusing:
    """A service that answers every valid request with a 418 naming its Work: the routes alone are tested."""

    arms, default_arm, max_tokens_cap, metrics = ("baseline", "cached"), "cached", 100, None

    async def ready(self):
        pass

    def model_ids(self):
        return ("tiny",)

    def submit(self, work, loop):
        raise ApiError(418, f"taken: {work.endpoint} {work.arm} {work.max_tokens}", code="taken")


async def studio(scope, receive, send):
    await PlainTextResponse("the studio")(scope, receive, send)


def client(routed: bool = True) -> TestClient:
    api = create_api(Refusing(), Metrics())
    return TestClient(ApiRoute(studio, api) if routed else api)


def test_a_body_is_parsed_once(monkeypatch):
    body = json.dumps({**CHAT, "max_tokens": 7}).encode()
    seen: list = []
    plain = json.loads

    def counting(text, *args, **kw):
        seen.append(text)
        return plain(text, *args, **kw)

    monkeypatch.setattr(json, "loads", counting)
    answer = client().post("/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert (answer.status_code, answer.json()["error"]["message"]) == (418, "taken: chat cached 7")
    assert sum(text in (body, body.decode()) for text in seen) == 1


# (body, status, message): what FastAPI's body parsing answered before the routes validated the parsed value
REFUSED = [
    (b"", 422, "the body: Field required"),
    (b"null", 422, "the body: Input should be a valid dictionary or object to extract fields from"),
    (b'["x"]', 422, "the body: Input should be a valid dictionary or object to extract fields from"),
    (b"{}", 422, "model: Field required"),
    (json.dumps({**CHAT, "frob": 1}).encode(), 400, "unrecognized request argument supplied: frob"),
    (json.dumps({**CHAT, "temperature": "x"}).encode(), 422, "temperature: expected a number, got 'x'"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": 5}]}).encode(), 422,
     "messages[0].content: expected str or list[ContentPart], got 5"),
    (json.dumps({**CHAT, "pml": {"x": 1}}).encode(), 400, "unrecognized request argument supplied: pml.x"),
]


@pytest.mark.parametrize("routed", [True, False])
@pytest.mark.parametrize("body,status,message", REFUSED)
def test_refusals_read_as_fastapi_wrote_them(body, status, message, routed):
    """Through ApiRoute (as served) and from the API app alone (it parses the body itself then)."""
    answer = client(routed).post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert (answer.status_code, answer.json()["error"]["message"]) == (status, message)


def test_a_completion_is_validated_from_the_parsed_body():
    ok = client().post("/v1/completions", content=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3}))
    assert (ok.status_code, ok.json()["error"]["message"]) == (418, "taken: completion cached 3")
    bad = client().post("/v1/completions", content=b'{"model": "tiny", "prompt": 5}')
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "prompt"
