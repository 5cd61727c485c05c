"""The API's requests, each compiled to PML (modes.py), prepared once (``Engine.prepare``), run as a request of the
engine's scheduler on the studio's engine thread (engine/run/scheduler.py: requests' runs decode together) and
logged (source ``api``); past ``--max-queue`` in flight, a 429."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from engine.errors import ContextLengthError, EngineError
from engine.public import REGISTRY, FirstToken, Reads, Request, Sampling, Stopped, Token, UnitEncoded
from engine.runlog import RunLogError

from ..arm_views import document
from ..streaming import drive_on_engine_thread, stop_asked
from . import modes
from .defaults import DEFAULT_ARM, MAX_QUEUE, MAX_TOKENS_CAP
from .errors import ApiError, from_engine
from .positions import PositionRegistry
from .schemas import SchemaBook
from .types import PmlInfo, PromptTokensDetails, Usage
from .usage import Visible, cached_tokens, cut, finish_reason, module_sources, routed_out_tokens

if TYPE_CHECKING:
    from engine.public import Comparison
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
    """A Work on the engine thread (or a front's task): its events (read on the route's loop), its stop flag."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop):
        self.work, self.loop = work, loop
        self.stop = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()
        self.queued_at = time.perf_counter()
        self.task: asyncio.Task | None = None  # a front's forwarding task: cancelled when the client leaves

    def leave(self) -> None:
        """The client left (or its answer is whole): its run stops within a token, a forwarding task at once (its
        upstream request closed, its place in the queue freed)."""
        self.stop.set()
        if self.task is not None and not self.task.done():
            self.loop.call_soon_threadsafe(self.task.cancel)

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

    def healthy(self) -> bool:
        """The model is loaded (``/health``)."""
        return self.engine_of().loaded

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
        """Hand ``work`` to the engine's scheduler (its runs decode beside the others'); 429 when
        :attr:`max_queue` requests are in flight already."""
        with self._lock:
            if self.waiting >= self.max_queue:
                raise queue_full(f"{self.waiting} requests are in flight, the most this server takes at once",
                                 self.max_queue)
            self.waiting += 1
        job, engine = Job(work, loop), self.engine_of()
        seen = _Seen(job)
        drive_on_engine_thread(engine.scheduler)
        engine.scheduler.submit(Request(self._serve(job, engine, seen), seen.sink, lambda out: self._end(job, out),
                                        lambda err: self._end(job, err), stop_asked(job.stop)))
        return job

    def _end(self, job: Job, out: "Outcome | BaseException") -> None:
        with self._lock:
            self.waiting -= 1
        if isinstance(out, Outcome):
            return job.put(Event("done", out))
        if isinstance(out, Stopped):
            return job.put(Event("error", ApiError(499, "the client closed the request; its run stopped",
                                                   code="client_closed_request")))
        job.put(Event("error", from_engine(out, "messages" if job.work.endpoint == "chat" else "prompt")))

    def _serve(self, job: Job, engine: Engine, seen: "_Seen"):
        """The request the scheduler drives: fitted and prepared when the engine takes it up, run, its Outcome."""
        work = job.work
        start = time.perf_counter()
        queue_ms = (start - job.queued_at) * 1000
        fitted = self._fit(engine, work)
        seen.shown = Visible(fitted.sampling.stop)
        cfg = engine.config.with_(arms=(work.arm,), warmup=False)  # its prefix cache: what it served
        res = yield from engine.request(fitted.prepared, fitted.sampling, config=cfg)
        ttft_ms = ((seen.first or time.perf_counter()) - start) * 1000
        return self._outcome(engine, work, fitted, res, ttft_ms, queue_ms)

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
        _check_ran(res, work.arm)
        run = res.arm(work.arm).run
        text, stopped = cut(run.text, sampling.stop)
        prompt_tokens, completion = res.prompt.prompt_tokens, len(run.token_ids)
        cached = cached_tokens(res, work.arm)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                      total_tokens=prompt_tokens + completion,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        reused, encoded = module_sources(res)
        answered = res.arm(work.arm)
        routing = answered.routing
        pml = PmlInfo(arm=work.arm, mode=compiled.mode, schema_name=res.prompt.schema, modules_reused=reused,
                      modules_encoded=encoded, routed_kept=None if routing is None else list(routing.kept),
                      cached_tokens=cached, routed_path=None if routing is None else routing.path,
                      recomputed_tokens=run.recomputed_tokens,
                      routed_out_tokens=routed_out_tokens(res, work.arm),
                      ttft_ms=round(ttft_ms, 3), arm_ttft_ms=round(run.ttft_ms, 3),
                      decode_ms_per_token=None if run.decode_ms_per_token is None else round(run.decode_ms_per_token, 3),
                      queue_ms=round(queue_ms, 3), encode_ms=round((res.encode or {}).get("ms") or 0.0, 3),
                      decode_batch=run.decode_batch, decode_shared=run.decode_shared,
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


class _Seen:
    """What a request's events tell its client as they come (on the engine thread): each token's visible text (stop
    strings cut here, not on the route's loop), each unit encoded (a stream's comment), and when the first token
    came."""

    def __init__(self, job: Job):
        self.job, self.first, self.shown = job, None, Visible(())

    def sink(self, event) -> None:
        stream = self.job.work.stream
        if isinstance(event, (FirstToken, Token)):
            self.first = self.first or time.perf_counter()
            if stream:
                self.job.put(Event("token", self.shown(event.text)))
        elif isinstance(event, UnitEncoded) and stream and event.unit != "already encoded":
            self.job.put(Event("progress", f"encoding {event.done}/{event.total} units: {event.unit}"))


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


# an arm that could not run (a remote arm's server failed), by what stopped it: (status, code)
NOT_RUN = {"unconfigured": (400, "arm_unavailable"), "unavailable": (503, "upstream_unavailable"),
           "timeout": (504, "upstream_timeout"), "mismatch": (503, "upstream_mismatch")}


def _check_ran(res: Comparison, arm: str) -> None:
    """An ApiError when ``arm`` could not run: its reason, never an empty answer (nor a row in the run log)."""
    result = res.arm(arm)
    if result.error is None:
        return
    status, code = NOT_RUN.get(result.error_kind, (502, "upstream_error"))
    raise ApiError(status, f"the {arm} arm could not run: {result.error}",
                   type="invalid_request_error" if status == 400 else "server_error", code=code)


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
