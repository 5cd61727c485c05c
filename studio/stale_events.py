"""An ASGI middleware that answers an event this studio does not have with a reason instead of a traceback.

A page opened on an earlier start of the studio (or kept across a reload of it) still names events by Gradio's
function index. Gradio looks the index up in ``get_fn`` (route_utils.py) unguarded, so an index that no longer
exists raised ``KeyError: 121`` out of the ASGI application: a traceback on the console, nothing on the page.
Here ``POST …/queue/join`` is read first (Gradio's request bodies are small) and an unknown ``fn_index`` answered
410 with what to do.
"""

from __future__ import annotations

import json

JOIN = "/queue/join"
GONE = ("this page's event {index} is not one of this studio's (the page is from an earlier start of the studio, "
        "or the studio was reloaded): reload the page")


class StaleEvents:
    def __init__(self, app, blocks):
        self.app, self.blocks = app, blocks

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").endswith(JOIN):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let Gradio see it
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        index = _fn_index(body)
        if index is not None and index not in self._known(body):
            return await _answer(send, 410, GONE.format(index=index))
        return await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}]), send)

    def _known(self, body: bytes) -> set:
        """The function indices the event's session knows (Gradio keeps a copy of them per session)."""
        session = _field(body, "session_hash")
        held = self.blocks.state_holder
        if isinstance(session, str) and session in held:
            return set(held[session].blocks_config.fns)
        return set(self.blocks.fns)


def _field(body: bytes, key: str):
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get(key) if isinstance(data, dict) else None


def _fn_index(body: bytes) -> int | None:
    index = _field(body, "fn_index")
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _replay(messages: list):
    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    return receive


async def _answer(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
