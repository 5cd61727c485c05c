"""The arms' texts while a Compare runs, fetched by the page outside Gradio's event stream.

Why: every message Gradio streams to the page costs the browser ~25-40 ms of CPU whatever it changes (its client
handling one message; measured with chromium's tracing), and on a two-core machine that CPU comes out of the
decoding the page shows, about twice over (a decode step's two threads wait for the one the browser preempted):
a streamed update every 0.1 s made the studio's decode ~45 % slower than `pml-studio run`'s. So while the page
watches, a Compare sends through Gradio only its start, the encoding progress and its end; the growing texts go
into a :class:`LiveRun`, which assets/studio.js fetches every 250 ms (a few hundred bytes of JSON written
into the columns with ``textContent``: about a millisecond of the browser's time).

A run is named by an unguessable id (128 bits) that the page learns from the Compare's first update; the answers
are plain JSON without CORS headers (only the studio's own page can read them), and the guard (studio/guard.py)
refuses foreign Hosts before this middleware sees a request. A Compare nobody polls (the API, a test, a page
without JavaScript) streams its texts through Gradio as before (studio/tabs/compare.py, ``UPDATE_EVERY``).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import OrderedDict

PATH = "/pml-live/"
ACTIVE_S = 0.5  # an arm that grew this recently is generating (arms decoded together all are)
WATCHED_S = 2.0  # a run polled this recently is being watched (a background tab polls about once a second)
KEEP = 32  # runs remembered (a finished run answers `done` until it is pushed out)


class LiveRun:
    """One Compare's texts so far, the arms generating and the line the page shows above the columns."""

    def __init__(self, arms):
        self.id = secrets.token_urlsafe(16)
        self.texts = {arm: "" for arm in arms}
        self.grew: dict[str, float] = {}  # arm -> time.monotonic() of its last token
        self.message = ""
        self.done = False
        self.polled = float("-inf")  # time.monotonic() of the last fetch
        self._lock = threading.Lock()

    def show(self, arm: str, text: str, message: str) -> None:
        with self._lock:
            self.texts[arm], self.message = text, message
            self.grew[arm] = time.monotonic()

    def finish(self) -> None:
        with self._lock:
            self.done = True

    @property
    def watched(self) -> bool:
        """Whether a page fetched this run within :data:`WATCHED_S`."""
        return time.monotonic() - self.polled < WATCHED_S

    def reply(self) -> dict:
        """What a fetch gets (and the fetch is counted)."""
        with self._lock:
            self.polled = now = time.monotonic()
            active = [] if self.done else [arm for arm, t in self.grew.items() if now - t < ACTIVE_S]
            return {"texts": dict(self.texts), "active": active, "message": self.message, "done": self.done}

    def marker(self) -> str:
        """The hidden element that tells the page which run to fetch (put in the Compare's summary)."""
        return f'<span class="pml-live" data-live="{self.id}" hidden></span>'


class LiveRuns:
    """The runs the page may fetch, newest last (at most :data:`KEEP`)."""

    def __init__(self):
        self._runs: OrderedDict[str, LiveRun] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, arms) -> LiveRun:
        run = LiveRun(arms)
        with self._lock:
            self._runs[run.id] = run
            while len(self._runs) > KEEP:
                self._runs.popitem(last=False)
        return run

    def get(self, run_id: str) -> LiveRun | None:
        with self._lock:
            return self._runs.get(run_id)


RUNS = LiveRuns()


class LiveRoute:
    """ASGI middleware answering ``GET /pml-live/<id>`` with the run's :meth:`LiveRun.reply` (404 when unknown)."""

    def __init__(self, app, runs: LiveRuns = RUNS):
        self.app, self.runs = app, runs

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(PATH) or scope.get("method") != "GET":
            return await self.app(scope, receive, send)
        run = self.runs.get(path[len(PATH):])
        status, doc = (200, run.reply()) if run is not None else (404, {"done": True, "error": "no such run"})
        body = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"cache-control", b"no-store"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
