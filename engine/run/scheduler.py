"""The scheduler every request (an API call, a Compare, a CLI run) goes through, on the torch thread. Each turn
hands on the tokens parked runs gave, fills waiting requests one at a time (shared caches see one writer) for up to
``FILL_BUDGET_S``, then steps every parked run once: vLLM v1's continuous batching in one process. A lease that does
not fit waits first in line."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator

from engine.kv.pool import PoolFull
from engine.model.load import LoadedModel
from engine.run.decode import Breathe, Park, Room, step_all
from engine.run.events import Directive, Token

_ids = itertools.count(1)
# fill work per turn before the batch steps (vLLM's token budget, in time): two or three questions' fills; a stream
# waits at most this plus one event between tokens (docs/api.md)
FILL_BUDGET_S = 0.4


class Stopped(Exception):
    """Its client left."""


@dataclass(eq=False)
class Request:
    """A generator of events; ``sink``, ``done``, ``fail`` take its events, return value and error."""

    events: Generator
    sink: Callable[[object], None]
    done: Callable[[object], None] = lambda value: None
    fail: Callable[[BaseException], None] = lambda err: None
    stopped: Callable[[], bool] = lambda: False
    id: int = field(default_factory=lambda: next(_ids))
    queued_at: float = field(default_factory=time.perf_counter)
    park: Park | None = None
    room: Room | None = None
    over: bool = False


@dataclass
class Load:
    """What the scheduler holds now (``/metrics``)."""

    waiting: int  # requests not filling nor decoding
    running: int
    sequences: int  # runs decoding
    last_batch: int  # rows of the last decode step
    steps: int


class Scheduler:
    """Drives requests on ``lm``; ``wake()``: work arrived, call :meth:`drive` on the torch thread."""

    def __init__(self, lm: Callable[[], LoadedModel], wake: Callable[[], None] | None = None,
                 lock: threading.RLock | None = None):
        """``lock``: held through each turn."""
        self.lm, self.wake, self.turn_lock = lm, wake, lock or threading.RLock()
        self.requests: list[Request] = []
        self._inbox: deque[Request] = deque()
        self._lock = threading.Lock()
        self._driver: threading.Thread | None = None
        self.last_batch = self.steps = 0
        self.on_step: Callable[[int], None] | None = None  # each decode step's rows

    def submit(self, request: Request) -> None:
        """Queue ``request`` (any thread); it starts at the next turn."""
        with self._lock:
            self._inbox.append(request)
            idle = self._driver is None
        if idle and self.wake is not None:
            self.wake()

    def drive(self) -> None:
        """Turn until no request is left (on the thread that runs torch)."""
        if not self._claim():
            return
        try:
            while self._turn():
                pass
        finally:
            self._release()

    def stream(self, events: Generator) -> Generator:
        """``events``'s events, driven here (or by the thread that drives) beside all else; its return value."""
        out: deque = deque()
        box: dict = {}
        ready = threading.Event()

        def tell(key: str):
            return lambda value: (box.setdefault(key, value), ready.set())

        request = Request(events, lambda e: (out.append(e), ready.set()), tell("done"), tell("error"),
                          lambda: box.get("closed", False))
        self.submit(request)
        try:
            yield from self._follow(request, out, ready)
        finally:
            box["closed"] = True
            if not request.over and self._claim():  # left early: closed now
                try:
                    self._turn()
                finally:
                    self._release()
        if "error" in box:
            raise box["error"]
        return box.get("done")

    def load(self) -> Load:
        with self._lock:
            inbox = len(self._inbox)
        filling = next((r for r in self.requests if r.park is None and r.room is None), None)
        parked = [r for r in self.requests if r.park is not None]
        waiting = inbox + sum(1 for r in self.requests if r is not filling and r.park is None)
        return Load(waiting=waiting, running=len(parked) + (filling is not None),
                    sequences=len(self._parked_runs_not_done()),
                    last_batch=self.last_batch, steps=self.steps)

    def _follow(self, request: Request, out: deque, ready: threading.Event) -> Iterator:
        while True:
            ready.clear()
            if self._claim():
                try:
                    while not out and not request.over and self._turn(lambda: bool(out)):
                        pass
                finally:
                    self._release()
            elif not out and not request.over:
                ready.wait(0.1)  # another thread drives
            while out:
                yield out.popleft()
            if request.over and not out:
                return

    def _claim(self) -> bool:
        with self._lock:
            if self._driver is not None and self._driver is not threading.current_thread():
                return False
            self._driver = threading.current_thread()
            return True

    def _release(self) -> None:
        with self._lock:
            self._driver = None
            left = bool(self._inbox or self.requests)
        if left and self.wake is not None:
            self.wake()

    def _turn(self, shown: Callable[[], bool] = lambda: False) -> bool:
        """One turn; False once nothing is left to do."""
        with self.turn_lock:
            return self._turn_locked(shown)

    def _turn_locked(self, shown: Callable[[], bool]) -> bool:
        with self._lock:
            self.requests += self._inbox
            self._inbox.clear()
        self._close_stopped()
        for r in [r for r in self.requests if r.park is not None and r.park.tokens and not r.park.done]:
            r.park = None
            self._advance(r)
        filling = self._fill(shown)
        self._close_stopped()
        stepped = self._step()
        if filling is not None and filling.room is not None and not stepped and self._next_to_fill() is filling:
            self._starved(filling)
        return bool(self.requests)

    def _fill(self, shown: Callable[[], bool]) -> Request | None:
        """Fill for ``FILL_BUDGET_S`` or until ``shown()`` (the driver's request has events); the last filled."""
        deadline, filling = time.perf_counter() + FILL_BUDGET_S, None
        while (nxt := self._next_to_fill()) is not None:
            filling, filling.park = nxt, None
            self._advance(filling)
            if filling.room is not None or time.perf_counter() >= deadline or shown():
                break
        return filling

    def _close_stopped(self) -> None:
        for r in [r for r in self.requests if r.stopped()]:
            self._close(r, Stopped("the request was stopped"))

    def _next_to_fill(self) -> Request | None:
        """One whose runs all ended (it frees leases), else the oldest not decoding."""
        done = next((r for r in self.requests if r.park is not None and r.park.done), None)
        return done or next((r for r in self.requests if r.park is None), None)

    def _advance(self, request: Request) -> None:
        """Run ``request`` to its next event that is not a token (handed on), a directive, or its end."""
        while True:
            try:
                event = next(request.events)
            except StopIteration as end:
                return self._end(request, lambda: request.done(end.value))
            except BaseException as err:  # noqa: BLE001 (its failure is its own)
                return self._end(request, lambda: request.fail(err))
            request.room = None
            if isinstance(event, Park):
                request.park = event
                return
            if isinstance(event, Room):
                request.room = event
                return
            if isinstance(event, Breathe):
                return
            if not isinstance(event, Directive):
                request.sink(event)
            if not isinstance(event, Token):
                return

    def _step(self) -> bool:
        """One decode step of every parked run; whether there was one."""
        runs = self._parked_runs_not_done()
        if not runs:
            return False
        parked = [r for r in self.requests if r.park is not None and not r.park.done]
        owner = {id(s): r for r in parked for s in r.park.runs}
        try:
            tokens = step_all(self.lm(), runs, {k: r.id for k, r in owner.items()})
        except BaseException as err:  # noqa: BLE001 (it fails the requests it was for)
            for r in parked:
                self._close(r, err)
            return True
        for run, token in zip(runs, tokens):
            owner[id(run)].park.tokens.append(token)
        self.steps += 1
        self.last_batch = len(runs)
        if self.on_step is not None:
            self.on_step(len(runs))
        return True

    def _parked_runs_not_done(self) -> list:
        return [s for r in self.requests if r.park is not None for s in r.park.runs if not s.done]

    def _starved(self, request: Request) -> None:
        """Nothing running will free room for ``request``."""
        stats = request.room.pool.stats()
        self._close(request, PoolFull(
            f"the KV pool ({stats['tokens']:,} tokens) has no room for {request.room.tokens:,} more and nothing "
            f"running will free any ({stats['used_tokens']:,} are held by this request's own runs); raise "
            "--kv-budget-mb, ask for fewer tokens or run its arms apart"))

    def _close(self, request: Request, err: BaseException) -> None:
        """Close ``request``'s generator (its leases released); ``err`` ends it."""
        try:
            request.events.close()
        except BaseException:  # noqa: BLE001
            pass
        self._end(request, lambda: request.fail(err))

    def _end(self, request: Request, tell: Callable[[], None]) -> None:
        request.over, request.park, request.room = True, None, None
        if request in self.requests:
            self.requests.remove(request)
        tell()
