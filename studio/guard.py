"""Only the user who started the studio drives it: an ASGI guard in front of every route.

Binding to 127.0.0.1 keeps other machines out, but not other *accounts* on this machine, nor other web pages
the user's browser opens. Every request passes three checks here, before Gradio sees it:

1. **Host**: the ``Host`` header names the address the studio serves — 127.0.0.1, localhost, [::1] or the
   ``--host`` given (plus ``--allow-host`` names), with the port it listens on. A DNS-rebinding page sends its
   own name and is refused. A request with two Host (or two Origin) headers is refused whole.
2. **Origin**: a request that carries an ``Origin`` (any method: browsers send it on cross-origin reads too)
   must come from one of those addresses, port included. Another local server's page is refused, and no
   response carries CORS headers for it (Gradio's own CORS middleware is taken out at start: :func:`no_cors`).
3. **Launch token** (Jupyter's model): a random token made at start and printed only to the console of the
   user who started the studio, in the URL it says to open, ``http://127.0.0.1:PORT/#token=…``. The fragment
   never leaves the browser; the page keeps the token in the tab's ``sessionStorage`` (this origin's, port
   included) and sends it as ``Authorization: Bearer`` on its own requests (assets/auth.js). No cookie: a
   browser sends a cookie for 127.0.0.1 to every port of 127.0.0.1, so another account's server on another port
   would receive it and could replay it. Programs send the bearer header (``/compare``, gradio_client, the
   OpenAI API) or ``?token=``. Files the page loads by URL carry a link signed with the token that expires
   within :data:`LINK_S` s (:func:`link_signature`). Without the token ``GET /`` is the bootstrap page (a login
   form when the browser holds no token), Gradio's built scripts and styles (no user data: :data:`PUBLIC`) are
   served, and every other route answers 401; past :data:`FAILS_PER_S` wrong tokens a second from one account,
   429, and that account's tokens go unread until the second has passed (:class:`Failures`).
   ``token=None`` (``--no-token``, loopback only) skips this check.

Gradio's monitoring routes are not served (they print a key to the console). Refusals are plain-text answers
that say what was refused and how to reach the studio instead; under ``/v1/`` (the OpenAI-compatible API, whose
key is the launch token) they are OpenAI's JSON error bodies, 401 ``invalid_api_key`` and 403 ``forbidden``.
Every answer carries ``Referrer-Policy: no-referrer``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections import deque
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")
TOKEN_ENV = "PML_STUDIO_TOKEN"
MIN_TOKEN = 16  # characters of a token given by the user (a made one has 43)
MIN_DISTINCT = 8  # different characters in it: 16 of one character, or 'abababab…', are guessed first
_HOST = re.compile(r"(\[[^\]]+\]|[^:/\[\]]+)(?::(\d{1,5}))?")
_ORIGIN = re.compile(r"https?://" + _HOST.pattern + "/?")
_TOKEN = re.compile(r"[A-Za-z0-9._~-]+")  # safe in a URL, a fragment and a header without quoting
# Gradio's launch calls this itself, without the token: it starts the queue once and returns False ever after
OPEN_PATHS = ("/gradio_api/startup-events",)
# What the browser loads by URL before the page can send its token: Gradio's built scripts, styles and icons and the
# theme's CSS, the same for every studio (the page's data comes from /config and the event routes, both guarded)
PUBLIC = re.compile(r"/(?:assets/|static/|svelte/|favicon\.ico$|manifest\.json$|(?:gradio_api/)?theme\.css$)")
_MONITORING = re.compile(r"^(?:/gradio_api)?/monitoring(?:/.*)?$")
API_PREFIX = "/v1/"  # the OpenAI-compatible API (studio/api/): refusals there are OpenAI-shaped JSON
FILE_LINKS = "/gradio_api/file="  # files the page shows or downloads by URL: signed links (assets/auth.js)
LINK_S = 120  # seconds a signed file link stays valid (the page signs it again at each click)
FAILS_PER_S = 20  # wrong tokens answered 401 in any second; more get 429 until the second has passed
AUTH_JS = Path(__file__).resolve().parent.parent / "assets" / "auth.js"
_NO_REFERRER = (b"referrer-policy", b"no-referrer")


class TokenError(ValueError):
    """A launch token given by the user that cannot be used."""


def make_token(given: str | None = None) -> str:
    """The launch token: ``given`` (checked) or a new random one."""
    if given is None:
        return secrets.token_urlsafe(32)
    if len(given) < MIN_TOKEN or not _TOKEN.fullmatch(given):
        raise TokenError(f"the launch token must be at least {MIN_TOKEN} characters of A-Z, a-z, 0-9 and ._~- "
                         f"(got {len(given)} characters); leave --token and ${TOKEN_ENV} unset for a random one")
    if len(set(given)) < MIN_DISTINCT:
        raise TokenError(f"the launch token is too easy to guess: it has {len(set(given))} different characters, "
                         f"at least {MIN_DISTINCT} are needed; use a random one (leave --token and ${TOKEN_ENV} "
                         "unset, or python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return given


def page_url(host: str, port: int, token: str | None) -> str:
    """The URL the console prints: the studio's page with its token in the fragment, which the browser keeps to
    itself (loopback when bound to every address)."""
    name = _bare(host) or "127.0.0.1"
    return f"http://{name}:{port}/" + (f"#token={token}" if token else "")


def link_signature(token: str, path: str, expires: int) -> str:
    """The signature of a file link (assets/auth.js makes the same): HMAC-SHA256 of the expiry and the request's
    path (percent-decoded, as the server sees it), keyed by the launch token."""
    return hmac.new(token.encode(), f"{expires}\n{path}".encode(), hashlib.sha256).hexdigest()


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


class Failures:
    """Wrong tokens of the last second, per account (``None``: accounts not told apart). Past ``limit`` of them
    the account is *locked* for the rest of that second: its tokens are not even compared, so a guesser learns
    nothing and guesses at most ``limit`` a second. The studio's own account is never locked (it could read the
    token anyway), so another account's flood cannot lock the user out."""

    def __init__(self, limit: int = FAILS_PER_S, clock=time.monotonic, own=None):
        self.limit, self.clock, self.own = limit, clock, own
        self.times: dict = {}  # account -> deque of failure times

    def full(self, account=None) -> bool:
        """Count one more wrong token of ``account``; whether its second already held ``limit`` of them."""
        times = self._recent(account)
        if len(times) >= self.limit:
            return True
        times.append(self.clock())
        return False

    def locked(self, account) -> bool:
        """``account`` (another account, told apart) is past the limit: refuse its tokens unread."""
        return account is not None and account != self.own and len(self._recent(account)) >= self.limit

    def any_full(self) -> bool:
        return any(len(self._recent(a)) >= self.limit for a in list(self.times))

    def _recent(self, account) -> deque:
        times, now = self.times.setdefault(account, deque()), self.clock()
        while times and now - times[0] >= 1.0:
            times.popleft()
        return times


