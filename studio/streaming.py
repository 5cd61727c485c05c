"""All of the studio's torch work runs on one engine thread, its progress read as a generator (Gradio streams them).

Why one thread: libgomp keeps idle OpenMP threads spinning only while it manages no more threads than CPUs; a
second thread calling torch makes every team sleep between parallel regions, and runs on a second thread decoded
~1.5x slower (53-59 vs 83-91 ms/token, 0.5B int8, 2 cores).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generator, Iterator

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


def drive_on_engine_thread(scheduler) -> None:
    """Have ``scheduler`` (engine/run/scheduler.py) drive its requests on the engine thread whenever they arrive."""
    scheduler.wake = lambda: on_engine_thread_soon(scheduler.drive)


def in_thread(events: Callable[[], Generator], tick: float | None = None, stop: threading.Event | None = None,
              pick: Callable[[Any], bool] | None = None) -> Iterator[tuple]:
    """Iterate the generator ``events()`` on the engine thread: ``("event", e)`` for each event ``pick(e)`` keeps
    (``pick`` runs there; default: every one), ``("tick",)`` after ``tick`` quiet seconds, then ``("done", what it
    returned)``. Once ``stop`` is set (or the studio stops) the generator is closed between two events and
    ``("stopped",)`` ends the stream; its exception is raised here."""
    out: queue.Queue = queue.Queue()
    stopped = stop_asked(stop or threading.Event())

    def run() -> None:
        try:
            gen = events()
            while True:
                if stopped():
                    gen.close()  # the run ends here: its locks released, its buffers free
                    return out.put(("stopped",))
                try:
                    event = next(gen)
                except StopIteration as done:
                    return out.put(("done", done.value))
                if pick is None or pick(event):
                    out.put(("event", event))
        except BaseException as err:  # handed to the reader, which raises it
            out.put(("error", err))

    _engine.submit(run)
    while True:
        try:
            item = out.get(timeout=tick)
        except queue.Empty:
            yield ("tick",)
            continue
        if item[0] == "error":
            raise item[1]
        yield item
        if item[0] in ("done", "stopped"):
            return


def with_progress(work: Callable[[Callable[[int, int, str], None]], Any],
                  progress: Callable[[int, int, str], None] | None) -> Any:
    """``work(report)`` on the engine thread (a benchmark's steps, not a run); each ``report(done, total, label)``
    reaches ``progress`` here as it is made."""
    told: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            told.put(("done", work(lambda *step: told.put(("progress", *step)))))
        except BaseException as err:  # handed to the reader, which raises it
            told.put(("error", err))

    _engine.submit(run)
    while True:
        kind, *payload = told.get()
        if kind == "error":
            raise payload[0]
        if kind == "done":
            return payload[0]
        if progress is not None:
            progress(*payload)
