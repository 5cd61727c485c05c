"""The vLLM server a front forwards to (``--upstream URL``): what it serves, checked once against the local
tokenizer, and its ``/v1/completions`` read as a stream of :class:`Piece` values.

The front sends token ids, so the upstream must tokenize as the front does: at the first contact the front asks
``/tokenize`` for a probe text's ids and refuses the upstream when they differ from its own tokenizer's.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator

import httpx

from engine.run.sse import DONE, EventError, data_of

from .errors import SERVER, ApiError

# Chat tags, digits, accents, CJK and an emoji: tokenizers that differ anywhere differ here.
PROBE = "<|im_start|>user\nProbe 1234 — naïve café, 東京, ✓ 🙂\tdone.<|im_end|>\n"
CONNECT_S, READ_S = 5.0, 300.0  # a long prefill on a CPU may send nothing for minutes
MAX_ERROR_BYTES = 64 << 10  # an upstream's error body is read this far
MAX_STREAM_BYTES = 64 << 20  # one answer's events, all together


@dataclass(frozen=True)
class Served:
    """What the upstream serves, learnt from ``/v1/models``."""

    url: str  # base, no /v1
    model: str  # its served model name: the ``model`` of every forwarded request
    max_model_len: int | None


@dataclass(frozen=True)
class Piece:
    """One event of an upstream answer: a text delta, then (last) why it finished and its usage."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None  # vLLM's usage: prompt_tokens, completion_tokens, prompt_tokens_details


class UpstreamError(Exception):
    """The upstream cannot be used (it does not answer, or tokenizes otherwise): one line that says why."""


