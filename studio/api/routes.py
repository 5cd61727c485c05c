"""The OpenAI-compatible routes (``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/metrics``, and
``/health`` for a router's checks) as one FastAPI app. A POST's body is parsed once (by :class:`ApiRoute`) and
validated here (types: 422; values: 400 / 404), becomes a :class:`~.service.Work` and waits for its job on the engine
thread; a stream answers once its first token, error or encoding comment is there.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette.sse import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException

from . import modes
from .errors import ApiError, from_engine
from .metrics import Metrics
from .service import ApiService, Job, Outcome, Work, random_seed
from .types import (ChatChoice, ChatChunk, ChatCompletion, ChatMessage, ChatRequest, ChunkChoice, Completion,
                    CompletionChoice, CompletionRequest, Delta, ModelCard, ModelList, unsupported)

API_PATHS = ("/v1/", "/metrics", "/health")  # what ApiRoute hands to the API app
MAX_BODY_BYTES = 4 << 20  # larger is a 413, before it is read whole
DEFAULT_TEMPERATURE = 1.0  # OpenAI's
MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_JSON_DEPTH = 100  # OpenAI's requests nest under 10
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate gets into JSON text (UTF-8 has none)
_SURROGATE = re.compile("[\ud800-\udfff]")
_TAG = re.compile(r"str|int|float|bool|none|bytes|[A-Z]\w*|[\w-]+\[.*\]")  # pydantic's names of union members
# each part may be a module measured on the engine thread: 40,000 held it 21.7 s before their 400
MAX_PARTS = 1024
PARSED = "pml.parsed_body"  # the scope key under which ApiRoute hands the parsed body to the routes
EMPTY = object()  # an empty body: pydantic's "Field required", as FastAPI says it


def create_api(service: ApiService, metrics: Metrics | None = None) -> FastAPI:
    """The API app around ``service``."""
    metrics = metrics or service.metrics or Metrics()
    app = FastAPI(title="PML Studio API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics  # ApiRoute counts the refusals it answers before the app
    _handlers(app, metrics)
    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> ModelList:
        await service.ready()
        return ModelList(data=[_card(service, name, created) for name in service.model_ids()[:1]])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        await service.ready()
        return _card(service, _model(service, model, "model"), created)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _validated(request, ChatRequest)
        await service.ready()
        model = _model(service, req.model)
        work = _work(service, req, "chat", turns=_turns(req.messages))
        return await _respond(service, metrics, request, work, model, req.stream_options)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _validated(request, CompletionRequest)
        await service.ready()
        model = _model(service, req.model)
        work = _work(service, req, "completion", prompt=_prompt(req.prompt))
        return await _respond(service, metrics, request, work, model, req.stream_options)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 once requests can be answered (the model loaded; a front: always), else 503: a router sends none
        to a worker before (vLLM's ``/health``; open without the token, it says nothing else)."""
        ready = service.healthy()
        return JSONResponse({"status": "ok" if ready else "loading"}, 200 if ready else 503)

    @app.get("/metrics")
    async def scrape() -> Response:
        body, kind = metrics.exposition()
        return Response(body, media_type=kind)

    return app


class ApiRoute:
    """ASGI middleware: ``/v1/...`` and ``/metrics`` go to ``api`` (a body over :data:`MAX_BODY_BYTES` is a 413,
    read no further; every POST's body is parsed here as JSON, whatever its Content-Type, holds Unicode text only
    and reaches the routes parsed, under :data:`PARSED`), everything else to the studio."""

    def __init__(self, app, api):
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith(API_PATHS):
            return await self.app(scope, receive, send)
        body = await _bounded_body(scope, receive)
        if body is None:
            error = ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes, the most this server "
                             "reads; send fewer or shorter documents", code="request_too_large")
            return await self._refuse(error, scope, receive, send)
        scope = dict(scope)
        if scope.get("method") == "POST":
            scope[PARSED], refusal = _parsed(body)
            if refusal is not None:
                return await self._refuse(refusal, scope, receive, send)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
        scope["headers"] = headers + [(b"content-type", b"application/json")]  # curl -d says form data
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.api(scope, replay, send)

    async def _refuse(self, error: ApiError, scope, receive, send) -> None:
        await JSONResponse(error.body(), error.status)(scope, receive, send)
        self.api.state.metrics.refused(scope["path"], error.status)


