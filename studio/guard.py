"""Only the user who started the studio drives it: an ASGI guard in front of every route.

Binding to 127.0.0.1 keeps other machines out, but not other *accounts* on this machine, nor other web pages
the user's browser opens. Every request passes three checks here, before Gradio sees it:

1. **Host**: the ``Host`` header names the address the studio serves — 127.0.0.1, localhost, [::1] or the
   ``--host`` given (plus ``--allow-host`` names), with the port it listens on. A DNS-rebinding page sends its
   own name and is refused.
2. **Origin**: a request that carries an ``Origin`` (any method: browsers send it on cross-origin reads too)
   must come from one of those addresses, port included. Another local server's page is refused, and no
   response carries CORS headers for it (Gradio's own CORS middleware is taken out at start: :func:`no_cors`).
3. **Launch token** (Jupyter's model): a random token made at start and printed only to the console of the
   user who started the studio, in the URL it says to open. A request carries it as ``?token=``, as
   ``Authorization: Bearer`` (programs: ``/compare``, gradio_client) or as the HttpOnly cookie set when a
   browser first presents it; without it the page is a login form and every other route answers 401.
   ``token=None`` (``--no-token``, loopback only) skips this check.

Gradio's monitoring routes are not served (they print a key to the console). Refusals are plain-text answers
that say what was refused and how to reach the studio instead; under ``/v1/`` (the OpenAI-compatible API, whose
key is the launch token) they are OpenAI's JSON error bodies, 401 ``invalid_api_key`` and 403 ``forbidden``.
"""

from __future__ import annotations

import re
import secrets
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")
TOKEN_ENV = "PML_STUDIO_TOKEN"
MIN_TOKEN = 16  # characters of a token given by the user (a made one has 43)
_HOST = re.compile(r"(\[[^\]]+\]|[^:/\[\]]+)(?::(\d{1,5}))?")
_ORIGIN = re.compile(r"https?://" + _HOST.pattern + "/?")
_TOKEN = re.compile(r"[A-Za-z0-9._~-]+")  # safe in a URL, a cookie and a header without quoting
# Gradio's launch calls this itself, without the token: it starts the queue once and returns False ever after
OPEN_PATHS = ("/gradio_api/startup-events",)
_MONITORING = re.compile(r"^(?:/gradio_api)?/monitoring(?:/.*)?$")
API_PREFIX = "/v1/"  # the OpenAI-compatible API (studio/api/): refusals there are OpenAI-shaped JSON


class TokenError(ValueError):
    """A launch token given by the user that cannot be used."""


def make_token(given: str | None = None) -> str:
    """The launch token: ``given`` (checked) or a new random one."""
    if given is None:
        return secrets.token_urlsafe(32)
    if len(given) < MIN_TOKEN or not _TOKEN.fullmatch(given):
        raise TokenError(f"the launch token must be at least {MIN_TOKEN} characters of A-Z, a-z, 0-9 and ._~- "
                         f"(got {len(given)} characters); leave --token and ${TOKEN_ENV} unset for a random one")
    return given


def page_url(host: str, port: int, token: str | None) -> str:
    """The URL the console prints: the studio's page with its token (loopback when bound to every address)."""
    name = _bare(host) or "127.0.0.1"
    return f"http://{name}:{port}/" + (f"?token={token}" if token else "")


def allowed_hosts(host: str) -> tuple[str, ...]:
    """Host names (lower case, without port) the studio answers on its port: loopback and the bound address."""
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, *filter(None, [_bare(host)]))))


def is_loopback(host: str) -> bool:
    return (_bare(host) or "") in LOOPBACK_NAMES or host.strip().startswith("127.")


def _bare(name: str) -> str | None:
    """A host name as a Host header spells it ('[::1]' for IPv6); None for the wildcard addresses."""
    name = name.strip().lower()
    if not name or name in ("0.0.0.0", "::", "[::]"):
        return None
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


def no_cors(app) -> None:
    """Take Gradio's CORS middleware out of ``app`` (a started Gradio App): it answers any localhost origin with
    credentials, so a page on another local port could read the studio's answers. The studio's page is
    same-origin and needs no CORS; the guard refuses foreign origins. Call it in the app's lifespan startup:
    Starlette builds its middleware stack again at the next request."""
    kept = [m for m in app.user_middleware if m.cls.__name__ != "CustomCORSMiddleware"]
    if len(kept) != len(app.user_middleware):
        app.user_middleware[:] = kept
        app.middleware_stack = None


