"""An ASGI middleware that puts the studio's script first in the ``<head>`` of every HTML page Gradio serves.

Gradio's ``head=`` adds its HTML after Gradio's modules have run: too late for assets/studio.js, which must replace
``requestAnimationFrame`` before Gradio's status tracker holds it. Only plain GET HTML answers are rewritten.
"""

from __future__ import annotations

import re

_HEAD = re.compile(rb"<head(?:\s[^>]*)?>", re.IGNORECASE)


class FirstScript:
    def __init__(self, app, script: str):
        self.app = app
        self.tag = b"<script>" + script.encode() + b"</script>"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "GET":
            return await self.app(scope, receive, send)
        held: dict = {}
        chunks: list[bytes] = []

        async def rewrite(message):
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                if headers.get(b"content-type", b"").startswith(b"text/html") and b"content-encoding" not in headers:
                    held["start"] = message
                    return
            elif message["type"] == "http.response.body" and "start" in held:
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = _HEAD.sub(lambda m: m.group(0) + self.tag, b"".join(chunks), count=1)
                start = held.pop("start")
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
                return await send({"type": "http.response.body", "body": body})
            await send(message)

        return await self.app(scope, receive, rewrite)
