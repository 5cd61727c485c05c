"""The API's requests on the engine: one at a time on the studio's engine thread, a bounded queue before it.

A route turns a request into a :class:`Work` (validated, nothing run yet) and :meth:`ApiService.submit` queues it
as a :class:`Job` on the engine thread (studio/streaming.py: all torch work of the process runs there, so two
requests never time each other, and the studio's own Compares take their turn too). More than ``max_queue``
requests waiting is a 429. On the engine thread a job compiles its request to PML (studio/api/modes.py), checks
that the prompt and the answer fit the model's context (a transparent request whose documents sit too far in
position space is placed again, compactly, once), runs ``Engine.compare`` with the one arm asked for, and sends
its events to the route's event loop: ``("progress", words)`` as each unit a streamed request sees first is encoded
(the route sends it as an SSE comment), ``("token", text so far)`` while streaming, then ``("done", Outcome)`` or
``("error", ApiError)``. The job's ``stop`` event (set when the client goes away) ends the run within a token
(``Engine.compare(should_stop=)``); a job whose client left before it started does nothing.

Every answered request is a row of the run log with source ``api``: written at once, or, when the log refuses it
(locked, full disk), kept with the studio's waiting runs (``record``: :meth:`studio.state.Studio.record`), written
with the next run or saved at stop for the next start.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

from engine.arms.registry import REGISTRY, Reads, Sampling
from engine.errors import ContextLengthError, EngineError
from engine.runlog import RunLogError

from ..arm_views import document
from ..streaming import on_engine_thread_soon, stop_asked
from . import modes
from .defaults import DEFAULT_ARM, MAX_QUEUE, MAX_TOKENS_CAP
from .errors import ApiError, from_engine
from .positions import PositionRegistry
from .schemas import SchemaBook
from .types import PmlInfo, PromptTokensDetails, Usage
from .usage import Visible, cached_tokens, cut, finish_reason, module_sources

DEFAULT_MAX_TOKENS = {"chat": 1024, "completion": 16}  # without max_tokens (OpenAI's completions default: 16)
SOURCE = "api"  # the run log's source column for API requests


@dataclass(frozen=True)
class Work:
    """One validated request, ready for the engine."""

    endpoint: str  # "chat" | "completion"
    arm: str
    how: str  # explicit | auto | marked | transparent | plain
    max_tokens: int | None  # None: the endpoint's default, or the room the prompt leaves
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    turns: tuple[modes.Turn, ...] = ()
    prompt: str = ""  # a completions prompt
    schema: str = ""  # explicit PML (a name or the text)
    pml_prompt: str = ""
    stream: bool = False


@dataclass(frozen=True)
class Outcome:
    text: str
    finish_reason: str
    usage: Usage
    pml: PmlInfo


class Job:
    """A Work on its way through the engine: its events (read on the route's loop) and its stop flag."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop):
        self.work, self.loop = work, loop
        self.stop = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()
        self.queued_at = time.perf_counter()

    def put(self, event: tuple) -> None:
        """Hand ``event`` to the route's loop (from the engine thread); dropped when the loop has closed."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.stop.set()

    async def next(self) -> tuple:
        return await self.events.get()


class ApiService:
    """What the routes call: the engine (through ``engine_of``, read at each request: the studio may swap it), the
    run log, the position registry of transparent documents and the bounded queue."""

    def __init__(self, engine_of: Callable, runlog=None, *, default_arm: str | None = None,
                 max_queue: int = MAX_QUEUE, max_tokens_cap: int = MAX_TOKENS_CAP, metrics=None,
                 record: Callable | None = None):
        """``record(data, schema, prompt, source=, toast=)``: where a run goes instead of ``runlog.record``
        (the studio's, which keeps a run the log refuses); its ``logged`` report gives the run's id."""
        default_arm = default_arm or DEFAULT_ARM
        if default_arm not in REGISTRY:
            raise EngineError(f"unknown arm '{default_arm}' as the API's default; arms: {', '.join(REGISTRY)}")
        self.engine_of, self.runlog, self.metrics, self.record = engine_of, runlog, metrics, record
        self.default_arm, self.max_queue, self.max_tokens_cap = default_arm, max_queue, max_tokens_cap
        self.positions: dict[str, PositionRegistry] = {}  # by tokenizer + template (the studio may load another model)
        self.schemas = SchemaBook(runlog)
        self.waiting = 0
        self._lock = threading.Lock()

    # -- public API -----------------------------------------------------------------------------

    def model_ids(self) -> tuple[str, ...]:
        """The names a request may give as ``model``: the engine's model as configured (first), and as loaded."""
        engine = self.engine_of()
        names = [engine.config.model]  # never None: RunConfig names the default model
        if engine.loaded and engine.lm.name not in names:
            names.append(engine.lm.name)
        return tuple(names)

    def submit(self, work: Work, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue ``work`` on the engine thread; ApiError 429 when :attr:`max_queue` requests wait already."""
        with self._lock:
            if self.waiting >= self.max_queue:
                raise ApiError(429, f"{self.waiting} requests are waiting for the engine, the most this server "
                               f"queues (--max-queue {self.max_queue}); retry in a moment",
                               type="rate_limit_exceeded", code="queue_full")
            self.waiting += 1
        job = Job(work, loop)
        on_engine_thread_soon(self._run, job)
        return job

    # -- on the engine thread -------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        with self._lock:
            self.waiting -= 1
        if stop_asked(job.stop)():  # the client left while it waited, or the studio is stopping
            return job.put(("error", ApiError(499, "the client closed the request", code="client_closed_request")))
        try:
            job.put(("done", self._answer(job)))
        except Exception as err:  # every failure goes to the client as an OpenAI error, none escapes the thread
            job.put(("error", from_engine(err, "messages" if job.work.endpoint == "chat" else "prompt")))

    def _answer(self, job: Job) -> Outcome:
        work, engine = job.work, self.engine_of()
        queue_ms = (time.perf_counter() - job.queued_at) * 1000
        start = time.perf_counter()
        compiled, sampling = self._fit(engine, work)
        cfg = engine.config.with_(arms=(work.arm,), warmup=False)  # a server's prefix cache holds what it served
        first: list[float] = []
        shown = Visible(sampling.stop)  # the stop strings checked here, on the engine thread, not on the loop

        def on_token(arm: str, text: str) -> None:
            if not first:
                first.append(time.perf_counter())
            if work.stream:
                job.put(("token", shown(text)))

        def progress(done: int, total: int, label: str) -> None:
            if work.stream and label != "already encoded":  # only real encoding: a warm schema says nothing
                job.put(("progress", f"encoding {done}/{total} units: {label}"))

        res = engine.compare(compiled.schema, compiled.prompt, sampling, config=cfg, on_token=on_token,
                             progress=progress, should_stop=stop_asked(job.stop), schema_source="request schema",
                             prompt_source="request prompt")
        ttft_ms = ((first[0] if first else time.perf_counter()) - start) * 1000
        return self._outcome(engine, work, compiled, sampling, res, ttft_ms, queue_ms)

    def _fit(self, engine, work: Work) -> tuple[modes.Compiled, Sampling]:
        """The request's PML and its sampling, with max new tokens checked against (or taken from) the room the
        prompt leaves in the model's context; transparent documents too far along are placed compactly once."""
        compiled = self._compile(engine, work, compact=False)
        limit = engine.codec.max_positions
        for compact in (False, True):
            if compact:
                compiled = self._compile(engine, work, compact=True)
            plan = engine.plan(engine.layout(compiled.schema, "request schema"), compiled.prompt, "request prompt")
            room = limit - max(plan.max_position + 1, plan.prompt_tokens)
            asked = work.max_tokens or min(DEFAULT_MAX_TOKENS[work.endpoint], self.max_tokens_cap)
            if room >= asked or (room >= 1 and work.max_tokens is None):
                return compiled, Sampling(max_new_tokens=min(asked, room), temperature=work.temperature,
                                          top_p=work.top_p, seed=work.seed, stop=work.stop)
            if not compiled.documents:
                break
        raise ContextLengthError(
            f"this model's context is {limit} tokens; the prompt takes {plan.prompt_tokens} (its last position "
            f"{plan.max_position}) and {asked} new tokens were asked for: at most {max(room, 0)} fit after it; "
            "ask for fewer max_tokens or send shorter messages")

    def _compile(self, engine, work: Work, compact: bool) -> modes.Compiled:
        if work.how == "explicit":
            return modes.Compiled(self.schemas.text(work.schema), work.pml_prompt, "explicit")
        how = work.how if REGISTRY[work.arm].reads == Reads.MODULES else "plain"  # the others read no modules
        positions = self.positions.setdefault(engine.codec.fingerprint, PositionRegistry())
        if work.endpoint == "completion":
            return modes.completion_pml(work.prompt, how, engine.layout, positions, engine.codec.max_positions, compact)
        return modes.chat_pml(list(work.turns), how, engine.layout, positions, engine.codec.max_positions, compact)

    def _outcome(self, engine, work: Work, compiled: modes.Compiled, sampling: Sampling, res, ttft_ms: float,
                 queue_ms: float) -> Outcome:
        run = res.arm(work.arm).run
        text, stopped = cut(run.text, sampling.stop)
        prompt_tokens, completion = res.prompt.prompt_tokens, len(run.token_ids)
        cached = cached_tokens(res, work.arm)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                      total_tokens=prompt_tokens + completion,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        reused, encoded = module_sources(res)
        detail = res.arm(work.arm).detail
        kept = getattr(detail, "kept", None)
        pml = PmlInfo(arm=work.arm, mode=compiled.mode, schema_name=res.prompt.schema, modules_reused=reused,
                      modules_encoded=encoded, routed_kept=None if kept is None else list(kept), cached_tokens=cached,
                      routed_path=getattr(detail, "path", None), recomputed_tokens=run.recomputed_tokens,
                      ttft_ms=round(ttft_ms, 3), arm_ttft_ms=round(run.ttft_ms, 3),
                      decode_ms_per_token=None if run.decode_ms_per_token is None else round(run.decode_ms_per_token, 3),
                      queue_ms=round(queue_ms, 3), encode_ms=round((res.encode or {}).get("ms") or 0.0, 3),
                      note=compiled.note)
        pml = pml.model_copy(update={"run_id": self._log(res, compiled)})
        return Outcome(text, finish_reason(run.token_ids, stopped, tuple(engine.lm.eos_ids), sampling.max_new_tokens),
                       usage, pml)

    def _log(self, res, compiled: modes.Compiled) -> int | None:
        """The run's row in the run log (source ``api``); None when there is no log or it refused the row (kept
        to be written later, with ``record``)."""
        if self.record is not None:
            return self.record(document(res), compiled.schema, compiled.prompt, source=SOURCE, toast=False)["run_id"]
        if self.runlog is None:
            return None
        try:
            return self.runlog.record(document(res), compiled.schema, compiled.prompt, source=SOURCE)
        except RunLogError as err:
            from .errors import log

            log.warning("an API run was not logged: %s", err)
            return None


def random_seed() -> int:
    """A seed for a sampled request that gives none (OpenAI's: each such request samples anew)."""
    return secrets.randbits(63)
