"""The arms' texts while a Compare runs, streamed to the page outside Gradio's event stream.

Why: every message Gradio streams to the page costs the browser ~25-40 ms of CPU whatever it changes (its client
handling one message; measured with chromium's tracing), and on a two-core machine that CPU comes out of the
decoding the page shows, about twice over (a decode step's two threads wait for the one the browser preempted):
a streamed update every 0.1 s made the studio's decode ~45 % slower than `pml-studio run`'s. So while the page
watches, a Compare sends through Gradio only its start, the encoding progress and its end; the growing texts go
into a :class:`LiveRun`, which the page reads (assets/studio.js) as one response per run: a line of JSON every
:data:`EVERY_S` while something changed, the last one saying ``done``. One request per run, not one per update:
measured in headless chromium, a fetch every 250 ms cost the browser ~42 ms of CPU a second and a streamed line
every 250 ms ~11; each page update written with ``textContent`` costs a frame on top, ~9 ms on the studio's page
whatever the size of the change (a fixed-height box or its own layer changed nothing measurable).

A run is named by an unguessable id (128 bits) that the page learns from the Compare's first update; the answers
are plain JSON lines without CORS headers (only the studio's own page can read them), and the guard
(studio/guard.py) refuses foreign Hosts before this middleware sees a request. A Compare nobody reads (the API,
a test, a page without JavaScript) streams its texts through Gradio as before (studio/tabs/compare.py,
``UPDATE_EVERY``).

Each run also carries its ``stop`` event, which the engine asks once per token (``Engine.compare(should_stop=)``):
:meth:`LiveRuns.stop` sets it for the runs of one page session (the Compare tab's Stop button).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections import OrderedDict

PATH = "/pml-live/"
ACTIVE_S = 0.5  # an arm that grew this recently is generating (arms decoded together all are)
WATCHED_S = 2.0  # a run read this recently is being watched (besides while its stream is open)
# between two lines of a run's stream (a line only when something changed). Each line costs headless chromium ~12 ms
# of CPU (~3 ms to read it, ~9 ms for the frame that shows it, whatever its size: bench notes in the module
# docstring), taken from the decoding on 2 cores: at 4 lines a second the studio decoded ~7 % slower than
# `pml-studio run` (bench/browser_compare.py, 8 pairs), so 2 a second (~12 tokens of a batched decode each)
EVERY_S = 0.5
KEEP = 32  # runs remembered (a finished run answers `done` until it is pushed out)


class LiveRun:
    """One Compare's texts so far, the arms generating and the line the page shows above the columns."""

    def __init__(self, arms, owner: str = ""):
        self.id = secrets.token_urlsafe(16)
        self.owner = owner  # the Gradio session that started the run ('' for the API and tests)
        self.stop = threading.Event()  # set: the engine stops the run within a token (RunStopped)
        self.texts = {arm: "" for arm in arms}
        self.grew: dict[str, float] = {}  # arm -> time.monotonic() of its last token
        self.message = ""
        self.done = False
        self.polled = float("-inf")  # time.monotonic() of the last reply read
        self.version = 0  # counts changes: a stream sends a line when it moved
        self.streams = 0  # streams open on this run
        self._lock = threading.Lock()

    def show(self, arm: str, text: str, message: str) -> None:
        with self._lock:
            self.texts[arm], self.message = text, message
            self.grew[arm] = time.monotonic()
            self.version += 1

    def finish(self) -> None:
        with self._lock:
            self.done = True
            self.version += 1

    @property
    def watched(self) -> bool:
        """Whether a page reads this run: a stream is open, or a reply went out within :data:`WATCHED_S`."""
        return self.streams > 0 or time.monotonic() - self.polled < WATCHED_S

    def reply(self) -> dict:
        """The run as the page gets it (and the read is counted)."""
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

    def open(self, arms, owner: str = "") -> LiveRun:
        run = LiveRun(arms, owner)
        with self._lock:
            self._runs[run.id] = run
            while len(self._runs) > KEEP:
                self._runs.popitem(last=False)
        return run

    def get(self, run_id: str) -> LiveRun | None:
        with self._lock:
            return self._runs.get(run_id)

    def stop(self, owner: str) -> int:
        """Ask every unfinished run of session ``owner`` to stop; the number asked (none for '': no session)."""
        if not owner:
            return 0
        with self._lock:
            runs = [r for r in self._runs.values() if r.owner == owner and not r.done]
        for run in runs:
            run.stop.set()
        return len(runs)


RUNS = LiveRuns()


class LiveRoute:
    """ASGI middleware answering ``GET /pml-live/<id>`` with the run's stream: one line of JSON
    (:meth:`LiveRun.reply`) at once, then one every :data:`EVERY_S` while something changed, until the line that
    says ``done`` or the page goes away; an unknown id gets 404 and one ``done`` line."""

    def __init__(self, app, runs: LiveRuns = RUNS):
        self.app, self.runs = app, runs

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(PATH) or scope.get("method") != "GET":
            return await self.app(scope, receive, send)
        run = self.runs.get(path[len(PATH):])
        await send({"type": "http.response.start", "status": 200 if run is not None else 404,
                    "headers": [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-store"),
                                (b"x-content-type-options", b"nosniff")]})
        if run is None:
            await send({"type": "http.response.body", "body": b'{"done": true, "error": "no such run"}\n'})
            return
        gone = asyncio.ensure_future(_disconnect(receive))
        run.streams += 1
        try:
            sent = -1
            while True:
                version, doc = run.version, run.reply()
                if version != sent:
                    sent = version
                    await send({"type": "http.response.body", "body": json.dumps(doc).encode() + b"\n",
                                "more_body": not doc["done"]})
                if doc["done"]:
                    return
                await asyncio.wait([gone], timeout=EVERY_S)
                if gone.done():
                    return
        finally:
            run.streams -= 1
            gone.cancel()


async def _disconnect(receive) -> None:
    """Return when the client has gone (the request has no body to read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