class Upstream:
    """A vLLM server's OpenAI routes. Holds no per-request state: any number of fronts may share one."""

    def __init__(self, url: str, encode, client: httpx.AsyncClient | None = None):
        """``encode``: the local tokenizer's text -> ids, checked against the upstream's."""
        self.url = url.rstrip("/").removesuffix("/v1")
        self.encode = encode
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(READ_S, connect=CONNECT_S))
        self.served: Served | None = None
        self.refused: str = ""  # why the upstream cannot serve this front (a tokenizer mismatch): final
        self._lock = asyncio.Lock()

    async def ready(self) -> Served:
        """What the upstream serves, checked once; a 503 while it does not answer or cannot serve this front."""
        if self.served is not None:
            return self.served
        if self.refused:
            raise ApiError(503, self.refused, type=SERVER, code="upstream_mismatch")
        async with self._lock:
            if self.served is None:
                try:
                    self.served = await self._check()
                except UpstreamError as err:
                    code = "upstream_mismatch" if self.refused else "upstream_unavailable"
                    raise ApiError(503, str(err), type=SERVER, code=code) from None
        return self.served

    async def complete(self, body: dict) -> AsyncIterator[Piece]:
        """``body`` streamed from ``/v1/completions``: its text deltas, then its finish and usage. A refusal is the
        upstream's own status and error; a failure to answer is a 502, 503 or 504 (:func:`unreachable`)."""
        url = f"{self.url}/v1/completions"
        try:
            async with self.client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raise refusal(resp.status_code, await _bounded(resp, MAX_ERROR_BYTES), self.url)
                async for piece in _pieces(resp, self.url):
                    yield piece
        except httpx.HTTPError as err:
            raise unreachable(err, self.url) from None

    async def _check(self) -> Served:
        served = await self._models()
        try:
            resp = await self.client.post(f"{self.url}/tokenize", timeout=CONNECT_S * 6,
                                          json={"model": served.model, "prompt": PROBE, "add_special_tokens": False})
            theirs = resp.json().get("tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as err:
            raise UpstreamError(f"the upstream {self.url} did not answer /tokenize ({_why(err)}); it must be a "
                                "vLLM OpenAI server") from None
        ours = list(self.encode(PROBE))
        if theirs != ours:
            self.refused = (f"the upstream {self.url} serves '{served.model}', whose tokenizer differs from this "
                            f"front's (a probe text gave {_ids(theirs)} there, {_ids(ours)} here); start the front "
                            "with --model naming the model the upstream serves")
            raise UpstreamError(self.refused)
        return served

    async def _models(self) -> Served:
        try:
            resp = await self.client.get(f"{self.url}/v1/models", timeout=CONNECT_S * 2)
            cards = resp.json().get("data") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as err:
            raise UpstreamError(f"the upstream {self.url} does not answer /v1/models ({_why(err)}); start it, or "
                                "check --upstream") from None
        if not cards:
            raise UpstreamError(f"the upstream {self.url} lists no model at /v1/models (HTTP {resp.status_code}); "
                                "it must be a vLLM OpenAI server")
        card = cards[0]
        return Served(self.url, str(card.get("id")), card.get("max_model_len"))

    async def aclose(self) -> None:
        await self.client.aclose()


def refusal(status: int, body: bytes, url: str) -> ApiError:
    """The upstream's refusal as this API's error: its status, and its OpenAI error's message, type, param and
    code (vLLM nests them under ``error``; older servers did not)."""
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else {}
        message = err.get("message") if isinstance(err, dict) else None
    except ValueError:
        err, message = {}, None
    if not isinstance(message, str):
        text = body.decode("utf-8", "replace").strip()[:500] or "no body"
        return ApiError(502 if status < 400 else status, f"the upstream {url} answered HTTP {status}: {text}",
                        type=SERVER if status >= 500 else "invalid_request_error", code="upstream_error")
    kind = err.get("type") if isinstance(err.get("type"), str) else SERVER if status >= 500 else "invalid_request_error"
    return ApiError(status, f"upstream: {message}", type=kind, param=err.get("param"), code=err.get("code"))


def unreachable(err: httpx.HTTPError, url: str) -> ApiError:
    """503 when the upstream cannot be reached, 504 when it stopped answering in time, 502 when its answer broke."""
    if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
        return ApiError(503, f"the upstream {url} is not answering ({_why(err)}); start it, or check --upstream",
                        type=SERVER, code="upstream_unavailable")
    if isinstance(err, httpx.TimeoutException):
        return ApiError(504, f"the upstream {url} sent nothing for {READ_S:g} s", type=SERVER,
                        code="upstream_timeout")
    return ApiError(502, f"the upstream {url} broke off its answer ({_why(err)})", type=SERVER, code="upstream_error")


async def _pieces(resp: httpx.Response, url: str) -> AsyncIterator[Piece]:
    """The SSE ``data:`` events of a streamed completion, as pieces; an error event is raised as an ApiError."""
    read = 0
    async for line in resp.aiter_lines():
        read += len(line) + 1
        if read > MAX_STREAM_BYTES:
            raise ApiError(502, f"the upstream {url} sent more than {MAX_STREAM_BYTES} bytes for one answer",
                           type=SERVER, code="upstream_error")
        try:
            event = data_of(line)
        except EventError as err:
            if err.event is not None:
                raise refusal(500, err.data.encode(), url) from None
            raise ApiError(502, f"the upstream {url} sent an event that is {err}", type=SERVER,
                           code="upstream_error") from None
        if event == DONE:
            return
        if event is None:
            continue
        choice = (event.get("choices") or [{}])[0]
        yield Piece(choice.get("text") or "", choice.get("finish_reason"), event.get("usage"))
    raise ApiError(502, f"the upstream {url} ended its stream without [DONE]", type=SERVER, code="upstream_error")


async def _bounded(resp: httpx.Response, limit: int) -> bytes:
    out = b""
    async for chunk in resp.aiter_bytes():
        out += chunk
        if len(out) >= limit:
            break
    return out[:limit]


def _why(err: Exception) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _ids(ids) -> str:
    return "nothing" if ids is None else str(ids[:12])[:-1] + (", ...]" if len(ids) > 12 else "]")