async def _validated(request: Request, kind: type[BaseModel]):
    """The request's body as ``kind``: the value :class:`ApiRoute` parsed, validated as FastAPI validates a body
    (so its errors read the same); parsed here when the app is served without ApiRoute."""
    if PARSED in request.scope:
        value = request.scope[PARSED]
    else:
        value, refusal = _parsed(await request.body())
        if refusal is not None:
            raise refusal
    if value is EMPTY:
        raise _validation([{"type": "missing", "loc": (), "msg": "Field required", "input": None}])
    try:
        return kind.model_validate(value, from_attributes=True)
    except ValidationError as err:
        raise _validation(err.errors(include_url=False)) from None


def _model(service: ApiService, name: str, param: str = "model") -> str:
    """The served model's id for ``name``; 404 model_not_found when this server does not serve it."""
    ids = service.model_ids()
    if name.lower() not in {i.lower() for i in ids}:
        raise ApiError(404, f"the model '{name}' does not exist here; this server serves '{ids[0]}' "
                       "(GET /v1/models)", param=param, code="model_not_found")
    return ids[0]


def _work(service: ApiService, req, endpoint: str, **given) -> Work:
    """The request's Work, its values checked (400 naming the parameter)."""
    refused = unsupported(req)
    if refused is not None:
        raise ApiError(400, f"{refused[1]} by this server", param=refused[0], code="unsupported_parameter")
    opts = req.pml
    arm = (opts.arm if opts and opts.arm else service.default_arm)
    if arm not in service.arms:
        raise ApiError(400, f"unknown arm '{arm}'; arms: {', '.join(service.arms)}", param="pml.arm",
                       code="unknown_arm")
    explicit = bool(opts and (opts.schema_ or opts.prompt))
    if explicit and not (opts.schema_ and opts.prompt):
        missing = "pml.prompt" if opts.schema_ else "pml.schema"
        raise ApiError(400, "explicit PML needs both pml.schema (a name or PML text) and pml.prompt",
                       param=missing, code="missing_parameter")
    temperature = DEFAULT_TEMPERATURE if req.temperature is None else _number(req.temperature, "temperature", 0, 2)
    top_p = 1.0 if req.top_p is None else _number(req.top_p, "top_p", 0, 1, open_lo=True)
    seed = (random_seed() if temperature > 0 else 0) if req.seed is None else req.seed % 2**63
    return Work(endpoint=endpoint, arm=arm, how="explicit" if explicit else opts.mode if opts else "auto",
                max_tokens=_max_tokens(service, req), temperature=temperature, top_p=top_p, seed=seed,
                stop=_stop(req.stop), schema=opts.schema_ if explicit else "",
                pml_prompt=opts.prompt if explicit else "", stream=bool(req.stream), **given)


def _max_tokens(service: ApiService, req) -> int | None:
    given = [(n, v) for n, v in (("max_completion_tokens", getattr(req, "max_completion_tokens", None)),
                                 ("max_tokens", req.max_tokens)) if v is not None]
    if not given:
        return None
    name, value = given[0]
    if not 1 <= value <= service.max_tokens_cap:
        raise ApiError(400, f"{name} must be from 1 to {service.max_tokens_cap} (this server's cap), got {value}",
                       param=name, code="invalid_value")
    return value


def _number(value, name: str, lo: float, hi: float, open_lo: bool = False) -> float:
    if not (lo < value if open_lo else lo <= value) or value > hi:
        raise ApiError(400, f"{name} must be in {'(' if open_lo else '['}{lo:g}, {hi:g}], got {value}",
                       param=name, code="invalid_value")
    return float(value)


def _stop(stop) -> tuple[str, ...]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise ApiError(400, f"stop takes at most {MAX_STOP} non-empty strings", param="stop", code="invalid_value")
    return tuple(stops)


