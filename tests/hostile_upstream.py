"""What a hostile or broken OpenAI-compatible server can send, as answers a stand-in (tests/upstream_standin.py,
``StandIn.answer[path] = fn``) gives instead of its own: each ``fn(handler, body)`` writes raw HTTP on the handler's
socket. Used against the API's front (tests/studio/test_upstream_hostile.py) and the vllm arm
(tests/engine/test_remote_hostile.py), which read servers through the same client.

Nothing here is held in memory whole: a 512 MB line is written in pieces, a gzip bomb compressed piece by piece.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
import zlib
from contextlib import contextmanager

MiB = 1 << 20


def headers(h, status: int = 200, kind: str = "text/event-stream", extra: dict | None = None) -> None:
    h.send_response(status)
    h.send_header("Content-Type", kind)
    for name, value in (extra or {}).items():
        h.send_header(name, value)
    h.end_headers()


def write(h, data: bytes) -> bool:
    """Send ``data``; False once the reader has closed the connection."""
    try:
        h.wfile.write(data)
        h.wfile.flush()
        return True
    except OSError:
        return False


def event(doc) -> bytes:
    """One SSE event; text as its UTF-8 bytes (U+2028 raw, as vLLM sends it), not JSON's escapes."""
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)}\n\n".encode()


def usage(body: dict, done: int = 1, cached: int = 0) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": done,
                                     "total_tokens": len(body["prompt"]) + done,
                                     "prompt_tokens_details": {"cached_tokens": cached}}}


def text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}], "usage": None}


def events(*docs, raw: bytes = b""):
    """Answer with these events (a callable of the body gives them from it), then ``raw``, then [DONE]."""
    def answer(h, body):
        headers(h)
        for doc in docs:
            for d in (doc(body) if callable(doc) else [doc]):
                write(h, event(d))
        write(h, raw + event("[DONE]"))
    return answer


def gzip_bomb(size: int = 512 * MiB, line: bool = True, kind: str = "text/event-stream"):
    """A small gzip body that inflates to ``size`` bytes: one line (``line``) or a JSON document's opening."""
    def answer(h, body):
        headers(h, kind=kind, extra={"Content-Encoding": "gzip"})
        z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        if not write(h, z.compress(b"data: " if line else b'{"data": [{"id": "')):
            return
        piece = b"a" * MiB
        for _ in range(size // MiB):
            out = z.compress(piece)
            if out and not write(h, out):
                return
        write(h, z.flush())
    return answer


def long_line(size: int = 512 * MiB):
    """One line of ``size`` bytes, sent as it is made."""
    def answer(h, body):
        headers(h)
        if not write(h, b"data: "):
            return
        piece = b"a" * MiB
        for _ in range(size // MiB):
            if not write(h, piece):
                return
    return answer


def endless(h, body) -> None:
    """Token events for ever (until the reader closes)."""
    endless_events(h, text("la "))


def endless_events(h, doc) -> None:
    """The event ``doc`` for ever (until the reader closes)."""
    headers(h)
    while write(h, event(doc)):
        pass


def trickle(every_s: float = 3.0):
    """One byte of an event every ``every_s`` seconds, for ever."""
    def answer(h, body):
        headers(h)
        while write(h, b"d"):
            time.sleep(every_s)
    return answer


class Stall:
    """Headers and one comment, then nothing, until the reader closes the connection: ``closed`` counts those."""

    def __init__(self):
        self.started = self.closed = 0
        self._lock = threading.Lock()

    def __call__(self, h, body) -> None:
        headers(h)
        write(h, b": hello\n\n")
        with self._lock:
            self.started += 1
        while True:  # the socket turns readable (EOF) once the reader closes it
            ready, _, _ = select.select([h.connection], [], [], 1.0)
            if ready and not h.connection.recv(1, 0):
                break
        with self._lock:
            self.closed += 1


def status(code: int, extra: dict | None = None, body: bytes = b""):
    """Just this status (a redirect's Location in ``extra``)."""
    def answer(h, _body):
        h.send_response_only(code)
        h.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            h.send_header(name, value)
        h.end_headers()
        write(h, body)
    return answer


def json_answer(doc, status_code: int = 200):
    def answer(h, _body):
        raw = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
        headers(h, status_code, "application/json", {"Content-Length": str(len(raw))})
        write(h, raw)
    return answer


def rss() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_growth():
    """Measure how far this process's resident memory rises above where it starts, sampled every 10 ms:
    ``growth[0]`` once the block ends."""
    start, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss() - start)
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    growth = [0]
    try:
        yield growth
    finally:
        done.set()
        thread.join()
        growth[0] = max(peak[0], rss() - start)

