"""Clients that send slowly cannot lock the user out (studio/connections.py): another account's 1,100 connections
that never finish their headers or bodies are closed at the deadline, the user's requests are answered meanwhile,
the console stays quiet; the same deadlines hold for `pml-studio api`, and a flood beyond the connection cap closes
the longest-waiting connection, never the user's.

The attacking connections come from a subprocess that drops to uid 65534 when the tests run as root (as CI does),
so they are another account's; they are loopback only, bounded in count, and each attacker ends within
:data:`HOLD_S`.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from engine.runlog import RunLog
from engine.session import Engine
from studio.connections import Limits, guarded, quiet_resource_errors, raise_open_files
from tests.conftest import free_port
from tests.studio_fixtures import AUTH, TOKEN, served_studio

HEADER_S = 1.5  # the deadline the servers here get (the default is 10 s)
HOLD_S = 20.0  # the longest an attacker keeps its connections
SLACK_S = 6.0  # the deadline plus this: a shared, busy machine's timers still fire by then
COMMON_LIMIT = 1024  # the usual soft limit on open files, which 1,100 connections exceed

# Opens COUNT connections to 127.0.0.1:PORT as uid 65534 (when root): odd ones stop inside their headers, even ones
# send complete headers and then hold back the body they announce. Prints {"opened", "uid"} once all are open, then
# {"closed", "latest"}: how many the server closed, and when the last of them went (s after all were open).
ATTACK = r"""
import json, os, resource, select, socket, sys, time
port, count, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
"127.0.0.1".encode("idna")  # codecs load lazily, and uid 65534 may not read this Python's library
if os.getuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
socks = []
for i in range(count):
    s = socket.socket()
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " if i % 2 else
              b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n{")
    socks.append(s)
print(json.dumps({"opened": len(socks), "uid": os.getuid()}), flush=True)
start, closed = time.monotonic(), {}
poll, by_fd = select.poll(), {s.fileno(): s for s in socks}
for fd in by_fd:
    poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
while len(closed) < count and time.monotonic() - start < hold:
    for fd, _ in poll.poll(100):
        try:
            data = by_fd[fd].recv(65536)
        except OSError:
            data = b""
        if not data:
            closed[fd] = time.monotonic() - start
            poll.unregister(fd)
print(json.dumps({"closed": len(closed), "latest": max(closed.values(), default=None)}), flush=True)
"""


def attackers(port: int, total: int, per_process: int = 500) -> list[subprocess.Popen]:
    """Processes holding ``total`` slow connections to ``port`` between them (each within the common 1,024-file
    limit), each once it has printed its first line: all are open."""
    procs = []
    for start in range(0, total, per_process):
        count = min(per_process, total - start)
        procs.append(subprocess.Popen([sys.executable, "-c", ATTACK, str(port), str(count), str(HOLD_S)], cwd="/",
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        opened = json.loads(line)
        assert opened["opened"] > 0 and (opened["uid"] == 65534 or os.getuid() != 0)
    return procs


def outcome(procs: list[subprocess.Popen]) -> tuple[int, float]:
    """(connections the server closed, the latest close in seconds) over all attackers."""
    closed, latest = 0, 0.0
    for proc in procs:
        out, err = proc.communicate(timeout=HOLD_S + 30)
        assert proc.returncode == 0, err
        done = json.loads(out.strip().splitlines()[-1])
        closed += done["closed"]
        latest = max(latest, done["latest"] or 0.0)
    return closed, latest


@contextmanager
def soft_open_files(limit: int):
    """The soft limit on open files set to ``limit`` (the common one) for a test; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def timed_get(url: str, headers: dict) -> tuple[int, float]:
    start = time.monotonic()
    got = httpx.get(url, headers=headers, timeout=10)
    return got.status_code, time.monotonic() - start


def test_another_accounts_slow_connections_do_not_lock_the_user_out(tiny_lm, tmp_path, capfd):
    """1,100 connections that never finish (at the common 1,024-file limit): the user's API request and page are
    answered within seconds while they are open, the server closes every one at the deadline, the console stays
    quiet. Before: every request of the user timed out and the console filled with 'Too many open files'."""
    engine = Engine.from_loaded(tiny_lm)
    with soft_open_files(COMMON_LIMIT), served_studio(engine, RunLog(tmp_path / "runs.db"),
                                                      connections=Limits(header_s=HEADER_S, body_grace_s=HEADER_S)) \
            as (_, port):
        capfd.readouterr()
        procs = attackers(port, 1100)
        try:
            api = timed_get(f"http://127.0.0.1:{port}/v1/models", AUTH)
            page = timed_get(f"http://127.0.0.1:{port}/", AUTH)
        finally:
            closed, latest = outcome(procs)
    assert api[0] == 200 and api[1] < 8, api
    assert page[0] == 200 and page[1] < 8, page
    assert closed == 1100 and latest < HEADER_S + SLACK_S, (closed, latest)
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 4000, (out + err)[-2000:]


@contextmanager
def bare_server(limits: Limits):
    """A uvicorn server of an app that answers 'ok' (after reading any body), its connections guarded under
    ``limits``; yields (port, the guarded protocol class)."""
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more and scope["method"] == "POST":
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port, protocol = free_port(), guarded("h11", limits)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                          http=protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_for(lambda: server.started)
        yield port, protocol
    finally:
        server.should_exit = True
        thread.join(30)


def test_pml_studio_api_closes_slow_headers_and_slow_bodies_at_their_deadlines(tiny_lm, tmp_path):
    """What `pml-studio api` serves (server_config): a connection silent, one stopped inside its headers, one
    whose body trickles (with the token, so the API waits for it) are closed by the deadline; the user's
    request is answered meanwhile."""
    import uvicorn

    from studio.api.serve import headless_app, server_config

    port = free_port()
    limits = Limits(header_s=HEADER_S, body_grace_s=HEADER_S, body_rate=1000)
    server = uvicorn.Server(server_config(headless_app(Engine.from_loaded(tiny_lm), RunLog(tmp_path / "runs.db"),
                                                       TOKEN), "127.0.0.1", port, limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_for(lambda: server.started)
        silent = socket.create_connection(("127.0.0.1", port))
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        trickle = socket.create_connection(("127.0.0.1", port))
        trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                        + TOKEN.encode() + b"\r\nContent-Length: 100000\r\n\r\n{")
        start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            ends = [pool.submit(_closed_after, s, start, 0.5 if s is trickle else None)
                    for s in (silent, partial, trickle)]
            assert timed_get(f"http://127.0.0.1:{port}/v1/models", AUTH)[0] == 200
            ended = [e.result() for e in ends]
    finally:
        server.should_exit = True
        thread.join(30)
    assert all(HEADER_S - 0.2 <= t < HEADER_S + SLACK_S for t in ended), ended


def test_a_flood_past_the_cap_closes_the_longest_waiting_never_the_users_request():
    """With room for 50 connections, 200 that send nothing: the oldest are closed as new ones come, the server
    never holds more than 50, and a request sent after them is answered at once."""
    with bare_server(Limits(header_s=60, max_connections=50)) as (port, protocol):
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        try:
            status, took = timed_get(f"http://127.0.0.1:{port}/", {})
            _wait_for(lambda: protocol.connections.evicted >= 150)
            assert len(protocol.connections.open) <= 50
        finally:
            for s in flood:
                s.close()
    assert status == 200 and took < 5
    assert protocol.connections.closed_slow == 0  # room was made by the cap, not by the 60 s deadline


def test_a_kept_alive_connection_is_closed_when_its_next_request_stalls():
    """After an answer, the next request's headers are due within the deadline too (uvicorn's keep-alive timer
    stops at the first byte of the next request)."""
    with bare_server(Limits(header_s=HEADER_S)) as (port, _):
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        conn.sendall(b"GET / HTTP/1.1\r\n")  # and no more
        assert HEADER_S - 0.2 <= _closed_after(conn, time.monotonic()) < HEADER_S + SLACK_S


def test_out_of_files_reports_are_one_line_a_while():
    """asyncio's report of a refused accept (a traceback each, about one a second per listening socket) becomes
    one line, then nothing more for ten seconds."""
    quiet_resource_errors()
    logger, console = logging.getLogger("asyncio"), io.StringIO()
    handler = logging.StreamHandler(console)  # the console asyncio's records reach in a served studio
    logger.addHandler(handler)
    try:
        for _ in range(1000):
            try:
                raise OSError(errno.EMFILE, "Too many open files")
            except OSError:
                logger.error("socket.accept() out of system resource", exc_info=True)
    finally:
        logger.removeHandler(handler)
    said = console.getvalue()
    assert said.count("\n") <= 1 and "Traceback" not in said, said[:600]
    assert not said or "raise the open-files limit (ulimit -n)" in said


def test_the_open_files_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with soft_open_files(min(256, hard)):
        assert raise_open_files() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_a_bad_header_deadline_is_a_named_error(monkeypatch):
    monkeypatch.setenv("PML_STUDIO_HEADER_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"\$PML_STUDIO_HEADER_TIMEOUT_S must be a number of seconds"):
        Limits.from_env()
    monkeypatch.setenv("PML_STUDIO_HEADER_TIMEOUT_S", "2.5")
    assert Limits.from_env().header_s == 2.5


def _closed_after(sock: socket.socket, start: float, trickle_every: float | None = None) -> float:
    """Seconds from ``start`` until the server closes ``sock`` (sending a byte every ``trickle_every`` s)."""
    sock.settimeout(trickle_every or HEADER_S + SLACK_S + 5)
    while True:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            if trickle_every is None:
                raise
            try:
                sock.sendall(b" ")
            except OSError:
                return time.monotonic() - start
            continue
        except OSError:
            return time.monotonic() - start
        if not data:
            return time.monotonic() - start


def _wait_for(ready, timeout: float = 60.0) -> None:
    """Poll ``ready()`` until it holds (a readiness wait, not a timing assertion)."""
    end = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)