def _turns(messages) -> tuple[modes.Turn, ...]:
    """The chat messages as turns of text parts (400 naming the message for what this server cannot read)."""
    if not messages:
        raise ApiError(400, "messages must hold at least one message", param="messages", code="invalid_value")
    _parts(sum(1 if not isinstance(m.content, list) else len(m.content) for m in messages), "messages",
           "content parts", "join short parts into one, or send fewer documents")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role in ("tool", "function") or m.tool_calls or m.function_call or m.tool_call_id:
            raise ApiError(400, f"{where}: tool and function messages are not supported by this server",
                           param=where, code="unsupported_parameter")
        if m.content is None:
            raise ApiError(400, f"{where} has no content", param=f"{where}.content", code="invalid_value")
        parts = [modes.Part(m.content)] if isinstance(m.content, str) else [_part(p, f"{where}.content[{j}]")
                                                                           for j, p in enumerate(m.content)]
        turns.append(modes.Turn("system" if m.role == "developer" else m.role, tuple(parts)))
    return tuple(turns)


def _part(part, where: str) -> modes.Part:
    if part.type not in ("text", "input_text") or part.text is None:
        raise ApiError(400, f"{where}: only text content parts are supported by this server, not '{part.type}'",
                       param=f"{where}.type", code="unsupported_content")
    return modes.Part(part.text, marked=part.cache_control is not None)


def _parts(n: int, param: str, what: str, fix: str) -> None:
    if n > MAX_PARTS:
        raise ApiError(400, f"{param} holds {n} {what}, more than the {MAX_PARTS} this server reads in one request; "
                       f"{fix}", param=param, code="too_many_parts")


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _parts(prompt.count(modes.SEPARATOR) + 1, "prompt", f"chunks (cut at {modes.SEPARATOR!r})",
               "send fewer chunks")
        return prompt
    raise ApiError(400, "prompt must be one string (a list of prompts or of token ids is not supported)",
                   param="prompt", code="unsupported_parameter")


def _card(service: ApiService, name: str, created: int) -> ModelCard:
    return ModelCard(id=name, created=created, pml=service.card())


async def _respond(service: ApiService, metrics: Metrics, request: Request, work: Work, model: str, options):
    endpoint = request.url.path
    job = service.submit(work, asyncio.get_running_loop())
    watch = asyncio.ensure_future(_stop_when_gone(request, job))
    try:
        event = await job.next()
        while event[0] in ("token", "delta", "progress") and not work.stream:
            event = await job.next()
    finally:
        watch.cancel()
    if event[0] == "error":
        job.leave()
        raise event[1]
    if not work.stream:
        _answered(metrics, endpoint, work, event[1])
        return _whole(work, model, event[1])
    include_usage = bool(options and options.include_usage)
    return EventSourceResponse(_events(metrics, endpoint, work, job, event, model, include_usage), ping=15)


def _whole(work: Work, model: str, out: Outcome):
    created = int(time.time())
    if work.endpoint == "chat":
        return ChatCompletion(id=_id("chatcmpl"), created=created, model=model, usage=out.usage, pml=out.pml,
                              choices=[ChatChoice(message=ChatMessage(content=out.text),
                                                  finish_reason=out.finish_reason)])
    return Completion(id=_id("cmpl"), created=created, model=model, usage=out.usage, pml=out.pml,
                      choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)])


async def _events(metrics: Metrics, endpoint: str, work: Work, job: Job, event: tuple, model: str,
                  include_usage: bool):
    """The stream's events: a comment per unit encoded before the first token (``: encoding 2/5 units: ...``;
    clients ignore comments), the deltas of the text as it grows, the finish, the usage (if asked), [DONE]."""
    chunk = _Chunks(work, model, include_usage)
    sent, opened, by_delta = "", False, False
    try:
        while True:
            if event[0] == "progress":
                metrics.progress.inc()
                yield ServerSentEvent(comment=event[1])
                event = await job.next()
                continue
            if not opened and work.endpoint == "chat" and event[0] != "error":
                yield chunk.delta("", role=True)
            opened = True
            if event[0] == "error":  # the run failed after its first token: OpenAI's error object, then the end
                yield json.dumps(event[1].body())
                break
            if event[0] == "delta":  # a front's new visible text, sent as it comes (the whole text is not kept)
                by_delta = True
                if event[1]:
                    yield chunk.delta(event[1])
                event = await job.next()
                continue
            text = event[1] if event[0] == "token" else event[1].text  # a token's text: already cut (service.py)
            if not by_delta and text.startswith(sent) and len(text) > len(sent):
                yield chunk.delta(text[len(sent):])
                sent = text
            if event[0] == "done":
                _answered(metrics, endpoint, work, event[1])
                for line in chunk.finish(event[1]):
                    yield line
                break
            event = await job.next()
        yield "[DONE]"
    finally:
        job.leave()  # the client went away (or the stream ended): a run still going stops within a token