def peer_account(scope) -> int | None:
    """The uid owning the client's end of a loopback TCP connection (Linux /proc/net/tcp*); None if unknown."""
    client, server = scope.get("client"), scope.get("server")
    if not client or not server or not str(client[0]).startswith(("127.", "::1", "::ffff:127.")):
        return None
    want = f":{int(client[1]):04X}"
    back = f":{int(server[1]):04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 7 and cols[1].endswith(want) and cols[2].endswith(back):
                return int(cols[7])
    return None


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
        self.failures = Failures(own=os.getuid() if hasattr(os, "getuid") else None)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        send = _no_referrer(send)
        refusal = self._place_refusal(scope)
        if refusal is not None:
            return await _answer(scope, send, 403, refusal)
        path, method = scope.get("path", ""), scope.get("method")
        if _MONITORING.match(path):
            return await _answer(scope, send, 404, "PML Studio does not serve Gradio's monitoring pages.")
        if self.token is None or path in OPEN_PATHS or (method in ("GET", "HEAD") and PUBLIC.match(path)):
            return await self.app(scope, receive, send)
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        given = _bearer(_headers(scope)[0]) or query.get("token")
        link = path.startswith(FILE_LINKS) and method in ("GET", "HEAD") and "pml_sig" in query
        account = peer_account(scope) if (given is not None or link) and self.failures.any_full() else None
        if account is not None and self.failures.locked(account):
            return await self._too_many(scope, send)
        if given is not None and self._matches(given):
            if method == "GET" and path == "/" and "token" in query:
                return await self._to_fragment(send, query)
            return await self.app(scope, receive, send)
        if link and self._signed(path, query):
            return await self.app(scope, receive, send)
        if (given is not None or link) and self.failures.full(peer_account(scope) if account is None else account):
            return await self._too_many(scope, send)
        if scope["type"] == "http" and method in ("GET", "HEAD") and path == "/":
            return await _answer(scope, send, 401, bootstrap_page("token" in query), "text/html")
        return await _answer(scope, send, 401, (
            "PML Studio: this needs the studio's launch token, which the studio printed to the console of the user "
            "who started it. Open the URL it printed (http://…/#token=…), or send 'Authorization: Bearer TOKEN'."))

    async def _too_many(self, scope, send):
        return await _answer(scope, send, 429, "PML Studio: too many wrong tokens in the last second; try again "
                             "in a second with the token the studio printed.", retry_after=1)

    # ------------------------------------------------------------------------------------------
    # The checks
    # ------------------------------------------------------------------------------------------

    def _place_refusal(self, scope) -> str | None:
        """Why the request's Host or Origin is not the studio's own (None: they are)."""
        headers, twice = _headers(scope)
        if twice:
            return (f"PML Studio refuses a request with more than one {' and '.join(sorted(twice))} header: a "
                    "browser sends one; a request that names two places cannot say which one it comes from.")
        port = (scope.get("server") or (None, None))[1]
        return self._host_refusal(headers.get("host", ""), port) or self._origin_refusal(headers.get("origin"), port)

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

    def _signed(self, path: str, query: dict) -> bool:
        """A file link the page signed (assets/auth.js) that has not expired."""
        try:
            expires = int(query.get("pml_exp", ""))
        except ValueError:
            return False
        if not time.time() <= expires <= time.time() + LINK_S + 5:  # 5 s: the browser's clock and ours
            return False
        want = link_signature(self.token, path, expires)
        return secrets.compare_digest(want.encode(), query["pml_sig"].encode("utf-8", "replace"))

    def _known(self, match, port: int | None) -> bool:
        """A parsed host[:port] is the studio's own address (or a --allow-host name, on any port)."""
        if match is None:
            return False
        name, given = match.group(1), match.group(2)
        return name in self.proxied or (name in self.hosts and (port is None or int(given or 80) == port))

    async def _to_fragment(self, send, query: dict):
        """The page opened the old way, ``/?token=…``: the same page with the token in the fragment (the bootstrap
        page keeps it in the tab and takes it out of the address bar); no cookie."""
        rest = urlencode({k: v for k, v in query.items() if k != "token"})
        where = "/" + (f"?{rest}" if rest else "") + f"#token={self.token}"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", where.encode()), (b"cache-control", b"no-store"),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


