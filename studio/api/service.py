"""The API's requests on the studio's engine thread, one at a time, a bounded queue before it: each compiled to
PML (modes.py), prepared once (``Engine.prepare``), run (``Engine.run``) and logged (source ``api``)."""

from __future__ import annotations

import asyncio
import secrets
from contextlib import closing
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from engine.arms.compare import Done
from engine.arms.registry import REGISTRY, Reads, Sampling
from engine.errors import ContextLengthError, EngineError
from engine.run.events import FirstToken, Token, UnitEncoded
from engine.runlog import RunLogError

from ..arm_views import document
from ..streaming import on_engine_thread_soon, stop_asked
from . import modes
from .defaults import DEFAULT_ARM, MAX_QUEUE, MAX_TOKENS_CAP
from .errors import ApiError, from_engine
from .positions import PositionRegistry
from .schemas import SchemaBook
from .types import PmlInfo, PromptTokensDetails, Usage
from .usage import Visible, cached_tokens, cut, finish_reason, module_sources, routed_out_tokens

if TYPE_CHECKING:
    from engine.arms.compare import Comparison
    from engine.session import Engine, Prepared

DEFAULT_MAX_TOKENS = {"chat": 1024, "completion": 16}  # OpenAI's completions default: 16
SOURCE = "api"  # the run log's source column
RETRY_AFTER_S = 1  # a full queue's Retry-After: a place frees each time the engine takes the next request
EngineOf = Callable[[], "Engine"]  # read at each request: the studio may load another model


@dataclass(frozen=True)
class Work:
    """One validated request; nothing run yet."""

    endpoint: str  # chat | completion
    arm: str
    how: str  # explicit | auto | marked | transparent | plain
    max_tokens: int | None  # None: the default, or the room the prompt leaves
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    turns: tuple[modes.Turn, ...] = ()
    prompt: str = ""  # a completions prompt
    schema: str = ""  # explicit PML: a name or the text
    pml_prompt: str = ""
    stream: bool = False


class Event(NamedTuple):
    kind: str  # progress | token | done | error
    value: str | Outcome | ApiError


@dataclass(frozen=True)
class Fitted:
    """A request as the engine runs it: its PML, prepared once, and its sampling."""

    compiled: modes.Compiled
    prepared: "Prepared"
    sampling: Sampling


@dataclass(frozen=True)
class Outcome:
    text: str
    finish_reason: str
    usage: Usage
    pml: PmlInfo


class Job:
    """A Work on the engine thread: its events (read on the route's loop), its stop flag."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop):
        self.work, self.loop = work, loop
        self.stop = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()
        self.queued_at = time.perf_counter()

    def put(self, event: Event) -> None:
        """Hand ``event`` to the route's loop; dropped when the loop has closed."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.stop.set()

    async def next(self) -> Event:
        return await self.events.get()