class _Chunks:
    """The stream's chunks, OpenAI's shapes for chat and for completions."""

    def __init__(self, work: Work, model: str, include_usage: bool):
        self.chat, self.model, self.include_usage = work.endpoint == "chat", model, include_usage
        self.id, self.created = _id("chatcmpl" if self.chat else "cmpl"), int(time.time())

    def delta(self, text: str, role: bool = False) -> str:
        if self.chat:
            choice = ChunkChoice(delta=Delta(role="assistant" if role else None, content=text))
            return ChatChunk(id=self.id, created=self.created, model=self.model, choices=[choice]).model_dump_json(
                exclude_none=True)
        return Completion(id=self.id, created=self.created, model=self.model,
                          choices=[CompletionChoice(text=text)]).model_dump_json(exclude_none=True)

    def finish(self, out: Outcome) -> list[str]:
        """The chunk with the finish reason (and the ``pml`` object unless a usage chunk follows), then the usage."""
        pml = None if self.include_usage else out.pml
        if self.chat:
            last = ChatChunk(id=self.id, created=self.created, model=self.model, pml=pml,
                             choices=[ChunkChoice(delta=Delta(), finish_reason=out.finish_reason)])
        else:
            last = Completion(id=self.id, created=self.created, model=self.model, pml=pml,
                              choices=[CompletionChoice(text="", finish_reason=out.finish_reason)])
        lines = [last.model_dump_json(exclude_none=True)]
        if self.include_usage:
            kind = ChatChunk if self.chat else Completion
            lines.append(kind(id=self.id, created=self.created, model=self.model, choices=[], usage=out.usage,
                              pml=out.pml).model_dump_json(exclude_none=True))
        return lines


def _answered(metrics: Metrics, endpoint: str, work: Work, out: Outcome) -> None:
    metrics.answered(endpoint, work.arm, out.pml.mode, out.usage, out.pml)


async def _stop_when_gone(request: Request, job: Job) -> None:
    """Tell the job its client left when it disconnects (the body is read: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.leave()


async def _bounded_body(scope, receive) -> bytes | None:
    """The request's body, or None once it is longer than :data:`MAX_BODY_BYTES` (the rest is not read)."""
    headers = dict(scope.get("headers") or [])
    declared = headers.get(b"content-length", b"").decode("latin-1")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY_BYTES:
            return None
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _path(loc, keep_last: bool = False) -> list:
    """``loc`` without "body" and pydantic's union-member tags ("str", "list[ContentPart]", "int", ...); with
    ``keep_last``, its last name stays whatever it is (an unknown parameter's name, as the client spelt it)."""
    last = len(loc) - 1 if keep_last else len(loc)
    return [x for i, x in enumerate(loc) if isinstance(x, int) or i == last or
            (x != "body" and not _TAG.fullmatch(str(x)))]


def _param(loc, keep_last: bool = False) -> str | None:
    """A pydantic location as OpenAI names a parameter: ``messages[0].content[1].cache_control.type``."""
    out = ""
    for x in _path(loc, keep_last):
        out += f"[{x}]" if isinstance(x, int) else f".{x}" if out else str(x)
    return out or None


def _parsed(body: bytes) -> tuple[object, ApiError | None]:
    """(the body's JSON value, None), or (None, the 400 for a body that is not JSON this server reads, naming why:
    FastAPI would call text that is not UTF-8, nesting past Python's recursion limit or a 5,000-digit number a bare
    400; or that holds a string no UTF-8 can carry: a lone surrogate, which fails wherever the text is written, the
    answer, the run log, the tokenizer). An empty body is :data:`EMPTY` (the 422 says what is missing)."""
    if not body:
        return EMPTY, None
    if _deeper_than(body, MAX_JSON_DEPTH):
        return None, ApiError(400, f"the request body is not valid JSON this server reads: it nests arrays and "
                              f"objects more than {MAX_JSON_DEPTH} levels deep; send a flatter document",
                              code="invalid_json")
    try:
        value = json.loads(body)
    except UnicodeDecodeError as err:
        why = f"it is not UTF-8 text ({err.reason} at byte {err.start}); send it as UTF-8"
    except RecursionError:
        why = (f"it nests arrays and objects more than about {sys.getrecursionlimit()} levels deep, more than "
               "this server reads; send a flatter document")
    except json.JSONDecodeError as err:
        why = f"{err.msg} at line {err.lineno} column {err.colno}"
    except ValueError as err:  # Python refuses integers of more than 4,300 digits
        why = (f"a number in it is too long to read ({str(err).split(';')[0]}); send it as a string or shorter"
               if "digits" in str(err) else f"it cannot be read ({err})")
    else:
        return value, _lone_surrogate(value) if _ESCAPED_SURROGATE.search(body) else None
    return None, ApiError(400, f"the request body is not valid JSON: {why}", code="invalid_json")


