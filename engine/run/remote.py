"""An OpenAI-compatible server (vLLM) over HTTP: the one client the vllm arm and the API's front both use.

Its rules, one each: the prompt goes as token ids, streamed with its usage, a seed only when sampling, stop strings
kept in the output (each caller cuts them, as for the local arms); the tokenizer is checked by a probe text's ids
from ``/tokenize`` (the prompt goes as ids); every field answered is checked before it is read; no redirect is
followed; every byte is bounded before it is buffered (:class:`Limits`: per line, document and answer, compressed
or not), with deadlines between events and on the whole answer; no token past ``max_tokens`` is read. Failures are
:class:`RemoteError`\ s whose ``kind`` each caller words for its users.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator, Sequence, Union

import httpx

from engine.errors import EngineError
from engine.run.sse import DONE, EventError, EventReader, document, error_message
from engine.run.types import Sampling

TOP_LOGPROBS = 20  # vLLM's default --max-logprobs: the arm's first-token agreement is over these
TOKEN_ID = "token_id:"  # vLLM's token strings under return_tokens_as_token_ids
# Chat tags, digits, accents, CJK and an emoji: tokenizers that differ anywhere differ here.
PROBE = "<|im_start|>user\nProbe 1234 — naïve café, 東京, ✓ 🙂\tdone.<|im_end|>\n"
MAX_COUNT = (1 << 31) - 1  # the largest token count a server may report
MAX_NAME = 256  # characters of a served model's name
FINISH_REASONS = ("stop", "length", "abort", "error", "tool_calls", "content_filter")
KINDS = ("unavailable", "timeout", "refused", "broken", "mismatch")


class RemoteError(EngineError):
    """The server could not be used: ``kind`` is one of :data:`KINDS`; a refusal has its ``status`` and ``fields``."""

    def __init__(self, message: str, kind: str = "broken", status: int | None = None, fields: dict | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.kind, self.status, self.fields, self.retry_after = kind, status, fields or {}, retry_after


@dataclass(frozen=True)
class Limits:
    """How much a server may send and how long it may take."""

    connect_s: float = 5.0
    idle_s: float = 300.0  # between two events of an answer: a long prefill on a CPU may send nothing for minutes
    answer_s: float = 900.0  # one whole streamed answer
    check_s: float = 20.0  # one whole /v1/models or /tokenize exchange
    max_line: int = 1 << 20  # one line of a stream, inflated
    max_answer: int = 16 << 20  # one streamed answer's bytes, inflated
    max_document: int = 1 << 20  # one JSON answer (/v1/models, /tokenize, an error), inflated


@dataclass(frozen=True)
class Card:
    """One model a server lists at ``/v1/models``."""

    model: str
    max_model_len: int | None


@dataclass(frozen=True)
class Piece:
    """Text a streamed answer added, with its tokens' ids and top log-probabilities when asked for them."""

    text: str
    token_ids: tuple[int, ...] = ()
    top: tuple[dict[int, float], ...] = ()  # per token: id -> log-probability, the server's top ones