class ApiService:
    """The engine, the run log, the documents' positions and the bounded queue, for the routes."""

    def __init__(self, engine_of: EngineOf, runlog=None, *, default_arm: str | None = None,
                 max_queue: int = MAX_QUEUE, max_tokens_cap: int = MAX_TOKENS_CAP, metrics=None,
                 record: Callable[..., dict] | None = None):
        """``record``: :meth:`studio.state.Studio.record`, which keeps a run the log refuses."""
        default_arm = default_arm or DEFAULT_ARM
        if default_arm not in REGISTRY:
            raise EngineError(f"unknown arm '{default_arm}' as the API's default; arms: {', '.join(REGISTRY)}")
        self.engine_of, self.runlog, self.metrics, self.record = engine_of, runlog, metrics, record
        self.default_arm, self.max_queue, self.max_tokens_cap = default_arm, max_queue, max_tokens_cap
        self.positions: dict[str, PositionRegistry] = {}  # by codec fingerprint
        self.schemas = SchemaBook(runlog)
        self.waiting = 0
        self._lock = threading.Lock()

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(REGISTRY)

    async def ready(self) -> None:
        """Nothing to wait for: the engine is here (a front waits for its upstream)."""

    def card(self) -> dict:
        """The ``pml`` object of the model's card."""
        return {"weights": self.engine_of().config.weights, "default_arm": self.default_arm, "arms": list(REGISTRY),
                "separator": modes.SEPARATOR, "min_module_chars": modes.MIN_MODULE_CHARS}

    def model_ids(self) -> tuple[str, ...]:
        """The engine's model as configured (first), and as loaded."""
        engine = self.engine_of()
        names = [engine.config.model]
        if engine.loaded and engine.lm.name not in names:
            names.append(engine.lm.name)
        return tuple(names)

    def submit(self, work: Work, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue ``work`` on the engine thread; 429 when :attr:`max_queue` requests wait already."""
        with self._lock:
            if self.waiting >= self.max_queue:
                raise queue_full(f"{self.waiting} requests are waiting for the engine, the most this server queues",
                                 self.max_queue)
            self.waiting += 1
        job = Job(work, loop)
        on_engine_thread_soon(self._run, job)
        return job

    def _run(self, job: Job) -> None:
        with self._lock:
            self.waiting -= 1
        if stop_asked(job.stop)():
            return job.put(Event("error", ApiError(499, "the client closed the request",
                                                   code="client_closed_request")))
        try:
            job.put(Event("done", self._answer(job)))
        except Exception as err:  # every failure goes to the client, none escapes the thread
            job.put(Event("error", from_engine(err, "messages" if job.work.endpoint == "chat" else "prompt")))

    def _answer(self, job: Job) -> Outcome:
        work, engine = job.work, self.engine_of()
        queue_ms = (time.perf_counter() - job.queued_at) * 1000
        start = time.perf_counter()
        fitted = self._fit(engine, work)
        cfg = engine.config.with_(arms=(work.arm,), warmup=False)  # its prefix cache: what it served
        res, first = self._pull(job, engine.run_events(fitted.prepared, fitted.sampling, config=cfg),
                                Visible(fitted.sampling.stop))
        ttft_ms = ((first or time.perf_counter()) - start) * 1000
        return self._outcome(engine, work, fitted, res, ttft_ms, queue_ms)

    def _pull(self, job: Job, events, shown: Visible) -> tuple[Comparison, float | None]:
        """Iterate the run's ``events`` here, on the engine thread: each token's visible text (stop strings cut
        here, not on the route's loop) and each unit encoded to a stream; closed between two events once the
        client has gone. The Comparison, and when the first token came."""
        stopped, stream, first = stop_asked(job.stop), job.work.stream, None
        with closing(events):
            for event in events:
                if stopped():
                    raise ApiError(499, "the client closed the request; its run stopped", code="client_closed_request")
                if isinstance(event, (FirstToken, Token)):
                    first = first or time.perf_counter()
                    if stream:
                        job.put(Event("token", shown(event.text)))
                elif isinstance(event, UnitEncoded) and stream and event.unit != "already encoded":
                    job.put(Event("progress", f"encoding {event.done}/{event.total} units: {event.unit}"))
                elif isinstance(event, Done):
                    return event.comparison, first
        raise ApiError(500, "the run ended without its result", type="server_error", code="internal_error")

    def _fit(self, engine: Engine, work: Work) -> Fitted:
        """The request prepared, max new tokens checked against (or taken from) the room its prompt leaves;
        documents placed from their context's start when the counts (before the layout, else the plan's) say
        that makes room."""
        asked = work.max_tokens or min(DEFAULT_MAX_TOKENS[work.endpoint], self.max_tokens_cap)
        limit = engine.codec.max_positions

        def compacts(end: int, prompt_tokens: int, spare: int) -> bool:
            return _compacts(limit, end, prompt_tokens, spare, asked, work)

        compiled = self._compile(engine, work, compacts)
        prepared = _prepare(engine, compiled)
        plan = prepared.plan
        if compacts(plan.max_position + 1, plan.prompt_tokens, compiled.spare):  # counts the plan disowned
            compiled = self._compile(engine, work, lambda *_: True)
            prepared = _prepare(engine, compiled)
            plan = prepared.plan
        if work.how == "explicit" and compiled.schema.lstrip().startswith("<"):
            self.schemas.keep(prepared.layout.name, compiled.schema)
        if _fits(plan.room, asked, work):
            sampling = Sampling(max_new_tokens=min(asked, plan.room), temperature=work.temperature, top_p=work.top_p,
                                seed=work.seed, stop=work.stop)
            return Fitted(compiled, prepared, sampling)
        raise ContextLengthError(
            f"this model's context is {engine.codec.max_positions} tokens; the prompt takes {plan.prompt_tokens} (its "
            f"last position {plan.max_position}) and {asked} new tokens were asked for: at most "
            f"{max(plan.room, 0)} fit after it; ask for fewer max_tokens or send shorter messages")

    def _compile(self, engine: Engine, work: Work, compacts: modes.Compacts) -> modes.Compiled:
        how = work.how if REGISTRY[work.arm].reads == Reads.MODULES else "plain"
        positions = self.positions.setdefault(engine.codec.fingerprint, PositionRegistry())
        return compile_work(work, how, engine.codec, self.schemas, positions, compacts)

    def _outcome(self, engine: Engine, work: Work, fitted: Fitted, res: Comparison, ttft_ms: float,
                 queue_ms: float) -> Outcome:
        compiled, sampling = fitted.compiled, fitted.sampling
        run = res.arm(work.arm).run
        text, stopped = cut(run.text, sampling.stop)
        prompt_tokens, completion = res.prompt.prompt_tokens, len(run.token_ids)
        cached = cached_tokens(res, work.arm)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                      total_tokens=prompt_tokens + completion,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        reused, encoded = module_sources(res)
        answered = res.arm(work.arm)
        detail = answered.detail
        kept = getattr(detail, "kept", None)
        pml = PmlInfo(arm=work.arm, mode=compiled.mode, schema_name=res.prompt.schema, modules_reused=reused,
                      modules_encoded=encoded, routed_kept=None if kept is None else list(kept), cached_tokens=cached,
                      routed_path=getattr(detail, "path", None), recomputed_tokens=run.recomputed_tokens,
                      routed_out_tokens=routed_out_tokens(res, work.arm),
                      ttft_ms=round(ttft_ms, 3), arm_ttft_ms=round(run.ttft_ms, 3),
                      decode_ms_per_token=None if run.decode_ms_per_token is None else round(run.decode_ms_per_token, 3),
                      queue_ms=round(queue_ms, 3), encode_ms=round((res.encode or {}).get("ms") or 0.0, 3),
                      note="; ".join(n for n in (compiled.note, arm_note(res, work.arm)) if n),
                      repeat=answered.repeat, store_note=(res.encode or {}).get("store_note") or "",
                      uncached_documents=dict(compiled.uncached))
        pml = pml.model_copy(update={"run_id": self._log(res, compiled)})
        return Outcome(text, finish_reason(run.token_ids, stopped, tuple(engine.lm.eos_ids), sampling.max_new_tokens),
                       usage, pml)

    def _log(self, res: Comparison, compiled: modes.Compiled) -> int | None:
        """The run's row id; None without a log or when it refused the row."""
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


def arm_note(res: Comparison, arm: str) -> str:
    """Why the answering arm reused no more than it did, where its kind of reuse explains it: the prefix arm reuses
    only the longest start this prompt shares with a request served before; a repeat read an earlier answer back."""
    answered = res.arm(arm)
    if answered.repeat:
        return ("a repeat: an earlier request compiled to the same prompt (the same documents, in any order, and the "
                "same other text) was read back, so its TTFT is a lookup's")
    if REGISTRY[arm].reads != Reads.PREFIX_CACHE:
        return ""
    reused, total = answered.run.reused_tokens, res.prompt.prompt_tokens
    if reused >= total - 1:
        return ""
    return (f"the prefix arm reused {reused} of {total} prompt tokens: the longest start this prompt shares with a "
            "request served before (the chat template's opening when nothing more matched); it reuses no document "
            "placed after a difference, as the modular arms (cached, routed) do")


def compile_work(work: Work, how: str, codec, schemas: SchemaBook, positions: PositionRegistry,
                 compacts: modes.Compacts | None = None) -> modes.Compiled:
    """``work`` as one PML schema and prompt: its explicit PML, else its messages or prompt compiled ``how``
    (``compacts``: whether its documents go from their context's start, :func:`modes.chat_pml`)."""
    if work.how == "explicit":
        return modes.Compiled(schemas.text(work.schema), work.pml_prompt, "explicit")
    if work.endpoint == "completion":
        return modes.completion_pml(work.prompt, how, codec, positions, compacts)
    return modes.chat_pml(list(work.turns), how, codec, positions, compacts)


def queue_full(why: str, max_queue: int) -> ApiError:
    return ApiError(429, f"{why} (--max-queue {max_queue}); retry in a moment", type="rate_limit_exceeded",
                    code="queue_full", retry_after=RETRY_AFTER_S)


def random_seed() -> int:
    """A sampled request without a seed samples anew, as OpenAI's."""
    return secrets.randbits(63)


def _prepare(engine: Engine, compiled: modes.Compiled) -> Prepared:
    return engine.prepare(compiled.schema, compiled.prompt, schema_source="request schema",
                          prompt_source="request prompt")


def _compacts(limit: int, end: int, prompt_tokens: int, spare: int, asked: int, work: Work) -> bool:
    """Whether the answer fits only with the documents placed ``spare`` positions earlier."""
    return spare > 0 and not _fits(limit - max(end, prompt_tokens), asked, work) \
        and _fits(limit - max(end - spare, prompt_tokens), asked, work)


def _fits(room: int, asked: int, work: Work) -> bool:
    """Without max_tokens, any room fits (the answer takes what is left)."""
    return room >= asked or (room >= 1 and work.max_tokens is None)
