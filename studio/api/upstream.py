"""The vLLM server a front forwards to (``--upstream URL``), reached through the one remote client
(engine/run/remote.py: its limits, deadlines and checks): checked once — what it serves, its tokenizer against the
front's — by one check that every waiting request shares, and its failures as this API's OpenAI-shaped errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.public import Card, End, Limits, Piece, Remote, RemoteError, error_fields

from .errors import INVALID, SERVER, ApiError

PASSED = {400, 408, 409, 413, 422, 429, 500, 502, 503, 504}  # an upstream's statuses a client may see as they are
KEY_ENV = "PML_UPSTREAM_API_KEY"  # the upstream's API key when --upstream-key is not given


@dataclass(frozen=True)
class UpstreamOptions:
    """Where the front forwards: the server's URL, its API key (sent as a Bearer token; never the client's own,
    never in a log or message), and the limits it answers within (engine/run/remote.py)."""

    url: str
    api_key: str | None = field(default=None, repr=False)
    limits: Limits = Limits()

    @classmethod
    def of(cls, url: "str | UpstreamOptions", api_key: str | None = None,
           answer_s: float | None = None) -> "UpstreamOptions":
        """``url`` as options; the key ``api_key``, else ``$PML_UPSTREAM_API_KEY``."""
        if isinstance(url, UpstreamOptions):
            return url
        limits = Limits() if answer_s is None else dataclasses.replace(Limits(), answer_s=answer_s)
        return cls(url, api_key or os.environ.get(KEY_ENV) or None, limits)


class UpstreamError(Exception):
    """The upstream cannot serve this front (it tokenizes otherwise): one line that says why."""


class Upstream:
    """A vLLM server's OpenAI routes for a front. Holds no per-request state: any number of requests share one."""

    def __init__(self, options: UpstreamOptions | str, encode, transport=None):
        """``encode``: the local tokenizer's text -> ids, checked against the upstream's."""
        options = UpstreamOptions.of(options)
        self.remote = Remote(options.url, api_key=options.api_key, limits=options.limits, transport=transport)
        self.url, self.encode = self.remote.url, encode
        self.served: Card | None = None
        self.refused: str = ""  # why the upstream cannot serve this front (a tokenizer mismatch): final
        self._check: asyncio.Future | None = None

    async def ready(self) -> Card:
        """What the upstream serves, checked once; while it is checked, every caller waits for that one check
        (bounded by its deadline); a 503 while it does not answer or cannot serve this front."""
        if self.served is not None:
            return self.served
        if self.refused:
            raise ApiError(503, self.refused, type=SERVER, code="upstream_mismatch")
        if self._check is None or self._check.done():
            self._check = asyncio.ensure_future(self._connect())
            self._check.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if none waits
        return await asyncio.shield(self._check)  # a caller that leaves does not cancel the others' check

    async def complete(self, body: dict, session: str | None = None) -> AsyncIterator[Piece | End]:
        """``body`` streamed from ``/v1/completions`` (engine/run/remote.py's events); every failure an ApiError."""
        try:
            async for event in self.remote.complete(body, session):
                yield event
        except RemoteError as err:
            raise api_error(err, self.url) from None

    async def aclose(self) -> None:
        await self.remote.aclose()

    async def _connect(self) -> Card:
        try:
            self.served = await self.remote.connect("", self.encode, local="this front")
        except RemoteError as err:
            if err.kind == "mismatch":
                self.refused = (f"the upstream {err}; start the front with --model naming the model the upstream "
                                "serves")
                raise ApiError(503, self.refused, type=SERVER, code="upstream_mismatch") from None
            raise api_error(err, self.url, "it must be a vLLM OpenAI server") from None
        return self.served


def api_error(err: RemoteError, url: str, fix: str = "") -> ApiError:
    """``err`` as this API answers it: the upstream unreachable 503, stalled 504, its refusal passed on where the
    client can act on it (a 400 about the prompt, a 429 with its Retry-After, a 5xx), anything else a 502."""
    if err.kind == "unavailable":
        return ApiError(503, f"the upstream is not answering: {err}; start it, or check --upstream", type=SERVER,
                        code="upstream_unavailable")
    if err.kind == "timeout":
        return ApiError(504, f"the upstream: {err}", type=SERVER, code="upstream_timeout")
    if err.kind == "refused" and err.status in PASSED and err.fields.get("message"):
        f = err.fields
        kind = f.get("type") or (SERVER if err.status >= 500 else INVALID)
        return ApiError(err.status, f"upstream: {f['message']}", type=kind, param=f.get("param"), code=f.get("code"),
                        retry_after=(err.retry_after or 1) if err.status == 429 else None)
    if err.kind == "refused" and err.status in (401, 403):
        return ApiError(502, f"the upstream {url} refused this front's credentials (HTTP {err.status}): give its API "
                        "key with --upstream-key or $PML_UPSTREAM_API_KEY", type=SERVER, code="upstream_auth")
    said = f"the upstream {err}" if str(err).startswith(url) else f"the upstream {url}: {err}"
    return ApiError(502, said + (f"; {fix}" if fix else ""), type=SERVER, code="upstream_error")


def refusal(status: int, body: bytes, url: str) -> ApiError:
    """An upstream's HTTP refusal (``status``, its ``body``) as this API answers it (:func:`api_error`)."""
    fields = error_fields(body)
    said = fields.get("message") or body[:200].decode("utf-8", "replace").strip() or "no body"
    return api_error(RemoteError(f"{url} refused the request (HTTP {status}): {said}", kind="refused", status=status,
                                 fields=fields), url)