# The bootstrap page: moves a token from the fragment to sessionStorage, takes it out of the address bar, and loads
# the studio's page with it (assets/auth.js adds the header), written over this one; without a token, the form.
_BOOT = """
(() => {
  const {KEY} = window.__pmlAuth, form = document.getElementById("login"), wrong = document.getElementById("wrong");
  const load = async () => {
    const answer = await fetch(location.pathname + location.search, {cache: "no-store"});
    if (answer.status === 401 || answer.status === 403) {
      sessionStorage.removeItem(KEY);
      wrong.hidden = false;
      form.hidden = false;
      return;
    }
    const page = await answer.text();
    window.__pmlAuth.listen = window.__pmlAuth.listen || (() => {});
    document.open();
    document.write(page);
    document.close();
  };
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.has("token")) {
    sessionStorage.setItem(KEY, hash.get("token"));
    history.replaceState(null, "", location.pathname + location.search);
  }
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, form.elements.token.value.trim());
    load();
  });
  if (sessionStorage.getItem(KEY)) load(); else form.hidden = false;
})();
"""


def bootstrap_page(wrong: bool) -> str:
    """The page a browser gets at ``/`` before it sends the token: it loads the studio with the token the tab holds
    (or the URL's fragment carries); else where to find the token, and a box to paste it."""
    script = AUTH_JS.read_text(encoding="utf-8") if AUTH_JS.exists() else "window.__pmlAuth = {KEY: 'pml'};"
    return (
        "<!doctype html><html><head><meta charset=utf-8><meta name=referrer content=no-referrer>"
        "<title>PML Studio</title><script>" + script + "</script>"
        "<style>body{font:16px system-ui,sans-serif;max-width:36em;margin:4em auto;color:#1e293b}"
        "input{font:inherit;width:100%;padding:.4em;margin:.5em 0}.wrong{color:#b91c1c}</style></head><body>"
        "<noscript>PML Studio needs JavaScript.</noscript>"
        "<form id=login hidden><h1>PML Studio</h1>"
        "<p>This studio is open only to the user who started it. Open the URL it printed to its console "
        "(<code>http://127.0.0.1:PORT/#token=…</code>), or paste the token here.</p>"
        f"<p class=wrong id=wrong{'' if wrong else ' hidden'}>That token is not this studio's.</p>"
        "<input type=password name=token autocomplete=off autofocus aria-label=token>"
        "<button type=submit>Open the studio</button></form>"
        "<script>" + _BOOT + "</script></body></html>")


