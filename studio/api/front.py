"""A PML front for a vLLM fleet (``pml-studio api --upstream URL``): each request compiled to PML as the local API
compiles it (modes.py), rendered to the token ids the baseline arm prefills (``Engine.prepare`` on the tokenizer
alone: the weights never load), and answered by the upstream's ``/v1/completions``.

Stateless by design: documents are placed with a fresh position registry per request (transparent documents in
canonical order, so one set renders one way in any order) and inline schemas are not remembered, so any number of
fronts answer alike behind a load balancer; vLLM's prefix cache does the reuse.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import ContextLengthError

from . import modes
from .defaults import MAX_QUEUE, MAX_TOKENS_CAP
from .errors import ApiError, from_engine
from .positions import PositionRegistry
from .schemas import SchemaBook
from .service import DEFAULT_MAX_TOKENS, Event, Job, Outcome, Work, compile_work, queue_full
from .types import PmlInfo, PromptTokensDetails, Usage
from .upstream import Served, Upstream

if TYPE_CHECKING:
    from engine.schema.plan import PromptPlan

    from .service import EngineOf

ARM = "vllm"  # what answers: the upstream, reusing prefixes only


@dataclass(frozen=True)
class Rendered:
    """A request as the upstream runs it: its PML, the baseline's token ids, the new tokens it may take."""

    compiled: modes.Compiled
    plan: PromptPlan
    max_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.plan.token_ids


class FrontService:
    """The routes' service (as :class:`~.service.ApiService`) over an upstream instead of the local engine."""

    arms = (ARM,)
    default_arm = ARM

    def __init__(self, engine_of: EngineOf, upstream: Upstream, *, max_queue: int = MAX_QUEUE,
                 max_tokens_cap: int = MAX_TOKENS_CAP, metrics=None, **_ignored):
        """``_ignored``: the local API's options that mean nothing here (``default_arm``, ``record``)."""
        self.engine_of, self.upstream, self.metrics = engine_of, upstream, metrics
        self.max_queue, self.max_tokens_cap = max_queue, max_tokens_cap
        self.schemas = SchemaBook(None, remember=False)  # a name another front never saw would fail there
        self.waiting = 0  # requests rendered or forwarded now
        self._render_lock = threading.Lock()  # one tokenizer, one caller at a time
        self._tasks: set[asyncio.Task] = set()

    async def ready(self) -> None:
        await self.upstream.ready()

    def model_ids(self) -> tuple[str, ...]:
        """The upstream's served model (first, as answers name it), and the local model's name."""
        local = self.engine_of().config.model
        served = self.upstream.served
        return (served.model, local) if served and served.model != local else (local,)

    def card(self) -> dict:
        served = self.upstream.served
        return {"upstream": self.upstream.url, "max_model_len": served and served.max_model_len,
                "default_arm": ARM, "arms": [ARM], "separator": modes.SEPARATOR,
                "min_module_chars": modes.MIN_MODULE_CHARS}

    def submit(self, work: Work, loop: asyncio.AbstractEventLoop) -> Job:
        """Forward ``work`` on ``loop``; 429 when :attr:`max_queue` requests are in flight already."""
        if self.waiting >= self.max_queue:
            raise queue_full(f"{self.waiting} requests are in flight to the upstream, the most this front forwards "
                             "at once", self.max_queue)
        self.waiting += 1
        job = Job(work, loop)
        task = loop.create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: Job) -> None:
        work = job.work
        start = time.perf_counter()
        try:
            served = await self.upstream.ready()
            rendered = await asyncio.to_thread(self._render, work, served)
            job.put(Event("done", await self._forward(job, rendered, served, start)))
        except Exception as err:  # every failure goes to the client as OpenAI's error; the front serves on
            job.put(Event("error", from_engine(err, "messages" if work.endpoint == "chat" else "prompt")))
        finally:
            self.waiting -= 1

    def _render(self, work: Work, served: Served) -> Rendered:
        with self._render_lock:
            return render(self.engine_of(), work, self.schemas, served.max_model_len, self.max_tokens_cap)

    async def _forward(self, job: Job, rendered: Rendered, served: Served, start: float) -> Outcome:
        work = job.work
        sent = time.perf_counter()
        first = last = None
        text, finish, usage, tokens = "", None, None, 0
        async with aclosing(self.upstream.complete(upstream_body(work, rendered, served.model))) as pieces:
            async for piece in pieces:
                if job.stop.is_set():  # the client went away: closing the stream aborts the upstream's run
                    raise ApiError(499, "the client closed the request", code="client_closed_request")
                if piece.text:
                    last = time.perf_counter()
                    first, tokens, text = first or last, tokens + 1, text + piece.text
                    if work.stream:
                        job.put(Event("token", text))
                finish, usage = piece.finish_reason or finish, piece.usage or usage
        return _outcome(rendered, text, finish, usage or {}, tokens, start, sent, first, last)


def render(engine, work: Work, schemas: SchemaBook, max_model_len: int | None, cap: int) -> Rendered:
    """``work`` compiled (a fresh position registry: nothing kept between requests) and planned on the tokenizer;
    the new tokens checked against the room the upstream's context leaves."""
    compiled = compile_work(work, work.how, engine.codec, schemas, PositionRegistry())
    plan = engine.prepare(compiled.schema, compiled.prompt, schema_source="request schema",
                          prompt_source="request prompt").plan
    limit = max_model_len or engine.codec.max_positions
    room = limit - len(plan.token_ids)
    asked = work.max_tokens or min(DEFAULT_MAX_TOKENS[work.endpoint], cap)
    if room < 1 or (work.max_tokens is not None and room < asked):
        raise ContextLengthError(
            f"the upstream's context is {limit} tokens; the prompt takes {len(plan.token_ids)} and {asked} new "
            f"tokens were asked for: at most {max(room, 0)} fit after it; ask for fewer max_tokens or send shorter "
            "messages")
    return Rendered(compiled, plan, min(asked, room))


def upstream_body(work: Work, rendered: Rendered, model: str) -> dict:
    """The ``/v1/completions`` request for ``rendered``: token ids, never text, so the upstream prefills exactly
    the baseline's tokens; always streamed (the front times the first token and stops a run whose client left)."""
    body = {"model": model, "prompt": rendered.token_ids, "max_tokens": rendered.max_tokens,
            "temperature": work.temperature, "top_p": work.top_p, "stream": True,
            "stream_options": {"include_usage": True}}
    if work.stop:
        body["stop"] = list(work.stop)
    if work.temperature > 0:
        body["seed"] = work.seed
    return body


def _outcome(rendered: Rendered, text: str, finish: str | None, usage: dict, tokens: int, start: float,
             sent: float, first: float | None, last: float | None) -> Outcome:
    prompt = usage.get("prompt_tokens") or len(rendered.token_ids)
    completion = usage.get("completion_tokens", tokens)
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    first = first or time.perf_counter()
    decode = (last - first) * 1000 / (completion - 1) if completion > 1 and last else None
    pml = PmlInfo(arm=ARM, mode=rendered.compiled.mode, schema_name=rendered.plan.prompt.schema, modules_reused=0,
                  modules_encoded=0, cached_tokens=cached, ttft_ms=round((first - start) * 1000, 3),
                  arm_ttft_ms=round((first - sent) * 1000, 3),
                  decode_ms_per_token=None if decode is None else round(decode, 3),
                  queue_ms=round((sent - start) * 1000, 3), note=rendered.compiled.note,
                  uncached_documents=dict(rendered.compiled.uncached))
    return Outcome(text, "length" if finish == "length" else "stop",
                   Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached)), pml)
