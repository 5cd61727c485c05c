"""A PML front for a vLLM fleet (``pml-studio api --upstream URL``): each request compiled to PML as the local API
compiles it (modes.py), rendered to the token ids the baseline arm prefills (``Engine.prepare`` on the tokenizer
alone: the weights never load), and answered by the upstream's ``/v1/completions``.

Stateless by design: documents are placed with a fresh position registry per request (transparent documents in
canonical order, so one set renders one way in any order) and inline schemas are not remembered, so any number of
fronts answer alike behind a load balancer; vLLM's prefix cache does the reuse. Each request with documents carries
a routing key (:func:`route_key`, as ``X-Session-ID``) that a router's ``consistent_hash`` policy keeps on one
replica (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import ContextLengthError
from engine.public import Card, End, Sampling, completion_body

from . import modes
from .defaults import MAX_QUEUE, MAX_TOKENS_CAP
from .errors import ApiError, from_engine
from .positions import PositionRegistry
from .schemas import SchemaBook
from .service import DEFAULT_MAX_TOKENS, Event, Job, Outcome, Work, compile_work, queue_full
from .types import PmlInfo, PromptTokensDetails, Usage
from .upstream import Upstream
from .usage import StopCut

if TYPE_CHECKING:
    from engine.public import PromptPlan

    from .service import EngineOf

ARM = "vllm"  # what answers: the upstream, reusing prefixes only


@dataclass(frozen=True)
class Rendered:
    """A request as the upstream runs it: its PML, the baseline's token ids, its sampling (the new tokens it may
    take: what the request asked, within the room the upstream's context leaves)."""

    compiled: modes.Compiled
    plan: PromptPlan
    sampling: Sampling

    @property
    def token_ids(self) -> list[int]:
        return self.plan.token_ids

    @property
    def route_key(self) -> str | None:
        return route_key(self.plan)


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
        """The upstream checked; a request waiting for that check holds a place in the queue (429 past it)."""
        if self.upstream.served is not None:
            return
        self._take()
        try:
            await self.upstream.ready()
        finally:
            self.waiting -= 1

    def healthy(self) -> bool:
        """Always: the front loads no weights, and each request checks the upstream itself."""
        return True

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
        """Forward ``work`` on ``loop``; 429 when :attr:`max_queue` requests are in flight already. A client that
        leaves cancels its task (:meth:`Job.leave`): its upstream request is closed and its place freed at once."""
        self._take()
        job = Job(work, loop)
        job.task = loop.create_task(self._run(job))
        self._tasks.add(job.task)
        job.task.add_done_callback(self._tasks.discard)
        return job

    def _take(self) -> None:
        if self.waiting >= self.max_queue:
            raise queue_full(f"{self.waiting} requests are in flight to the upstream, the most this front forwards "
                             "at once", self.max_queue)
        self.waiting += 1

    async def _run(self, job: Job) -> None:
        work = job.work
        start = time.perf_counter()
        try:
            served = await self.upstream.ready()
            rendered = await asyncio.to_thread(self._render, work, served)
            job.put(Event("done", await self._forward(job, rendered, served, start)))
        except asyncio.CancelledError:  # the client left: its route stops waiting too
            job.put(Event("error", ApiError(499, "the client closed the request", code="client_closed_request")))
            raise
        except Exception as err:  # every failure goes to the client as OpenAI's error; the front serves on
            job.put(Event("error", from_engine(err, "messages" if work.endpoint == "chat" else "prompt")))
        finally:
            self.waiting -= 1

    def _render(self, work: Work, served: Card) -> Rendered:
        with self._render_lock:
            return render(self.engine_of(), work, self.schemas, served.max_model_len, self.max_tokens_cap)

    async def _forward(self, job: Job, rendered: Rendered, served: Card, start: float) -> Outcome:
        """The upstream's answer, its text cut at the request's stop strings here (the upstream keeps them in its
        output: engine/run/remote.py) and streamed as it becomes visible; kept as pieces, joined once."""
        work = job.work
        shown = StopCut(work.stop)
        sent = time.perf_counter()
        first = last = end = None
        parts: list[str] = []  # the visible text, joined once
        body = completion_body(served.model, rendered.token_ids, rendered.sampling)
        async with aclosing(self.upstream.complete(body, session=rendered.route_key)) as events:
            async for event in events:
                if isinstance(event, End):
                    end = event
                    continue
                last = time.perf_counter()
                first = first or last
                if delta := shown.add(event.text):
                    parts.append(delta)
                    if work.stream:
                        job.put(Event("delta", delta))
        if tail := shown.flush():
            parts.append(tail)
            if work.stream:
                job.put(Event("delta", tail))
        text, stopped = "".join(parts), shown.stopped
        return _outcome(rendered, text, stopped, end, start, sent, first, last)


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
    sampling = Sampling(max_new_tokens=min(asked, room), temperature=work.temperature, top_p=work.top_p,
                        seed=work.seed, stop=work.stop)
    return Rendered(compiled, plan, sampling)


def route_key(plan: PromptPlan) -> str | None:
    """A hash of the token ids through the prompt's first document (its system text, any text before the documents,
    then the first of them in canonical order); None without documents. Every request that can reuse another's
    prefix beyond the system text has the same first document, so a router hashing this key keeps them on one
    replica: the same set in any order, and subsets that lead with the same document. No text leaves in it."""
    end = first = None
    for placed in plan.placed():  # a module's arguments are new text inside it: its end is its last cached piece
        if placed.module is None:
            continue
        if first not in (None, placed.module):
            break
        first, end = placed.module, placed.ranks.stop
    if end is None:
        return None
    return hashlib.sha256(",".join(map(str, plan.token_ids[:end])).encode()).hexdigest()[:32]


def _outcome(rendered: Rendered, text: str, stopped: bool, end: End, start: float, sent: float,
             first: float | None, last: float | None) -> Outcome:
    """The answer as the client sees it; its counts are the upstream's (engine/run/remote.py checked them against
    the ids sent and the tokens asked for)."""
    usage = end.usage
    prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
    first = first or time.perf_counter()
    decode = (last - first) * 1000 / (completion - 1) if completion > 1 and last else None
    pml = PmlInfo(arm=ARM, mode=rendered.compiled.mode, schema_name=rendered.plan.prompt.schema, modules_reused=0,
                  modules_encoded=0, cached_tokens=cached, ttft_ms=round((first - start) * 1000, 3),
                  arm_ttft_ms=round((first - sent) * 1000, 3),
                  decode_ms_per_token=None if decode is None else round(decode, 3),
                  queue_ms=round((sent - start) * 1000, 3), note=rendered.compiled.note,
                  uncached_documents=dict(rendered.compiled.uncached))
    finish = "stop" if stopped or end.finish_reason != "length" else "length"
    return Outcome(text, finish, Usage(prompt_tokens=prompt, completion_tokens=completion,
                                       total_tokens=prompt + completion,
                                       prompt_tokens_details=PromptTokensDetails(cached_tokens=cached)), pml)
