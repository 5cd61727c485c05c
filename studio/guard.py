"""Only this machine's user drives the studio: an ASGI guard in front of Gradio's routes.

Binding to 127.0.0.1 keeps other machines out, but not other *web pages*: any page the user's browser
opens can send requests to 127.0.0.1 (cross-site requests), or rebind its own name to 127.0.0.1 and
talk to the studio as a same-origin page (DNS rebinding). Gradio's ``api_visibility="private"`` only
hides an event from the API page; the event stays callable by anyone who can reach the port. So every
request passes three checks here, before Gradio sees it:

1. **Host**: the ``Host`` header names the address the studio serves — 127.0.0.1, localhost, [::1] or
   the ``--host`` given (plus ``--allow-host`` names), with the port it listens on. A rebinding page
   sends its own name and is refused.
2. **Origin**: a request that changes state (anything but GET/HEAD/OPTIONS) that carries an ``Origin``
   must come from one of those addresses, port included: another local server's page is refused.
3. **Page token**: the page is served with a random per-process cookie (HttpOnly, SameSite=Strict);
   every state-changing call must carry it, except a call of a public API endpoint (``/compare``,
   which ``gradio_client`` uses). Private events — the uploads, Import from Python (which runs the
   imported file's code), the editors' events — are the page's alone.

Refusals are plain-text 403 answers that say what was refused and how to reach the studio instead.
"""

from __future__ import annotations

import json
import re
import secrets
from http.cookies import SimpleCookie

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
MAX_JSON_BODY = 16 << 20  # a call's JSON body read to find its event (schemas are capped far below this)
# Gradio's routes that run an event: the event is named in the path or (queue/join, cancel, reset) in the body
_NAMED_CALL = re.compile(r"^(?:/gradio_api)?/(?:run|api|call|call/v2)/([^/]+)/?$")
_HOST = re.compile(r"(\[[^\]]+\]|[^:/\[\]]+)(?::(\d{1,5}))?")
_ORIGIN = re.compile(r"https?://" + _HOST.pattern + "/?")
_BODY_CALL = re.compile(r"^(?:/gradio_api)?/(?:queue/join|cancel|reset)/?$")


def allowed_hosts(host: str) -> tuple[str, ...]:
    """Host names (lower case, without port) the studio answers on its port: loopback and the bound address."""
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, *filter(None, [_bare(host)]))))


def _bare(name: str) -> str | None:
    """A host name as a Host header spells it ('[::1]' for IPv6); None for the wildcard addresses."""
    name = name.strip().lower()
    if not name or name in ("0.0.0.0", "::", "[::]"):
        return None
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


class LocalGuard:
    """ASGI middleware: refuse foreign Hosts, foreign Origins and token-less calls of private events.

    ``blocks`` is the studio's ``gr.Blocks``: its events' ``api_visibility`` says which are public.
    ``hosts`` are bare host names (see :func:`allowed_hosts`); the port is the one the request reached.
    """

    def __init__(self, app, blocks, hosts: tuple[str, ...], proxied: tuple[str, ...] = (), token: str | None = None):
        self.app = app
        self.blocks = blocks
        self.hosts = tuple(h.lower() for h in hosts)  # answered on the port the studio listens on
        self.proxied = tuple(filter(None, map(_bare, proxied)))  # --allow-host: any port (a proxy's)
        self.token = token or secrets.token_urlsafe(32)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        port = (scope.get("server") or (None, None))[1]
        refusal = self._host_refusal(headers.get("host", ""), port)
        method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
        if refusal is None and method not in SAFE_METHODS:
            refusal = self._origin_refusal(headers.get("origin"), port)
            if refusal is None and not self._has_token(headers, port):
                refusal, receive = await self._call_refusal(scope, receive)
        if refusal is not None:
            return await _refuse(scope, receive, send, refusal)
        if method == "GET":
            send = self._with_cookie(send, port)
        return await self.app(scope, receive, send)

    # ------------------------------------------------------------------------------------------
    # The three checks
    # ------------------------------------------------------------------------------------------

    def _host_refusal(self, host: str, port: int | None) -> str | None:
        if self._known(_HOST.fullmatch(host.strip().lower()), port):
            return None
        return (f"PML Studio answers this machine only: the Host '{host or '(none)'}' is not one of its addresses "
                f"({', '.join(self.hosts)}, port {port}). Open http://127.0.0.1:{port}/ instead, or start the "
                "studio with --allow-host NAME to serve that name.")

    def _origin_refusal(self, origin: str | None, port: int | None) -> str | None:
        if origin is None:
            return None  # not a browser: a local program, which the page token and the API list govern
        if self._known(_ORIGIN.fullmatch(origin.strip().lower()), port):
            return None
        return (f"PML Studio refuses calls from another site: Origin '{origin}' is not the studio's page. "
                f"Use the studio at http://127.0.0.1:{port}/, or its API (/compare) from a program.")

    def _has_token(self, headers: dict, port: int | None) -> bool:
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header carries no token
            return False
        morsel = cookie.get(self.cookie_name(port))
        return morsel is not None and secrets.compare_digest(morsel.value, self.token)

    async def _call_refusal(self, scope, receive):
        """(refusal or None, receive): token-less state changes are allowed for public API events only."""
        path = scope.get("path", "")
        named = _NAMED_CALL.match(path)
        if named:
            ok = named.group(1) in self._public_names()
            return (None if ok else _private(path)), receive
        if _BODY_CALL.match(path):
            body, receive = await _read_body(receive)
            try:
                fn_index = json.loads(body or b"{}").get("fn_index")
            except (ValueError, AttributeError):
                fn_index = None
            ok = isinstance(fn_index, int) and fn_index in self._public_ids()
            return (None if ok else _private(path)), receive
        return _private(path), receive

    # ------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------

    def _known(self, match, port: int | None) -> bool:
        """A parsed host[:port] is the studio's own address (or a --allow-host name, on any port)."""
        if match is None:
            return False
        name, given = match.group(1), match.group(2)
        return name in self.proxied or (name in self.hosts and (port is None or int(given or 80) == port))

    def cookie_name(self, port: int | None) -> str:
        return f"pml_studio_{port or 0}"  # cookies ignore ports: two studios on one host keep their own

    def _public_names(self) -> set[str]:
        return {fn.api_name for fn in self.blocks.fns.values() if fn.api_visibility == "public" and fn.api_name}

    def _public_ids(self) -> set[int]:
        return {fn._id for fn in self.blocks.fns.values() if fn.api_visibility == "public"}

    def _with_cookie(self, send, port):
        cookie = (f"{self.cookie_name(port)}={self.token}; Path=/; HttpOnly; SameSite=Strict").encode()

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                types = [v for k, v in message.get("headers", []) if k.lower() == b"content-type"]
                if types and types[0].startswith(b"text/html"):
                    message = {**message, "headers": [*message["headers"], (b"set-cookie", cookie)]}
            await send(message)
        return send_with_cookie


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _private(path: str) -> str:
    return (f"PML Studio: '{path}' is one of the studio page's own events; it runs from the page at this address "
            "only (open the studio in your browser). Programs can call the /compare API.")


async def _read_body(receive):
    """The request body (up to MAX_JSON_BODY bytes) and a ``receive`` that replays it to the app."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False) and size <= MAX_JSON_BODY
    body = b"".join(chunks) if not more else b""  # too long to be a call of the API: read as no event
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return body, replay


async def _refuse(scope, receive, send, text: str):
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = text.encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
