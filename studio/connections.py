"""The HTTP server's connections: deadlines for slow senders, a bound on connections that wait, the open-files limit
raised, and "too many open files" said once in a while.

uvicorn waits for a request's headers and body as long as the client likes, so any account on the machine could
hold every file descriptor with connections that send a byte now and then (docs/security.md). Here each
connection is watched: headers are due within a deadline, a body must keep a rate, and at the cap the connection
that has waited longest for its request is closed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import sys
import time
from dataclasses import dataclass, replace

HEADER_ENV = "PML_STUDIO_HEADER_TIMEOUT_S"  # for a test or a slow proxy
SAY_EVERY_S = 10.0
RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class Limits:
    header_s: float = 10.0  # from the connection (or the last response's end) to complete request headers
    body_grace_s: float = 10.0  # waited for a body before its rate counts
    body_rate: float = 1024.0  # bytes a second, averaged while the application waits for the body
    max_connections: int | None = None  # None: the soft open-files limit less `reserve`
    reserve: int = 256  # file descriptors kept for the model, the run log, Gradio's files

    @classmethod
    def from_env(cls, **given) -> Limits:
        limits = cls()
        raw = os.environ.get(HEADER_ENV, "").strip()
        if raw:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = 0.0
            if not 0 < seconds <= 3600:
                raise ValueError(f"${HEADER_ENV} must be a number of seconds from 0 to 3600, got '{raw}'")
            limits = replace(limits, header_s=seconds, body_grace_s=seconds)
        return replace(limits, **given)

    def cap(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        return max(64, open_files_limit() - self.reserve)


def guarded(protocol: type | str = "auto", limits: Limits | None = None) -> type:
    """uvicorn's HTTP protocol class (or its name in uvicorn's ``http`` option) with each connection watched under
    ``limits``; its connections share one :class:`Connections`."""
    if isinstance(protocol, str):
        from uvicorn.config import HTTP_PROTOCOLS
        from uvicorn.importer import import_from_string

        protocol = import_from_string(HTTP_PROTOCOLS.get(protocol, protocol))
    if getattr(protocol, "watched", False):
        return protocol
    connections = Connections(limits or Limits.from_env())

    class Guarded(protocol):
        watched = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.watch = Watch(connections, self)
            self.app = self.watch.wrap(self.app)

        def connection_made(self, transport):
            super().connection_made(transport)
            self.watch.opened(transport)

        def connection_lost(self, exc):
            self.watch.closed()
            super().connection_lost(exc)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{protocol.__name__}"
    Guarded.connections = connections
    return Guarded


def guard_gradio(limits: Limits | None = None) -> None:
    """Every server Gradio starts from now on uses :func:`guarded` connections. Gradio builds its uvicorn ``Config``
    where no option reaches it, so its ``Server`` class is replaced by one that sets ``config.http`` first."""
    from gradio import http_server

    raise_open_files()
    quiet_resource_errors()
    base = http_server.Server
    chosen = limits or Limits.from_env()
    if getattr(base, "pml_limits", None) is not None:
        base.pml_limits = chosen
        return

    class GuardedServer(base):
        pml_limits = chosen

        def __init__(self, config, *args, **kwargs):
            config.http = guarded(config.http, type(self).pml_limits)
            super().__init__(config, *args, **kwargs)

    http_server.Server = GuardedServer


def raise_open_files() -> int:
    """Lift the soft limit on open files to the hard one (a connection is a file); return the soft limit now."""
    try:
        import resource
    except ImportError:  # Windows
        return open_files_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if sys.platform == "darwin":
        want = min(want, 10240)  # OPEN_MAX: macOS refuses more
    if soft == resource.RLIM_INFINITY or soft >= want:
        return open_files_limit()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass
    return open_files_limit()


def open_files_limit() -> int:
    try:
        import resource
    except ImportError:
        return 1 << 16
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 16 if soft == resource.RLIM_INFINITY else soft


def quiet_resource_errors(every_s: float = SAY_EVERY_S) -> None:
    """asyncio's traceback per refused accept (about one a second while descriptors run out) becomes one line per
    ``every_s`` seconds."""
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OncePerWhile) for f in logger.filters):
            logger.addFilter(_OncePerWhile(every_s))


class Connections:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.open: set[Watch] = set()
        self.waiting: dict[Watch, None] = {}  # insertion order: the longest waiting first
        self.closed_slow = 0
        self.evicted = 0
        self._cap: int | None = None

    def opened(self, watch: Watch) -> None:
        if self._cap is None:
            self._cap = self.limits.cap()
        self.open.add(watch)
        while len(self.open) > self._cap:
            oldest = next((w for w in self.waiting if w is not watch), watch)
            self.evicted += 1
            oldest.close()
            if oldest is watch:
                break

    def wait(self, watch: Watch) -> None:
        self.waiting.setdefault(watch, None)

    def served(self, watch: Watch) -> None:
        self.waiting.pop(watch, None)

    def gone(self, watch: Watch) -> None:
        self.open.discard(watch)
        self.waiting.pop(watch, None)


class Watch:
    def __init__(self, connections: Connections, protocol):
        self.connections, self.protocol = connections, protocol
        self.limits = connections.limits
        self.transport = None
        self.requests = 0
        self._timer: asyncio.TimerHandle | None = None

    def opened(self, transport) -> None:
        self.transport = transport
        self.connections.opened(self)
        self.expect_request()

    def closed(self) -> None:
        self.cancel()
        self.connections.gone(self)

    def expect_request(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.deadline(self.limits.header_s)
        self.connections.served(self)  # waiting anew: the youngest
        self.connections.wait(self)

    def request_started(self) -> None:
        self.requests += 1
        self.cancel()
        self.connections.served(self)

    def close(self, slow: bool = False) -> None:
        """Close the connection; one upgraded to a WebSocket belongs to another protocol now and is only forgotten."""
        self.cancel()
        self.connections.gone(self)
        transport = self.transport
        if transport is None or transport.is_closing() or transport.get_protocol() is not self.protocol:
            return
        self.connections.closed_slow += slow
        transport.close()

    def wrap(self, app):
        async def watched(scope, receive, send):
            if scope["type"] not in ("http", "websocket"):
                return await app(scope, receive, send)
            self.request_started()
            if scope["type"] == "websocket":
                self.connections.gone(self)  # long-lived by design: no deadlines, not evictable
                return await app(scope, receive, send)
            body, mine = _Body(self) if _has_body(scope) else None, self.requests

            async def sent(message):
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    self._next_after(mine)

            try:
                await app(scope, body.receive(receive) if body else receive, sent)
            finally:
                self._next_after(mine)  # also when the app ended without a response
        return watched

    def _next_after(self, request: int) -> None:
        if self.requests == request:
            self.expect_request()

    def deadline(self, seconds: float) -> None:
        self.cancel()
        self._timer = asyncio.get_running_loop().call_later(max(seconds, 0.0), self.close, True)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Body:
    def __init__(self, watch: Watch):
        self.watch, self.waited, self.got, self.done = watch, 0.0, 0, False

    def receive(self, receive):
        async def timed():
            if self.done:
                return await receive()
            limits = self.watch.limits
            self.watch.deadline(limits.body_grace_s + self.got / limits.body_rate - self.waited)
            self.watch.connections.wait(self.watch)
            start = time.monotonic()
            try:
                message = await receive()
            finally:
                self.waited += time.monotonic() - start
                self.watch.cancel()
            self.got += len(message.get("body", b""))
            self.done = message["type"] != "http.request" or not message.get("more_body", False)
            if self.done:
                self.watch.connections.served(self.watch)
            return message
        return timed


def _has_body(scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


class _OncePerWhile(logging.Filter):
    """One record about exhausted resources per ``every_s`` seconds, with the count held back; others pass."""

    def __init__(self, every_s: float):
        super().__init__()
        self.every_s, self.last, self.held = every_s, float("-inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        if not (isinstance(err, OSError) and err.errno in RESOURCE_ERRNOS) and "Too many open files" not in \
                record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.held += 1
            return False
        what = err.strerror if isinstance(err, OSError) and err.strerror else "Too many open files"
        held = f"; {self.held} more such reports in the last {self.every_s:g} s" if self.held else ""
        record.msg, record.args, record.exc_info, record.exc_text = (
            f"the server is out of resources ({what}): some connections were refused{held}; close other "
            f"programs' connections to it, or raise the open-files limit (ulimit -n)", None, None, None)
        self.last, self.held = now, 0
        return True