@dataclass(frozen=True)
class Usage:
    """The server's count of one answer."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens it took from its prefix cache


@dataclass(frozen=True)
class End:
    """The last event of an answer."""

    finish_reason: str | None
    usage: Usage


Event = Union[Piece, End]


def base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``; RemoteError when it is not http(s)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise RemoteError(f"a vLLM URL starts with http:// or https://, got '{url[:200]}'; e.g. "
                          "http://127.0.0.1:8100", kind="unavailable")
    return url


def completion_body(model: str, ids: Sequence[int], sampling: Sampling, logprobs: int = 0) -> dict:
    """The ``/v1/completions`` request for ``ids`` (the module docstring's rules); ``logprobs``: top log-probabilities
    per token, with tokens named by id."""
    body = {"model": model, "prompt": list(ids), "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "stream": True,
            "stream_options": {"include_usage": True}}
    if sampling.temperature > 0:
        body["seed"] = sampling.seed
    if sampling.stop:
        body.update(stop=list(sampling.stop), include_stop_str_in_output=True)
    if logprobs:
        body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
    return body


class Remote:
    """One server's OpenAI routes; ``api_key`` goes as a Bearer token, never into a message."""

    def __init__(self, url: str, api_key: str | None = None, limits: Limits = Limits(),
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url, self.limits = base_url(url), limits
        headers = {"Accept-Encoding": "identity"}  # compressed answers are read too, within the same limits
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.AsyncClient(headers=headers, follow_redirects=False, transport=transport,
                                        timeout=httpx.Timeout(limits.idle_s, connect=limits.connect_s))

    async def connect(self, model: str = "", encode: Callable[[str], Sequence[int]] | None = None,
                      local: str = "this client") -> Card:
        """``model``'s card (default: the first), its tokenizer checked against ``encode`` (``local``'s)."""
        return await self._within(self.limits.check_s, "answer /v1/models and /tokenize",
                                  self._connect(model, encode, local))

    async def models(self) -> list[Card]:
        """What ``/v1/models`` lists."""
        doc = await self._json("GET", "/v1/models")
        cards = doc.get("data")
        if not isinstance(cards, list) or not cards:
            raise RemoteError(f"{self.url}/v1/models lists no model; is it a vLLM OpenAI server?")
        return [self._card(c) for c in cards[:64]]

    async def tokenize(self, model: str, text: str) -> list[int]:
        """The server's ids of ``text`` (vLLM's ``/tokenize``, special tokens as text)."""
        doc = await self._json("POST", "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
        ids = doc.get("tokens")
        if not isinstance(ids, list) or len(ids) > 4 * len(text.encode()) + 16 or not all(_count(i) for i in ids):
            raise RemoteError(f"{self.url}/tokenize answered no list of token ids; the server must be vLLM's "
                              "OpenAI server")
        return ids

    async def complete(self, body: dict, session: str | None = None) -> AsyncIterator[Event]:
        """``body`` streamed: a Piece per event with text, then the End; ``session``: an ``X-Session-ID``."""
        clock = _Clock(self.limits)
        headers = {"X-Session-ID": session} if session else None
        async with self._exchange("POST", "/v1/completions", clock, body, headers) as resp:
            answer = _Answer(self.url, body, self.limits, resp.headers.get("content-encoding", ""), clock)
            async with aclosing(_chunks(resp, clock, self.url)) as chunks:
                async for raw in chunks:
                    for event in answer.feed(raw):
                        yield event
                        if isinstance(event, End):
                            return
            for event in answer.feed(b"", last=True):
                yield event
                if isinstance(event, End):
                    return
        raise RemoteError(f"{self.url} ended its stream without [DONE]")

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- internal helpers --

    async def _connect(self, model: str, encode, local: str) -> Card:
        cards = await self.models()
        card = next((c for c in cards if c.model == model), None) if model else cards[0]
        if card is None:
            names = ", ".join(c.model for c in cards[:8])
            raise RemoteError(f"{self.url} serves {names}, not '{model[:MAX_NAME]}'", kind="refused")
        if encode is not None:
            theirs, ours = await self.tokenize(card.model, PROBE), list(encode(PROBE))
            if theirs != ours:
                raise RemoteError(f"{self.url} serves '{card.model}', whose tokenizer differs from {local}'s (a probe "
                                  f"text gave {_ids(theirs)} there, {_ids(ours)} here)", kind="mismatch")
        return card

    def _card(self, card) -> Card:
        name = card.get("id") if isinstance(card, dict) else None
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
            shown = name[:40] + "..." if isinstance(name, str) and len(name) > 40 else name
            raise RemoteError(f"{self.url}/v1/models names a model {shown!r}, which is not a name of at most "
                              f"{MAX_NAME} printable characters")
        length = card.get("max_model_len")
        if length is not None and not (_count(length) and length > 0):
            raise RemoteError(f"{self.url}/v1/models gives '{name}' a max_model_len of {str(length)[:40]!r}, not a "
                              "positive whole number")
        return Card(name, length)

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        clock = _Clock(self.limits, self.limits.check_s)
        async with self._exchange(method, path, clock, body) as resp:
            raw = await _bounded(resp, clock, self.url, self.limits.max_document)
        try:
            doc = json.loads(raw, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            raise RemoteError(f"{self.url}{path} answered something that is not JSON ({_shown(raw)}); is it a "
                              "vLLM OpenAI server?") from None
        if not isinstance(doc, dict):
            raise RemoteError(f"{self.url}{path} answered JSON that is not an object ({_shown(raw)})")
        return doc

    @asynccontextmanager
    async def _exchange(self, method: str, path: str, clock: "_Clock", body: dict | None = None,
                        headers: dict | None = None):
        """The response to one request, its status 200 (anything else a RemoteError), closed after."""
        request = self.client.build_request(method, f"{self.url}{path}", json=body, headers=headers)
        try:
            resp = await clock.wait(self.client.send(request, stream=True), self.url)
        except httpx.HTTPError as err:
            raise _unreachable(err, self.url) from None
        try:
            if resp.status_code != 200:
                raise await self._refusal(resp, clock, path)
            yield resp
        except httpx.HTTPError as err:
            raise _unreachable(err, self.url) from None
        finally:
            await resp.aclose()

    async def _refusal(self, resp: httpx.Response, clock: "_Clock", path: str) -> RemoteError:
        status, where = resp.status_code, f"{self.url}{path}"
        if 300 <= status < 400:
            to = resp.headers.get("location", "")[:200]
            return RemoteError(f"{where} answered HTTP {status}, a redirect{f' to {to}' if to else ''}, which is not "
                               "followed: give the server's own URL", status=status)
        try:
            raw = await _bounded(resp, clock, self.url, 64 << 10, cut=True)
        except RemoteError:
            raw = b""
        fields = error_fields(raw)
        said = fields.get("message") or _shown(raw) or "no body"
        retry = resp.headers.get("retry-after", "")
        return RemoteError(f"{where} refused the request (HTTP {status}): {said}", kind="refused", status=status,
                           fields=fields, retry_after=min(int(retry), 3600) if retry.isdigit() else None)

    @staticmethod
    async def _within(seconds: float, what: str, coro):
        try:
            return await asyncio.wait_for(coro, seconds)
        except asyncio.TimeoutError:
            raise RemoteError(f"the server did not {what} within {seconds:g} s", kind="timeout") from None


class Blocking:
    """A :class:`Remote` on an event loop of its own, for plain code (the vllm arm on the engine thread)."""

    def __init__(self, url: str, **options):
        self.loop = asyncio.new_event_loop()
        self.remote = Remote(url, **options)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def stream(self, events: AsyncIterator) -> Iterator:
        """``events`` one by one; closed (its connection with it) when the caller stops early."""
        try:
            while True:
                try:
                    yield self.loop.run_until_complete(events.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.loop.run_until_complete(events.aclose())

    def close(self) -> None:
        self.loop.run_until_complete(self.remote.aclose())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def __enter__(self) -> "Blocking":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- internal helpers --

class _Clock:
    """The deadlines of one exchange: ``total`` seconds in all, :attr:`Limits.idle_s` between two events."""

    def __init__(self, limits: Limits, total: float | None = None):
        self.start = self.last = time.monotonic()
        self.total = limits.answer_s if total is None else total
        self.idle = limits.idle_s

    def event(self) -> None:
        self.last = time.monotonic()

    async def wait(self, awaitable, url: str):
        now = time.monotonic()
        left_total, left_idle = self.start + self.total - now, self.last + self.idle - now
        try:
            return await asyncio.wait_for(awaitable, max(min(left_total, left_idle), 0.0))
        except asyncio.TimeoutError:
            if left_total <= left_idle:
                raise RemoteError(f"{url} did not finish its answer within {self.total:g} s", kind="timeout") \
                    from None
            raise RemoteError(f"{url} did not answer within {self.idle:g} s (nothing new since its last event); is the "
                              "server overloaded?",
                              kind="timeout") from None


class _Answer:
    """One streamed answer read: its bytes inflated within the limit, its events checked, its tokens counted."""

    def __init__(self, url: str, body: dict, limits: Limits, encoding: str, clock: _Clock):
        self.url, self.limits, self.clock = url, limits, clock
        self.asked, self.prompt = int(body["max_tokens"]), len(body["prompt"])
        self.by_id = bool(body.get("return_tokens_as_token_ids"))
        self.inflater = _inflater(encoding, url)
        self.events = EventReader(limits.max_line)
        self.inflated = self.tokens = 0
        self.finish: str | None = None
        self.usage: Usage | None = None

    def feed(self, raw: bytes, last: bool = False) -> Iterator[Event]:
        """The events ``raw`` (bytes as sent) completes; with ``last``, what the stream's end completes."""
        for part in _pieces(self.inflater, raw):
            self.inflated += len(part)
            if self.inflated > self.limits.max_answer:
                raise RemoteError(f"{self.url} sent more than {self.limits.max_answer:,} bytes for one answer")
            for data in self._events(self.events.feed, part):
                yield from self._read(data)
        if last:
            for data in self._events(self.events.end):
                yield from self._read(data)

    def _events(self, read, *args) -> list[str]:
        try:
            return read(*args)
        except EventError as err:
            raise RemoteError(f"{self.url} sent {err}") from None

    def _read(self, data: str) -> Iterator[Event]:
        self.clock.event()
        try:
            doc = document(data)
        except EventError as err:
            if err.event is not None:
                raise RemoteError(f"{self.url} failed mid-stream: {err}", kind="refused", status=500,
                                  fields=_fields(err.event)) from None
            raise RemoteError(f"{self.url} sent an event that is {err}") from None
        if doc == DONE:
            if self.usage is None:
                raise RemoteError(f"{self.url} sent no usage at the end of its stream; is it vLLM (it sends one when "
                                  "asked with stream_options.include_usage)?")
            yield End(self.finish, self.usage)
            return
        for choice in _list(doc, "choices", self.url)[:1]:  # one choice asked (n = 1)
            piece = self._choice(choice)
            if piece is not None:
                yield piece
        if doc.get("usage") is not None:
            self.usage = self._usage(doc["usage"])

    def _choice(self, choice) -> Piece | None:
        if not isinstance(choice, dict):
            raise RemoteError(f"{self.url} sent a choice that is not an object: {str(choice)[:80]}")
        text = choice.get("text", "")
        finish = choice.get("finish_reason")
        if not isinstance(text, str) or (finish is not None and finish not in FINISH_REASONS):
            raise RemoteError(f"{self.url} sent a choice whose text or finish_reason is not one "
                              f"({str(text)[:40]!r}, {str(finish)[:40]!r})")
        self.finish = finish or self.finish
        ids, top = self._logprobs(choice.get("logprobs")) if self.by_id else ((), ())
        n = len(ids) if self.by_id else int(bool(text))
        if n == 0 and not text:
            return None
        self.tokens += n
        if self.tokens > self.asked:
            raise RemoteError(f"{self.url} streamed more than the {self.asked} tokens asked for")
        return Piece(text, ids, top)

    def _logprobs(self, lp) -> tuple[tuple[int, ...], tuple[dict[int, float], ...]]:
        if not isinstance(lp, dict):
            raise RemoteError(f"{self.url} sent no log-probabilities though asked for them (logprobs)")
        tokens, tops = lp.get("tokens") or [], lp.get("top_logprobs") or []
        if not isinstance(tokens, list) or not isinstance(tops, list) or len(tops) > len(tokens):
            raise RemoteError(f"{self.url} sent log-probabilities whose tokens or top_logprobs are not lists")
        ids = tuple(self._token_id(t) for t in tokens)
        top = tuple(self._top(tops[i] if i < len(tops) else None) for i in range(len(ids)))
        return ids, top

    def _token_id(self, token) -> int:
        digits = token[len(TOKEN_ID):] if isinstance(token, str) and token.startswith(TOKEN_ID) else ""
        if not (digits.isascii() and digits.isdigit() and len(digits) < 10):
            raise RemoteError(f"{self.url} named a token {str(token)[:40]!r}, not by its id ('token_id:N'); the vllm "
                              "arm needs vLLM's return_tokens_as_token_ids (vLLM 0.6 or later)")
        return int(digits)

    def _top(self, top) -> dict[int, float]:
        if top is None:
            return {}
        if not isinstance(top, dict) or len(top) > 4 * TOP_LOGPROBS:
            raise RemoteError(f"{self.url} sent top log-probabilities that are not a small object")
        out = {}
        for token, lp in top.items():
            if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not -1e9 < lp <= 1e-3:
                raise RemoteError(f"{self.url} sent a log-probability {str(lp)[:40]!r}, not a number at most 0")
            out[self._token_id(token)] = float(lp)
        return out

    def _usage(self, usage) -> Usage:
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        done = usage.get("completion_tokens") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = 0 if cached is None else cached
        if not (_count(prompt) and _count(done) and _count(cached)) or \
                (details is not None and not isinstance(details, dict)):
            raise RemoteError(f"{self.url} sent a usage that is not whole counts: {str(usage)[:200]}")
        if prompt != self.prompt or cached > prompt or done > self.asked:
            raise RemoteError(f"{self.url} counted {prompt} prompt tokens ({cached} cached) and {done} generated for "
                              f"the {self.prompt} token ids sent and the {self.asked} asked for")
        return Usage(prompt, done, cached)


async def _chunks(resp: httpx.Response, clock: _Clock, url: str) -> AsyncIterator[bytes]:
    """The response's bytes as sent (compressed or not), each read within the clock's deadlines."""
    raw = resp.aiter_raw()
    while True:
        try:
            chunk = await clock.wait(raw.__anext__(), url)
        except StopAsyncIteration:
            return
        except httpx.HTTPError as err:
            raise _unreachable(err, url) from None
        yield chunk


async def _bounded(resp: httpx.Response, clock: _Clock, url: str, limit: int, cut: bool = False) -> bytes:
    """The response's body inflated, at most ``limit`` bytes; more is a RemoteError (or, with ``cut``, cut off)."""
    inflater, out = _inflater(resp.headers.get("content-encoding", ""), url), bytearray()
    async with aclosing(_chunks(resp, clock, url)) as chunks:
        async for raw in chunks:
            for part in _pieces(inflater, raw):
                out += part
                if len(out) > limit:
                    if cut:
                        return bytes(out[:limit])
                    raise RemoteError(f"{url} answered more than {limit:,} bytes where a short JSON document was "
                                      "due")
    return bytes(out)


def _inflater(encoding: str, url: str):
    """A decompressor for ``Content-Encoding: encoding`` (None for identity); RemoteError for one not read."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("identity", ""):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib-wrapped, as RFC 9110 says (the header tells it)
    raise RemoteError(f"{url} answered with Content-Encoding {encoding[:40]!r}, which this client does not read; "
                      "it asked for identity (gzip and deflate are read too)")


def _pieces(inflater, raw: bytes, size: int = 64 << 10) -> Iterator[bytes]:
    """``raw`` decompressed in pieces of ``size`` bytes: a reader's limit stops a bomb after a few."""
    if inflater is None:
        for i in range(0, len(raw), size):
            yield raw[i:i + size]
        return
    data = raw
    while data:
        try:
            part = inflater.decompress(data, size)
        except zlib.error as err:
            raise RemoteError(f"a compressed answer could not be read ({err})") from None
        data = inflater.unconsumed_tail
        if part:
            yield part
        elif not data:
            break


def _unreachable(err: httpx.HTTPError, url: str) -> RemoteError:
    if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
        return RemoteError(f"cannot reach {url} ({_why(err)}); is the server running at that address?",
                           kind="unavailable")
    if isinstance(err, httpx.TimeoutException):
        return RemoteError(f"{url} sent nothing new in time; is the server overloaded?", kind="timeout")
    return RemoteError(f"{url} broke off its answer ({_why(err)}); is the server still running?")


def error_fields(raw: bytes) -> dict:
    """An OpenAI error body's fields (:func:`_fields`), or {} for a body that is not JSON."""
    try:
        return _fields(json.loads(raw, parse_constant=_refuse_constant))
    except (ValueError, RecursionError):
        return {}


def _fields(doc) -> dict:
    """An OpenAI error's message, type, param and code, each checked (vLLM nests them under ``error``)."""
    if not isinstance(doc, dict):
        return {}
    err = doc.get("error", doc)
    if not isinstance(err, dict):
        return {"message": error_message(doc)}
    out = {}
    for name, cap in (("message", 2000), ("type", 80), ("param", 200), ("code", 80)):
        value = err.get(name)
        if isinstance(value, str) and (name == "message" or value.isprintable()):
            out[name] = value[:cap]
        elif name == "code" and isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1000:
            out[name] = value
    return out


def _list(doc: dict, name: str, url: str) -> list:
    value = doc.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise RemoteError(f"{url} sent an event whose {name} is not a list: {str(value)[:80]}")
    return value


def _count(n) -> bool:
    """Whether ``n`` is a whole count a server may report."""
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_COUNT


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number a server sends")


def _shown(raw: bytes) -> str:
    return raw[:200].decode("utf-8", "replace").strip()


def _why(err: Exception) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _ids(ids) -> str:
    return "nothing" if ids is None else str(ids[:12])[:-1] + (", ...]" if len(ids) > 12 else "]")
