"""Running engine work on the studio's one engine thread and reading its progress as a generator (Gradio streams
generators).

    for kind, *payload in in_thread(lambda emit: engine.compare(..., on_token=lambda p, t: emit(("token", p, t)))):
        ...   # ("token", path, text) ..., then ("done", result)

An exception in the work is raised from the generator, after the events emitted before it. With ``tick``
(seconds), a ``("tick",)`` event comes whenever nothing else came for that long, so a reader that holds
updates back (one UI update per 100 ms, not one per token) can flush them.

All of the studio's torch work runs on one thread (:func:`on_engine_thread`, :func:`in_thread`). torch's CPU
threads are an OpenMP team per thread that calls into torch, and libgomp keeps a team's idle threads spinning only
while it manages no more threads than there are CPUs: a second team (a new thread per Compare, a Gradio worker
that once encoded) makes every team's threads sleep between parallel regions, and each of a decode step's few
hundred regions then waits to wake them. Measured on the 0.5B model, int8, 2 cores: 53-59 ms/token with every run
on one thread, 83-91 with runs on a second thread (the studio decoded ~1.5x slower than ``pml-studio run``).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

Emit = Callable[[tuple], None]
ENGINE_THREAD = "pml-engine"
_engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix=ENGINE_THREAD)
STOPPING = threading.Event()  # set when the studio stops (studio/shutdown.py): every run ends within a token


def stop_asked(flag: threading.Event) -> Callable[[], bool]:
    """A run's ``should_stop`` (``Engine.compare``, asked once per token): ``flag`` or the studio stopping."""
    return lambda: flag.is_set() or STOPPING.is_set()


def on_engine_thread(fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` run on the engine thread (directly when already there); its result or exception."""
    if threading.current_thread().name.startswith(ENGINE_THREAD):
        return fn(*args, **kwargs)
    return _engine.submit(fn, *args, **kwargs).result()


def on_engine_thread_soon(fn: Callable, *args) -> None:
    """``fn(*args)`` queued on the engine thread, not waited for (its exception is fn's to report)."""
    _engine.submit(fn, *args)


def in_thread(work: Callable[[Emit], Any], tick: float | None = None) -> Iterator[tuple]:
    """Run ``work(emit)`` on the engine thread (after the work queued before it); yield every emitted event (and
    ``("tick",)`` after ``tick`` quiet seconds), then ``("done", result)``."""
    events: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            events.put(("done", work(events.put)))
        except BaseException as err:  # handed to the reader, which raises it
            events.put(("error", err))

    _engine.submit(run)
    while True:
        try:
            event = events.get(timeout=tick)
        except queue.Empty:
            yield ("tick",)
            continue
        if event[0] == "error":
            raise event[1]
        yield event
        if event[0] == "done":
            return


def with_progress(work: Callable[[Callable[[int, int, str], None]], Any],
                  progress: Callable[[int, int, str], None] | None) -> Any:
    """``work(report)`` on the engine thread; each ``report(done, total, label)`` reaches ``progress`` on this
    thread (where Gradio tracks it). Returns work's result; its exception is raised here."""
    for kind, *payload in in_thread(lambda emit: work(lambda *step: emit(("progress", *step)))):
        if kind == "progress" and progress is not None:
            progress(*payload)
        elif kind == "done":
            return payload[0]
