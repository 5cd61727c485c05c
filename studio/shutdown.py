"""What the served studio does when it stops, however it stops: Ctrl-C, SIGTERM, SIGHUP or a normal exit.

    stop = install(demo)   # before demo.launch, in the main thread
    demo.launch(...)       # blocks until the server is closed
    stop()                 # runs once, whoever calls it first: this, a signal or atexit

:func:`stop` writes the runs waiting for the run log (or saves them to the recovery file), removes the temporary
download folder, and prints one line saying so. On SIGINT, SIGTERM and SIGHUP the handler first sets
:data:`studio.streaming.STOPPING` (every run on the engine thread ends within a token), runs the cleanup and ends
the process at once (``os._exit``: a model load or a run being logged would hold a normal exit), within 5 s.
SIGINT's handler is installed even when the studio was started with SIGINT ignored (a background shell's
children inherit that); a SIGTERM or SIGHUP ignored by the parent (``nohup``) stays ignored, and a Python handler
installed before is called after the cleanup.
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

from .streaming import STOPPING

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def stop(studio, downloads: Path | None) -> None:
    """Remove ``downloads``; write or save the studio's waiting runs; print one line saying what was done."""
    removed = downloads is not None and downloads.exists()
    if downloads is not None:  # first: it holds the whole run log, and saving runs may wait for a locked log
        shutil.rmtree(downloads, ignore_errors=True)
    done = studio.save_pending()
    for line in done.notes:
        print(line, file=sys.stderr, flush=True)
    print(stop_line(done, studio.runlog.path, downloads if removed else None), file=sys.stderr, flush=True)


def stop_line(done, log_path: Path, removed: Path | None) -> str:
    """The console's one line for a stop: runs written, saved (where, why) or lost, and the folder removed."""
    said = []
    if done.written:
        said.append(f"{_runs(done.written)} waiting in memory written to the run log {log_path}")
    if done.saved:
        said.append(f"{_runs(done.saved)} the run log could not take saved in {done.where} ({done.error}): "
                    "written to the run log at the next start")
    if done.lost:
        said.append(f"{_runs(done.lost)} not in the run log are lost: {done.error}")
    text = ", ".join(said) or "no run was waiting for the run log"
    text += f"; removed {removed}" if removed is not None else ""
    return f"pml-studio: {'error: ' if done.lost else ''}stopped: {text}"


def install(demo) -> Callable[[], bool]:
    """Run :func:`stop` for ``demo`` (built by :func:`studio.app.build_app`) at exit and on SIGINT, SIGTERM and
    SIGHUP. Returns the cleanup, to call once the server has stopped; it runs once. The signal handlers are
    installed only from the main thread (Python allows no other)."""
    cleanup = Once(lambda: stop(demo.studio, getattr(demo, "downloads", None)))
    atexit.register(cleanup)
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if signum == signal.SIGINT:  # Ctrl-C ends the studio however it was started
                signal.signal(signum, _handler(cleanup, None, status=0))
            elif previous is not signal.SIG_IGN:
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


def _handler(cleanup: Once, previous, status: int | None = None) -> Callable:
    """A signal handler: stop the engine's runs, the cleanup, then ``previous`` when it is Python code, else exit
    with ``status`` (None: 128 + signum; Ctrl-C exits 0, as a studio closed by Ctrl-C always has).

    A signal that interrupts a cleanup under way returns at once: that cleanup finishes, then the process ends
    the way it was already ending."""

    def handle(signum, frame) -> None:
        STOPPING.set()
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
        os._exit(128 + signum if status is None else status)

    return handle


def _runs(n: int) -> str:
    return f"{n} finished run{'s' if n != 1 else ''}"
