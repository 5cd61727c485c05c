"""What the served studio does when it stops, however it stops: Ctrl-C, SIGTERM, SIGHUP or a normal exit.

Once: the waiting runs are written or saved, the download folder removed, one line printed. A signal first sets
:data:`studio.streaming.STOPPING` and ends with ``os._exit``, since a model load or a run being logged would hold
a normal exit. SIGINT is handled even when inherited as ignored (a background shell); an ignored SIGTERM or SIGHUP
(``nohup``) stays ignored.
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
    removed = downloads is not None and downloads.exists()
    if downloads is not None:  # first: saving runs may wait for a locked log
        shutil.rmtree(downloads, ignore_errors=True)
    done = studio.save_pending()
    for line in done.notes:
        print(line, file=sys.stderr, flush=True)
    print(stop_line(done, studio.runlog.path, downloads if removed else None), file=sys.stderr, flush=True)


def stop_line(done, log_path: Path, removed: Path | None) -> str:
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
    """Run :func:`stop` for ``demo`` at exit and on SIGINT, SIGTERM and SIGHUP (handlers from the main thread
    only); returns the cleanup, to call once the server has stopped."""
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
    """``fn``, run the first time only; a signal that arrives during the cleanup does not restart it."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self.state = "waiting"  # waiting | running | done
        self._lock = threading.RLock()  # a handler may interrupt the thread that holds it

    def __call__(self) -> bool:
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
    """Stop the engine's runs, clean up, then call ``previous`` when it is Python code, else exit with ``status``
    (None: 128 + signum). A signal during a cleanup under way returns at once."""

    def handle(signum, frame) -> None:
        STOPPING.set()
        try:
            if not cleanup():
                return
        except Exception as err:  # noqa: BLE001 (the process is ending: say why, then end it)
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
