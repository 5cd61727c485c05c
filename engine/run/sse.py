"""A server-sent event stream as OpenAI-compatible servers send a streamed answer, read as the standard says
(WHATWG, "Server-sent events"): lines end at CR, LF or CRLF only (U+2028 and U+0085 are text), ``data:`` lines
make one event that a blank line dispatches. :class:`EventReader` holds at most one line of ``max_line`` bytes.
"""

from __future__ import annotations

import json

DONE = "[DONE]"  # what :func:`document` returns for the stream's last event
MAX_LINE = 1 << 20  # one line's bytes: vLLM's largest event (a token with 20 log-probabilities) is under 4 KB


class EventError(ValueError):
    """Data no reader can use; ``event``: the server's error event's document, when it is one."""

    def __init__(self, message: str, data: str, event: dict | None = None):
        super().__init__(message)
        self.data, self.event = data, event


class EventReader:
    """Bytes in (:meth:`feed`), each dispatched event's data out; :meth:`end` after the last byte."""

    def __init__(self, max_line: int = MAX_LINE):
        self.max_line = max_line
        self._line = bytearray()  # the unfinished line
        self._after_cr = False  # the last byte fed was a CR: an LF next belongs to it
        self._data: list[str] = []  # the data lines of the event being read

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event ``chunk`` completes, in order."""
        out: list[str] = []
        start = 0
        if self._after_cr and chunk[:1] == b"\n":
            start = 1
        self._after_cr = False
        n = len(chunk)
        while start < n:
            cr, lf = chunk.find(b"\r", start), chunk.find(b"\n", start)
            ends = [i for i in (cr, lf) if i >= 0]
            if not ends:
                self._grow(chunk[start:])
                break
            end = min(ends)
            self._grow(chunk[start:end])
            self._line_done(out)
            start = end + 1
            if chunk[end:end + 1] == b"\r":
                if start < n and chunk[start:start + 1] == b"\n":
                    start += 1
                elif start == n:
                    self._after_cr = True
        return out

    def end(self) -> list[str]:
        """The data of an event the stream ended without dispatching (no blank line after ``[DONE]``)."""
        out: list[str] = []
        if self._line:
            self._line_done(out)
        if self._data:
            out.append("\n".join(self._data))
            self._data = []
        return out

    def _grow(self, part: bytes) -> None:
        if len(self._line) + len(part) > self.max_line:
            head = bytes(self._line[:200]).decode("utf-8", "replace")
            raise EventError(f"a line longer than {self.max_line:,} bytes (it starts {head[:80]!r})", head)
        self._line += part

    def _line_done(self, out: list[str]) -> None:
        line = self._line.decode("utf-8", "replace")
        self._line.clear()
        if not line:  # a blank line dispatches the event
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


def document(data: str) -> dict | str:
    """An event's data as :data:`DONE` or its JSON object (no NaN or Infinity); else EventError."""
    text = data.strip()
    if text == DONE:
        return DONE
    try:
        event = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise EventError(f"not JSON: {text[:200]}", text) from None
    if not isinstance(event, dict):
        raise EventError(f"not a JSON object: {text[:200]}", text)
    if "error" in event:
        raise EventError(error_message(event), text, event)
    return event


def data_of(line: str | bytes) -> dict | str | None:
    """One ``data:`` line's :func:`document`; None for a line without data (blank, a comment, another field)."""
    text = (line.decode("utf-8", "replace") if isinstance(line, bytes) else line).strip()
    if not text.startswith("data:"):
        return None
    return document(text[5:])


def error_message(doc) -> str:
    """An OpenAI-shaped error's message (vLLM: {"error": {"message"}} or {"message"}), else the document."""
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
    return str(doc)[:500]


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a server sends")
