"""Only the user who started the studio drives it: an ASGI guard in front of every route.

Every request passes three checks before Gradio sees it: its ``Host`` is one of the studio's addresses (against
DNS rebinding), its ``Origin``, if any, is the studio's page, and it carries the launch token (as a bearer
header, a signed file link, or ``?token=`` on the page ``/`` alone, which moves it to the fragment). No cookie: a
browser would send it to every port of 127.0.0.1. docs/security.md explains the design and what each refusal says.
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
MIN_TOKEN = 16  # a made token has 43 characters
MIN_DISTINCT = 8  # 16 of one character, or 'abababab…', are guessed first
_HOST = re.compile(r"(\[[^\]]+\]|[^:/\[\]]+)(?::(\d{1,5}))?")
_ORIGIN = re.compile(r"https?://" + _HOST.pattern + "/?")
_TOKEN = re.compile(r"[A-Za-z0-9._~-]+")  # safe in a URL, a fragment and a header without quoting
# Gradio's launch calls the first itself, without the token; a router checks the API's /health (200 or 503, no more)
OPEN_PATHS = ("/gradio_api/startup-events", "/health")
# Gradio's built scripts, styles and theme: the same for every studio, loaded before the page holds the token
PUBLIC = re.compile(r"/(?:assets/|static/|svelte/|favicon\.ico$|manifest\.json$|(?:gradio_api/)?theme\.css$)")
_MONITORING = re.compile(r"^(?:/gradio_api)?/monitoring(?:/.*)?$")
API_PREFIX = "/v1/"
FILE_LINKS = "/gradio_api/file="
LINK_S = 120  # the page signs a link again at each click
FAILS_PER_S = 20  # wrong tokens answered 401 in any second; more get 429
AUTH_JS = Path(__file__).resolve().parent.parent / "assets" / "auth.js"
_NO_REFERRER = (b"referrer-policy", b"no-referrer")


class TokenError(ValueError):
    """A launch token given by the user that cannot be used."""


def make_token(given: str | None = None) -> str:
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
    """The URL the console prints, the token in the fragment, which the browser keeps to itself."""
    name = _bare(host) or "127.0.0.1"
    return f"http://{name}:{port}/" + (f"#token={token}" if token else "")


def link_signature(token: str, path: str, expires: int) -> str:
    """HMAC-SHA256 of the expiry and the percent-decoded path, keyed by the launch token (assets/auth.js agrees)."""
    return hmac.new(token.encode(), f"{expires}\n{path}".encode(), hashlib.sha256).hexdigest()


def allowed_hosts(host: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, *filter(None, [_bare(host)]))))


def is_loopback(host: str) -> bool:
    return (_bare(host) or "") in LOOPBACK_NAMES or host.strip().startswith("127.")


def _bare(name: str) -> str | None:
    name = name.strip().lower()
    if not name or name in ("0.0.0.0", "::", "[::]"):
        return None
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


def no_cors(app) -> None:
    """Take Gradio's CORS middleware out of a started App: it answers any localhost origin with credentials, so
    another local port's page could read the studio's answers. Call it at lifespan startup."""
    kept = [m for m in app.user_middleware if m.cls.__name__ != "CustomCORSMiddleware"]
    if len(kept) != len(app.user_middleware):
        app.user_middleware[:] = kept
        app.middleware_stack = None


class Failures:
    """Wrong tokens of the last second, per account. Past ``limit`` an account's tokens go unread for the rest of the
    second; the studio's own account is never locked, so another account's flood cannot lock the user out."""

    def __init__(self, limit: int = FAILS_PER_S, clock=time.monotonic, own=None):
        self.limit, self.clock, self.own = limit, clock, own
        self.times: dict = {}

    def full(self, account=None) -> bool:
        times = self._recent(account)
        if len(times) >= self.limit:
            return True
        times.append(self.clock())
        return False

    def locked(self, account) -> bool:
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
    """ASGI middleware: refuse foreign Hosts, foreign Origins and requests without the launch token (``token``
    None: ``--no-token``)."""

    def __init__(self, app, hosts: tuple[str, ...], proxied: tuple[str, ...] = (), token: str | None = None):
        self.app = app
        self.hosts = tuple(h.lower() for h in hosts)
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
        page = scope["type"] == "http" and method in ("GET", "HEAD") and path == "/"
        # a token in a URL lands in logs and history: taken on the page only, which moves it to the fragment
        given = _bearer(_headers(scope)[0]) or (query.get("token") if page else None)
        link = path.startswith(FILE_LINKS) and method in ("GET", "HEAD") and "pml_sig" in query
        account = peer_account(scope) if (given is not None or link) and self.failures.any_full() else None
        if account is not None and self.failures.locked(account):
            return await self._too_many(scope, send)
        if given is not None and self._matches(given):
            if page and "token" in query:
                return await self._to_fragment(send, query)
            return await self.app(scope, receive, send)
        if link and self._signed(path, query):
            return await self.app(scope, receive, send)
        if (given is not None or link) and self.failures.full(peer_account(scope) if account is None else account):
            return await self._too_many(scope, send)
        if page:
            return await _answer(scope, send, 401, bootstrap_page("token" in query), "text/html")
        in_url = " (a ?token= in the URL is taken on the page / only)" if "token" in query else ""
        return await _answer(scope, send, 401, (
            "PML Studio: this needs the studio's launch token, which the studio printed to the console of the user "
            f"who started it. Open the URL it printed (http://…/#token=…), or send 'Authorization: Bearer TOKEN'"
            f"{in_url}."))

    async def _too_many(self, scope, send):
        return await _answer(scope, send, 429, "PML Studio: too many wrong tokens in the last second; try again "
                             "in a second with the token the studio printed.", retry_after=1)

    def _place_refusal(self, scope) -> str | None:
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
            return None  # a program, or the page loading itself
        return (f"PML Studio refuses requests from another site: Origin '{origin}' is not the studio's page. "
                f"Use the studio at http://127.0.0.1:{port}/, or its API from a program with the launch token.")

    def _matches(self, given: str | None) -> bool:
        return given is not None and secrets.compare_digest(given.encode(), self.token.encode())

    def _signed(self, path: str, query: dict) -> bool:
        try:
            expires = int(query.get("pml_exp", ""))
        except ValueError:
            return False
        if not time.time() <= expires <= time.time() + LINK_S + 5:  # 5 s for the browser's clock
            return False
        want = link_signature(self.token, path, expires)
        return secrets.compare_digest(want.encode(), query["pml_sig"].encode("utf-8", "replace"))

    def _known(self, match, port: int | None) -> bool:
        if match is None:
            return False
        name, given = match.group(1), match.group(2)
        return name in self.proxied or (name in self.hosts and (port is None or int(given or 80) == port))

    async def _to_fragment(self, send, query: dict):
        """``/?token=…``: a redirect to the same page with the token in the fragment; no cookie."""
        rest = urlencode({k: v for k, v in query.items() if k != "token"})
        where = "/" + (f"?{rest}" if rest else "") + f"#token={self.token}"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", where.encode()), (b"cache-control", b"no-store"),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


# Moves a token from the fragment to sessionStorage and loads the studio's page over this one; else the form.
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
    headers: dict[str, str] = {}
    twice: set[str] = set()
    for k, v in scope.get("headers", []):
        name = k.decode("latin-1").lower()
        if name in headers and name in ("host", "origin"):
            twice.add(name.capitalize())
        headers[name] = v.decode("latin-1")
    return headers, twice


def _no_referrer(send):
    """``send`` with ``Referrer-Policy: no-referrer``: a followed link names no page of the studio."""
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
    if scope.get("path", "").startswith(API_PREFIX):
        body, kind = api_refusal(status, text), "application/json"
    headers = [(b"content-type", f"{kind}; charset=utf-8".encode()), (b"content-length", str(len(body)).encode()),
               (b"cache-control", b"no-store")]
    headers += [(b"retry-after", str(retry_after).encode())] if retry_after is not None else []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def api_refusal(status: int, text: str) -> bytes:
    """The refusal as an OpenAI error body, the shape studio/api answers in."""
    code = {401: "invalid_api_key", 403: "forbidden", 429: "rate_limit_exceeded"}.get(status, "not_found")
    if status == 401:  # a program needs to hear about its key
        text = ("missing or wrong API key: the key is the launch token this server printed to the console of the "
                "user who started it (or $PML_STUDIO_TOKEN); send it as 'Authorization: Bearer TOKEN' (the openai "
                "client's api_key)")
    return json.dumps({"error": {"message": text, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
