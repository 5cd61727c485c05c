"""What the served studio does when it stops, however it stops: Ctrl-C, SIGTERM, SIGHUP or a normal exit.

    stop = install(demo)   # before demo.launch, in the main thread
    demo.launch(...)       # blocks until Ctrl-C
    stop()                 # runs once, whoever calls it first: this, a signal or atexit

:func:`stop` writes the runs waiting for the run log (or saves them to the recovery file,
:meth:`studio.state.Studio.save_pending`) and removes the temporary download folder (schema downloads and the
CSV export of the whole run log). SIGTERM and SIGHUP would end the process without running any Python: their
handlers run the cleanup and exit with status 128 + the signal's number. Gradio runs uvicorn in a thread, whose
server installs no signal handler, so these replace only the default action; a SIGHUP ignored by the parent
(``nohup``) stays ignored, and a handler already installed by Python code is called after the cleanup.
Ctrl-C keeps Python's own handling (Gradio closes the server and ``launch`` returns).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def stop(studio, downloads: Path | None) -> None:
    """Remove ``downloads``; write or save the studio's waiting runs (a console line when there were any)."""
    if downloads is not None:  # first: it holds the whole run log, and saving runs may wait for a locked log
        shutil.rmtree(downloads, ignore_errors=True)
    for line in studio.save_pending():
        print(line, file=sys.stderr, flush=True)


def install(demo) -> Callable[[], bool]:
    """Run :func:`stop` for ``demo`` (built by :func:`studio.app.build_app`) at exit and on SIGTERM and SIGHUP.

    Returns the cleanup, to call once the server has stopped; it runs once. The signal handlers are installed
    only from the main thread (Python allows no other)."""
    cleanup = Once(lambda: stop(demo.studio, getattr(demo, "downloads", None)))
    atexit.register(cleanup)
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if previous is not signal.SIG_IGN:
                signal.signal(signum, _handler(cleanup, previous))
    return cleanup


class Once:
    """``fn`` as a call that runs it the first time only; a signal that arrives during the cleanup does not
    restart it (signal handlers run in the main thread, between two of its steps)."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self.state = "waiting"  # waiting | running | done
        self._lock = threading.RLock()  # reentrant: a handler may interrupt the thread that holds it

    def __call__(self) -> bool:
        """Run ``fn`` unless it ran or is running; whether it has finished (now or before)."""
        with self._lock:
            if self.state != "waiting":
                return self.state == "done"
            self.state = "running"
        try:
            self.fn()
        finally:
            self.state = "done"
        return True


def _handler(cleanup: Once, previous) -> Callable:
    """A signal handler: the cleanup, then ``previous`` when it is Python code, else exit with 128 + signum.

    A signal that interrupts a cleanup under way returns at once: that cleanup finishes, then the process ends
    the way it was already ending. ``os._exit``: the server thread and a model load or Compare on the engine
    thread would hold a normal exit until they finish; a stop asked by a signal does not wait for them."""

    def handle(signum, frame) -> None:
        try:
            if not cleanup():
                return
        except Exception as err:  # noqa: BLE001 (the process is ending: say why the cleanup failed, then end it)
            print(f"pml-studio: error: the cleanup at stop failed: {err}", file=sys.stderr)
        if callable(previous):
            previous(signum, frame)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    return handle
