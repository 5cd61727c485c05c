"""The arms' texts while a Compare runs, streamed to the page outside Gradio's event stream.

Every message Gradio streams costs the browser ~25-40 ms of CPU, taken from the decoding on two cores (updates
every 0.1 s made decoding ~45 % slower). So while a page watches, the growing texts go into a :class:`LiveRun`
that the page reads (assets/studio.js) as one streamed response per run; docs/benchmarks.md ("In the browser")
has the figures. A run is named by an unguessable id, and its ``stop`` event is what the Stop button sets.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections import OrderedDict

PATH = "/pml-live/"
ACTIVE_S = 0.5  # an arm that grew this recently is generating
WATCHED_S = 2.0  # a run read this recently is being watched
# between two lines of a run's stream: each costs the browser ~12 ms of CPU; 4 a second decoded ~7 % slower
EVERY_S = 0.5
KEEP = 32  # runs remembered


class LiveRun:
    def __init__(self, arms, owner: str = ""):
        self.id = secrets.token_urlsafe(16)
        self.owner = owner  # the Gradio session that started the run ('' for the API and tests)
        self.stop = threading.Event()
        self.texts = {arm: "" for arm in arms}
        self.firsts: dict = {}  # arm -> its RunResult once it has its first token (what a Stop shows)
        self.grew: dict[str, float] = {}  # arm -> time.monotonic() of its last token
        self.message = ""
        self.done = False
        self.polled = float("-inf")
        self.version = 0  # a stream sends a line when it moved
        self.streams = 0
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
        return self.streams > 0 or time.monotonic() - self.polled < WATCHED_S

    def reply(self) -> dict:
        with self._lock:
            self.polled = now = time.monotonic()
            active = [] if self.done else [arm for arm, t in self.grew.items() if now - t < ACTIVE_S]
            return {"texts": dict(self.texts), "active": active, "message": self.message, "done": self.done}

    def marker(self) -> str:
        return f'<span class="pml-live" data-live="{self.id}" hidden></span>'


class LiveRuns:
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

    def stop(self, owner: str) -> list[LiveRun]:
        """Ask ``owner``'s unfinished runs to stop; the runs asked."""
        if not owner:
            return []
        with self._lock:
            runs = [r for r in self._runs.values() if r.owner == owner and not r.done]
        for run in runs:
            run.stop.set()
        return runs


RUNS = LiveRuns()


class LiveRoute:
    """ASGI middleware answering ``GET /pml-live/<id>``: a JSON line at once, then one every :data:`EVERY_S` while
    something changed, until ``done`` or the page goes away."""

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
    while (await receive())["type"] != "http.disconnect":
        pass
