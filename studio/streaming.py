"""Running engine work in a thread and reading its progress as a generator (Gradio streams generators).

    for kind, *payload in in_thread(lambda emit: engine.compare(..., on_token=lambda p, t: emit(("token", p, t)))):
        ...   # ("token", path, text) ..., then ("done", result)

An exception in the work is raised from the generator, after the events emitted before it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

Emit = Callable[[tuple], None]


def in_thread(work: Callable[[Emit], Any], name: str = "pml-work") -> Iterator[tuple]:
    """Run ``work(emit)`` in a daemon thread; yield every emitted event, then ``("done", result)``."""
    events: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            events.put(("done", work(events.put)))
        except BaseException as err:  # handed to the reader, which raises it
            events.put(("error", err))

    threading.Thread(target=run, name=name, daemon=True).start()
    while True:
        event = events.get()
        if event[0] == "error":
            raise event[1]
        yield event
        if event[0] == "done":
            return
