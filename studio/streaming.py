"""All of the studio's torch work runs on one engine thread, its progress read as a generator (Gradio streams them).

Why one thread: libgomp keeps idle OpenMP threads spinning only while it manages no more threads than CPUs; a
second thread calling torch makes every team sleep between parallel regions, and runs on a second thread decoded
~1.5x slower (53-59 vs 83-91 ms/token, 0.5B int8, 2 cores).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

Emit = Callable[[tuple], None]
ENGINE_THREAD = "pml-engine"
_engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix=ENGINE_THREAD)
STOPPING = threading.Event()  # set when the studio stops: every run ends within a token


def stop_asked(flag: threading.Event) -> Callable[[], bool]:
    return lambda: flag.is_set() or STOPPING.is_set()


def on_engine_thread(fn: Callable, *args, **kwargs) -> Any:
    if threading.current_thread().name.startswith(ENGINE_THREAD):
        return fn(*args, **kwargs)
    return _engine.submit(fn, *args, **kwargs).result()


def on_engine_thread_soon(fn: Callable, *args) -> None:
    _engine.submit(fn, *args)


def in_thread(work: Callable[[Emit], Any], tick: float | None = None) -> Iterator[tuple]:
    """Yield every event ``work(emit)`` emits on the engine thread (``("tick",)`` after ``tick`` quiet seconds), then
    ``("done", result)``; its exception is raised here."""
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
    for kind, *payload in in_thread(lambda emit: work(lambda *step: emit(("progress", *step)))):
        if kind == "progress" and progress is not None:
            progress(*payload)
        elif kind == "done":
            return payload[0]