def _bearer(headers: dict) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _headers(scope) -> tuple[dict[str, str], set[str]]:
    """The request's headers by lower-case name, and which of Host and Origin came more than once."""
    headers: dict[str, str] = {}
    twice: set[str] = set()
    for k, v in scope.get("headers", []):
        name = k.decode("latin-1").lower()
        if name in headers and name in ("host", "origin"):
            twice.add(name.capitalize())
        headers[name] = v.decode("latin-1")
    return headers, twice


def _no_referrer(send):
    """``send`` adding ``Referrer-Policy: no-referrer`` to the answer: a link the page follows names no page of the
    studio (nor a query of it) to the site it opens."""
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), _NO_REFERRER]}
        await send(message)
    return sending


async def _answer(scope, send, status: int, text: str, kind: str = "text/plain", retry_after: int | None = None):
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = text.encode()
    if scope.get("path", "").startswith(API_PREFIX):  # the OpenAI-compatible API: its clients read OpenAI's shape
        body, kind = api_refusal(status, text), "application/json"
    headers = [(b"content-type", f"{kind}; charset=utf-8".encode()), (b"content-length", str(len(body)).encode()),
               (b"cache-control", b"no-store")]
    headers += [(b"retry-after", str(retry_after).encode())] if retry_after is not None else []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def api_refusal(status: int, text: str) -> bytes:
    """The refusal as an OpenAI error body, the shape studio/api answers in."""
    code = {401: "invalid_api_key", 403: "forbidden", 429: "rate_limit_exceeded"}.get(status, "not_found")
    if status == 401:  # the guard's words are for a browser; a program needs to hear about its key
        text = ("missing or wrong API key: the key is the launch token this server printed to the console of the "
                "user who started it (or $PML_STUDIO_TOKEN); send it as 'Authorization: Bearer TOKEN' (the openai "
                "client's api_key)")
    return json.dumps({"error": {"message": text, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