class LocalGuard:
    """ASGI middleware: refuse foreign Hosts, foreign Origins and requests without the launch token.

    ``hosts`` are bare host names (see :func:`allowed_hosts`); the port is the one the request reached.
    ``token`` None lets every local request through (``--no-token``).
    """

    def __init__(self, app, hosts: tuple[str, ...], proxied: tuple[str, ...] = (), token: str | None = None):
        self.app = app
        self.hosts = tuple(h.lower() for h in hosts)  # answered on the port the studio listens on
        self.proxied = tuple(filter(None, map(_bare, proxied)))  # --allow-host: any port (a proxy's)
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        port = (scope.get("server") or (None, None))[1]
        refusal = (self._host_refusal(headers.get("host", ""), port)
                   or self._origin_refusal(headers.get("origin"), port))
        if refusal is not None:
            return await _answer(scope, send, 403, refusal)
        if _MONITORING.match(scope.get("path", "")):
            return await _answer(scope, send, 404, "PML Studio does not serve Gradio's monitoring pages.")
        if self.token is None or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if self._matches(query.get("token")):
            if scope["type"] == "http" and scope.get("method") == "GET" and scope.get("path") == "/":
                return await self._enter(scope, send, query, port)
            return await self.app(scope, receive, send)
        if self._matches(_bearer(headers)) or self._matches(self._cookie(headers, port)):
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and scope.get("path") == "/":
            return await _answer(scope, send, 401, login_page("token" in query), "text/html")
        return await _answer(scope, send, 401, (
            "PML Studio: this needs the studio's launch token, which the studio printed to the console of the user "
            "who started it. Open the URL it printed (http://…/?token=…), or send 'Authorization: Bearer TOKEN'."))

    # ------------------------------------------------------------------------------------------
    # The checks
    # ------------------------------------------------------------------------------------------

    def _host_refusal(self, host: str, port: int | None) -> str | None:
        if self._known(_HOST.fullmatch(host.strip().lower()), port):
            return None
        return (f"PML Studio answers this machine only: the Host '{host or '(none)'}' is not one of its addresses "
                f"({', '.join(self.hosts)}, port {port}). Open http://127.0.0.1:{port}/ instead, or start the "
                "studio with --allow-host NAME to serve that name.")

    def _origin_refusal(self, origin: str | None, port: int | None) -> str | None:
        if origin is None or self._known(_ORIGIN.fullmatch(origin.strip().lower()), port):
            return None  # no Origin: not a cross-origin browser request (a program, or the page loading itself)
        return (f"PML Studio refuses requests from another site: Origin '{origin}' is not the studio's page. "
                f"Use the studio at http://127.0.0.1:{port}/, or its API from a program with the launch token.")

    def _matches(self, given: str | None) -> bool:
        return given is not None and secrets.compare_digest(given.encode(), self.token.encode())

    def _cookie(self, headers: dict, port: int | None) -> str | None:
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header carries no token
            return None
        morsel = cookie.get(cookie_name(port))
        return morsel.value if morsel is not None else None

    def _known(self, match, port: int | None) -> bool:
        """A parsed host[:port] is the studio's own address (or a --allow-host name, on any port)."""
        if match is None:
            return False
        name, given = match.group(1), match.group(2)
        return name in self.proxied or (name in self.hosts and (port is None or int(given or 80) == port))

    async def _enter(self, scope, send, query: dict, port: int | None):
        """The page opened with its token: set the cookie, and send the browser to the URL without the token (so
        it stays out of the address bar and the history)."""
        rest = urlencode({k: v for k, v in query.items() if k != "token"})
        cookie = f"{cookie_name(port)}={self.token}; Path=/; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", ("/" + (f"?{rest}" if rest else "")).encode()),
                                (b"set-cookie", cookie.encode()), (b"cache-control", b"no-store"),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


def cookie_name(port: int | None) -> str:
    return f"pml_studio_{port or 0}"  # cookies ignore ports: two studios on one host keep their own


def login_page(wrong: bool) -> str:
    """The page a browser without the token gets: where to find the token, and a box to paste it."""
    note = "<p class=wrong>That token is not this studio's.</p>" if wrong else ""
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>PML Studio: token needed</title>"
        "<style>body{font:16px system-ui,sans-serif;max-width:36em;margin:4em auto;color:#1e293b}"
        "input{font:inherit;width:100%;padding:.4em;margin:.5em 0}.wrong{color:#b91c1c}</style></head><body>"
        "<h1>PML Studio</h1>"
        "<p>This studio is open only to the user who started it. Open the URL it printed to its console "
        "(<code>http://127.0.0.1:PORT/?token=…</code>), or paste the token here.</p>" + note +
        "<form method=get action=/><input type=password name=token autocomplete=off autofocus "
        "aria-label=token><button type=submit>Open the studio</button></form></body></html>")


def _bearer(headers: dict) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _answer(scope, send, status: int, text: str, kind: str = "text/plain"):
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = text.encode()
    if scope.get("path", "").startswith(API_PREFIX):  # the OpenAI-compatible API: its clients read OpenAI's shape
        from .api.errors import refusal_body

        body, kind = refusal_body(status, text), "application/json"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", f"{kind}; charset=utf-8".encode()),
                            (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})