def _lone_surrogate(value) -> ApiError | None:
    """The 400 naming the first string of ``value`` (an object's keys included) that holds a UTF-16 surrogate
    without its pair (JSON's ``"\\udfff"``), else None. A pair is one character to json.loads, so it passes."""
    todo: list[tuple[str, object, bool]] = [("", value, False)]  # (field, value, whether it is that field's key)
    while todo:
        field, item, key = todo.pop()
        if isinstance(item, dict):
            for k, v in reversed(item.items()):
                inner = f"{field}.{k}" if field else k
                todo += [(inner, v, False), (field, k, True)]
        elif isinstance(item, list):
            todo += [(f"{field}[{i}]", v, False) for i, v in reversed(list(enumerate(item)))]
        elif isinstance(item, str) and (found := _SURROGATE.search(item)) is not None:
            what = f"a key of {field or 'the body'}" if key else field
            return ApiError(400, f"{what} is not Unicode text: it holds the lone UTF-16 surrogate "
                            f"\\u{ord(found.group()):04x} at character {found.start()}, which no UTF-8 can carry; "
                            "a \\ud800-\\udbff escape must be followed by its \\udc00-\\udfff pair",
                            param=field or None, code="invalid_value")
    return None


def _deeper_than(body: bytes, limit: int) -> bool:
    """Whether ``body``'s arrays and objects may nest more than ``limit`` deep (twice ``limit`` at most passes):
    the brackets outside strings, emptied pair by innermost pair, at C speed (no recursion, no parse)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        emptied = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if emptied == brackets:  # nothing left, or brackets that do not pair (deep when many stay open)
            return brackets.count(b"[") + brackets.count(b"{") > limit
        brackets = emptied
    return bool(brackets)


def _id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every refusal as OpenAI's error body: ApiError, pydantic's validation (422; bad JSON and unknown
    parameters 400), unknown routes and methods, and anything unanticipated (500, logged once)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        answer = JSONResponse(err.body(), err.status, headers=err.headers())  # made first: count what is sent
        metrics.refused(request.url.path, err.status)
        return answer

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        return await api_error(request, _validation(err.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return await api_error(request, ApiError(err.status_code, f"{request.method} {request.url.path}: "
                                                 f"{err.detail}", code=code))

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception):
        return await api_error(request, from_engine(err))


_TYPE_TAG = re.compile(r"(int|float|str|bool|none|[a-z-]+\[.*\])\Z")  # how pydantic names a union's members


def _validation(errors: list) -> ApiError:
    """The most specific of pydantic's errors (the union member it got furthest into) as an ApiError: bad JSON
    and unknown parameters 400, the rest 422."""
    first = max(errors, key=lambda e: len(_path(e.get("loc", ()))), default=None) or \
        {"type": "", "loc": (), "msg": "invalid request"}
    param = _param(first.get("loc", ()), keep_last=first["type"] == "extra_forbidden")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if len(loc) > 1 and _TYPE_TAG.match(loc[-1]):  # a union's members (temperature.int): say what it takes
        tags = [str(e["loc"][-1]) for e in errors if [str(x) for x in e["loc"] if x != "body"][:-1] == loc[:-1]]
        want = "a number" if set(tags) <= {"int", "float"} else " or ".join(tags)
        first = {**first, "msg": f"expected {want}, got {first.get('input')!r}"}
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    return ApiError(422, f"{param or 'the body'}: {first.get('msg')}", param=param, code="invalid_type")
