"""One line of a server-sent event stream as OpenAI-compatible servers (vLLM) send a streamed answer: nothing, the
end (``data: [DONE]``) or one JSON object; a line that is not an object, and an error event, raise
:class:`EventError`, which each reader turns into its own error (the vllm arm's RemoteError, the API front's
ApiError)."""

from __future__ import annotations

import json

DONE = "[DONE]"  # what :func:`data_of` returns for the stream's last event


class EventError(ValueError):
    """A ``data:`` line no reader can use: not a JSON object (``event`` None), or the server's error event
    (``event`` its document, the message its words). ``data`` is the line's data."""

    def __init__(self, message: str, data: str, event: dict | None = None):
        super().__init__(message)
        self.data, self.event = data, event


def data_of(line: str | bytes) -> dict | str | None:
    """``line``'s event: None when it carries no data (blank, a ``:`` comment, an ``event:``/``id:``/``retry:``
    field), :data:`DONE` for ``data: [DONE]``, else its data's JSON object (``data:`` with or without a space)."""
    text = (line.decode("utf-8", "replace") if isinstance(line, bytes) else line).strip()
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    if data == DONE:
        return DONE
    try:
        event = json.loads(data)
    except (ValueError, RecursionError):
        raise EventError(f"not JSON: {data[:200]}", data) from None
    if not isinstance(event, dict):
        raise EventError(f"not a JSON object: {data[:200]}", data)
    if "error" in event:
        raise EventError(error_message(event), data, event)
    return event


def error_message(doc) -> str:
    """An OpenAI-shaped error's message (vLLM: {"error": {"message"}} or {"message"}), else the document."""
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
    return str(doc)[:500]
