"""Running engine work in a thread and reading its progress as a generator (Gradio streams generators).

    for kind, *payload in in_thread(lambda emit: engine.compare(..., on_token=lambda p, t: emit(("token", p, t)))):
        ...   # ("token", path, text) ..., then ("done", result)

An exception in the work is raised from the generator, after the events emitted before it. With ``tick``
(seconds), a ``("tick",)`` event comes whenever nothing else came for that long, so a reader that holds
updates back (one UI update per 100 ms, not one per token) can flush them.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

Emit = Callable[[tuple], None]


def in_thread(work: Callable[[Emit], Any], name: str = "pml-work", tick: float | None = None) -> Iterator[tuple]:
    """Run ``work(emit)`` in a daemon thread; yield every emitted event (and ``("tick",)`` after ``tick``
    quiet seconds), then ``("done", result)``."""
    events: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            events.put(("done", work(events.put)))
        except BaseException as err:  # handed to the reader, which raises it
            events.put(("error", err))

    threading.Thread(target=run, name=name, daemon=True).start()
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
