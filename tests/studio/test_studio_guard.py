"""Only the user who started the studio drives it (studio/guard.py), tried as another account and a hostile page would.

The studio is served as `make run` serves it, with a launch token; requests go straight to Gradio's routes. The
code-execution case uploads a prompt program whose top-level code writes a marker file and calls the "Import from
Python" event directly: as another account on this machine (a child process running as `nobody` where the tests
run as root, else this process without the token), with a foreign Host (DNS rebinding) and with a foreign Origin
(another local page). The marker must not appear. A positive control runs the same call with the token and sees
the marker, so the test would notice code that ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from engine.runlog import RunLog
from studio import guard
from tests.conftest import free_port
from tests.studio_fixtures import AUTH, TOKEN, served_studio

EVIL = "attacker.example"
NOBODY = 65534


@pytest.fixture(scope="module")
def served(tiny_lm, tmp_path_factory):
    """One studio for the module (each test uses its own files and sessions)."""
    from engine.session import Engine

    with served_studio(Engine.from_loaded(tiny_lm), RunLog(tmp_path_factory.mktemp("log") / "runs.db")) as served:
        yield served


def event_of(demo, name: str) -> int:
    """fn_index of the event whose function is studio.tabs.schema.``name``."""
    ids = [fn._id for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == name]
    assert len(ids) == 1, name
    return ids[0]


def import_from_python(c: httpx.Client, demo, path: str, session: str | None = None, confirm: bool = True) -> str:
    """What the page does for Import from Python: the upload event, then (``confirm``) the confirm button's event in
    the same session; returns the session."""
    session = session or uuid.uuid4().hex[:11]
    for name, data in (("on_python_upload", [file_data(path)]), ("on_python_confirm", [None]))[:2 if confirm else 1]:
        body = {**join_body(event_of(demo, name), None), "data": data, "session_hash": session}
        assert c.post("/gradio_api/queue/join", json=body).status_code == 200
        wait_done(c, session)
    return session


def file_data(path: str | None) -> dict | None:
    return {"path": path, "orig_name": "evil.py", "meta": {"_type": "gradio.FileData"}} if path else None


def program(marker) -> bytes:
    return (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "from engine.programs import prompt_program\n\n"
            "@prompt_program\ndef hello():\n    return 'Hello.'\n").encode()


def client(port: int, **kw) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, **kw)


def upload(c: httpx.Client, marker, **kw) -> httpx.Response:
    return c.post("/gradio_api/upload", files={"files": ("evil.py", program(marker), "text/x-python")}, **kw)


def join_body(fn_index: int, path: str | None) -> dict:
    data = [file_data(path)]
    return {"data": data, "fn_index": fn_index, "session_hash": uuid.uuid4().hex[:11], "event_data": None,
            "trigger_id": None}


def wait_done(c: httpx.Client, session: str, seconds: float = 20) -> None:
    with c.stream("GET", f"/gradio_api/queue/data?session_hash={session}", timeout=seconds) as resp:
        for line in resp.iter_lines():
            if "process_completed" in line:
                return


# The other account: a child process with only the standard library, as `nobody`. It tries every route a page or a
# program would use (and the token-less tricks: a cookie it made up, a wrong bearer) and prints each status.
OTHER_ACCOUNT = textwrap.dedent("""
    import json, sys, urllib.error, urllib.request
    base, fn_ids, path, program = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
    def call(method, route, body=None, headers=None):
        req = urllib.request.Request(base + route, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code
    boundary = "pmlboundary"
    form = (f"--{boundary}\\r\\nContent-Disposition: form-data; name=\\"files\\"; filename=\\"evil.py\\"\\r\\n"
            f"Content-Type: text/x-python\\r\\n\\r\\n").encode() + program + f"\\r\\n--{boundary}--\\r\\n".encode()
    tried = {"page": call("GET", "/"), "config": call("GET", "/config"), "info": call("GET", "/gradio_api/info"),
             "upload": call("POST", "/gradio_api/upload", form, {"Content-Type": f"multipart/form-data; boundary={boundary}"}),
             "compare": call("POST", "/gradio_api/call/compare", b'{"data": []}', {"Content-Type": "application/json"}),
             "made-up cookie": call("GET", "/config", None, {"Cookie": "pml_studio_%s=guess" % base.rsplit(":", 1)[1]}),
             "wrong bearer": call("GET", "/config", None, {"Authorization": "Bearer guess"}),
             "wrong query": call("GET", "/config?token=guess")}
    for fn in fn_ids:
        body = json.dumps({"data": [{"path": path, "orig_name": "evil.py", "meta": {"_type": "gradio.FileData"}}],
                           "fn_index": fn, "session_hash": "abcdefghijk"}).encode()
        tried[f"fn {fn}"] = call("POST", "/gradio_api/queue/join", body, {"Content-Type": "application/json"})
    print(json.dumps(tried))
""")


def other_account_tries(port: int, fn_ids: list[int], path: str, marker) -> dict:
    """Statuses of every route tried by another account (uid 65534) where this process may switch to it, else by a
    token-less process of this account (the same requests)."""
    args = ["/usr/bin/python3", "-c", OTHER_ACCOUNT, f"http://127.0.0.1:{port}", json.dumps(fn_ids), path,
            program(marker).decode()]
    as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin"},
                         **as_nobody)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_another_account_without_the_token_is_refused_everything_and_runs_no_code(served, tmp_path):
    demo, port = served
    marker = tmp_path / "ran.txt"
    owner = client(port, headers=AUTH)
    path = upload(owner, marker).json()[0]  # the strongest case: a valid upload path in the other account's hands
    fn_ids = sorted(fn._id for fn in demo.fns.values())
    tried = other_account_tries(port, fn_ids, path, marker)
    assert len(tried) == 8 + len(fn_ids)
    assert {route: status for route, status in tried.items() if status != 401} == {}
    time.sleep(0.5)
    assert not marker.exists(), "a call without the token ran the uploaded file's code"

    # positive control: the owner (the token as a bearer header, as a program sends it) imports the file and it runs
    import_from_python(owner, demo, path)
    assert marker.read_text() == "ran"


def test_import_from_python_runs_code_only_after_the_confirm_of_the_same_session(served, tmp_path):
    """The upload only asks; the confirm event imports the file its own session uploaded, never a path it names."""
    demo, port = served
    marker = tmp_path / "ran.txt"
    owner = client(port, headers=AUTH)
    path = upload(owner, marker).json()[0]
    asked = import_from_python(owner, demo, path, confirm=False)
    confirm = {**join_body(event_of(demo, "on_python_confirm"), path), "session_hash": uuid.uuid4().hex[:11]}
    assert owner.post("/gradio_api/queue/join", json=confirm).status_code == 200  # another session, naming the file
    wait_done(owner, confirm["session_hash"])
    time.sleep(0.3)
    assert not marker.exists(), "the upload alone, or a confirm of another session, ran the file's code"
    import_from_python(owner, demo, path, session=asked, confirm=False)  # the same session asks again ...
    body = {**join_body(event_of(demo, "on_python_confirm"), None), "session_hash": asked}
    owner.post("/gradio_api/queue/join", json=body)
    wait_done(owner, asked)  # ... and confirms: now it runs
    assert marker.read_text() == "ran"


def test_the_page_without_the_token_is_a_login_form_that_says_where_the_token_is(served):
    demo, port = served
    with client(port) as c:
        page = c.get("/")
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert "printed to its console" in page.text and "<form" in page.text and "#token=" in page.text
        assert TOKEN not in page.text and "gradio_config" not in page.text and "set-cookie" not in page.headers
        assert page.headers["referrer-policy"] == "no-referrer" and "no-referrer" in page.text
        wrong = c.get("/?token=not-the-token")
        assert wrong.status_code == 401 and "not this studio's" in wrong.text.replace(" hidden>", ">")
        for route in ("/config", "/gradio_api/info", "/gradio_api/queue/data?session_hash=x", "/pml-live/x",
                      "/gradio_api/file=/etc/hostname", "/gradio_api/upload_progress?upload_id=x"):
            resp = c.get(route)
            assert resp.status_code == 401 and "launch token" in resp.text, route
            assert resp.headers["referrer-policy"] == "no-referrer"
        assert c.get("/theme.css").status_code == 200  # Gradio's own styles, the same for every studio: no token


def test_the_token_in_the_query_moves_to_the_fragment_and_no_cookie_is_ever_set(served):
    demo, port = served
    with client(port) as c:
        entered = c.get(f"/?token={TOKEN}&__theme=dark")
        assert entered.status_code == 303 and entered.headers["location"] == f"/?__theme=dark#token={TOKEN}"
        assert "set-cookie" not in entered.headers and entered.headers["referrer-policy"] == "no-referrer"
        assert c.get("/config").status_code == 401  # nothing the client keeps lets it in afterwards
        page = c.get("/", headers=AUTH)  # what the bootstrap page fetches, with the header the page script adds
        assert page.status_code == 200 and "gradio_config" in page.text and "set-cookie" not in page.headers
        assert page.text.index("__pmlAuth") < page.text.index("type=\"module\"")  # auth.js first, before Gradio's
        assert c.get(f"/?token={TOKEN}", headers=AUTH).status_code == 303  # with the header too: out of the URL


@pytest.mark.parametrize("route", ["/config", "/gradio_api/info", "/gradio_api/queue/data?session_hash=x",
                                   "/gradio_api/file=/etc/hostname", "/v1/models", "/metrics", "/pml-live/x"])
def test_the_token_in_a_url_is_taken_on_the_page_only(served, route):
    """A URL ends up in logs and history: on every route but the page ``/`` (which moves it to the fragment),
    ``?token=`` is no credential, and the refusal says so."""
    demo, port = served
    with client(port) as c:
        got = c.get(route + ("&" if "?" in route else "?") + f"token={TOKEN}")
        assert got.status_code == 401, got.text[:300]
        if not route.startswith("/v1/"):
            assert "taken on the page / only" in got.text
        with c.stream("GET", route, headers=AUTH) as opened:  # the header opens it (queue/data: a stream)
            assert opened.status_code != 401


def test_a_cookie_alone_opens_nothing(served):
    """The old credential (the token as a cookie, which the browser sends to every port of 127.0.0.1) is no credential:
    a request with only that Cookie is refused."""
    demo, port = served
    for name in (f"pml_studio_{port}", "pml_studio", "token"):
        with client(port, headers={"Cookie": f"{name}={TOKEN}"}) as c:
            for route in ("/config", "/gradio_api/info", "/gradio_api/upload"):
                assert c.request("POST" if route.endswith("upload") else "GET", route).status_code == 401, route


def test_file_links_need_a_fresh_signature_of_their_own_path(served, tmp_path):
    demo, port = served
    owner = client(port, headers=AUTH)
    path = upload(owner, tmp_path / "x").json()[0]  # a file in Gradio's cache, which /gradio_api/file= serves
    route = f"/gradio_api/file={path}"
    assert owner.get(route).status_code == 200
    now = int(time.time())
    with client(port) as c:
        def get(expires, signed_path=route, token=TOKEN):
            sig = guard.link_signature(token, signed_path, expires)
            return c.get(route, params={"pml_exp": expires, "pml_sig": sig}).status_code

        assert get(now + 60) == 200 and b"ran" in c.get(route, params={
            "pml_exp": now + 60, "pml_sig": guard.link_signature(TOKEN, route, now + 60)}).content
        assert get(now - 1) == 401  # expired
        assert get(now + guard.LINK_S + 60) == 401  # a life longer than the page gives
        assert get(now + 60, signed_path=route + "x") == 401  # another file's signature
        assert get(now + 60, token="another-token-0123456789") == 401
        assert c.get(route).status_code == 401


def test_the_token_does_not_open_the_studio_to_another_host_or_origin(served, tmp_path):
    demo, port = served
    marker = tmp_path / "ran.txt"
    owner = client(port, headers=AUTH)
    path = upload(owner, marker).json()[0]
    rebinding = {"Host": f"{EVIL}:{port}", "Origin": f"http://{EVIL}:{port}"}
    cross_site = {"Origin": f"http://{EVIL}"}
    other_local_page = {"Origin": f"http://127.0.0.1:{port + 1}"}
    for headers in (rebinding, cross_site, other_local_page):
        assert upload(owner, marker, headers=headers).status_code == 403
        body = join_body(event_of(demo, "on_python_upload"), path)
        resp = owner.post("/gradio_api/queue/join", json=body, headers=headers)
        assert resp.status_code == 403, headers
    time.sleep(0.5)
    assert not marker.exists()
    assert owner.get("/", headers={"Host": f"127.0.0.1:{port + 1}"}).status_code == 403  # another port: another origin


def test_no_response_carries_cors_headers_for_another_local_origin(served):
    """Gradio's own CORS middleware answers any localhost origin with credentials; the studio takes it out."""
    demo, port = served
    own = f"http://127.0.0.1:{port}"
    with client(port, headers=AUTH) as c:
        for origin in ("http://localhost:8000", "http://127.0.0.1:8000", "null"):
            for method, route in (("GET", "/pml-live/x"), ("GET", "/config"), ("GET", "/gradio_api/info"),
                                  ("POST", "/gradio_api/queue/join")):
                resp = c.request(method, route, headers={"Origin": origin})
                assert resp.status_code == 403, (origin, route)
                assert not [h for h in resp.headers if h.startswith("access-control-")], (origin, route, resp.headers)
            preflight = c.options("/config", headers={"Origin": origin, "Access-Control-Request-Method": "GET"})
            assert preflight.status_code == 403
            assert "access-control-allow-origin" not in preflight.headers
        same = c.get("/config", headers={"Origin": own})
        assert same.status_code == 200 and "access-control-allow-credentials" not in same.headers


def test_monitoring_is_not_served(served, capfd):
    demo, port = served
    with client(port, headers=AUTH) as c:
        for route in ("/monitoring", "/gradio_api/monitoring", "/monitoring/summary"):
            assert c.get(route).status_code == 404
    assert "Monitoring URL" not in capfd.readouterr().out


# Another account's server on another local port: it records every request it receives (headers, Cookie included)
# and serves a page that tries to read the studio, to be sent the studio's credential, and to learn where it came from.
RECORDER = textwrap.dedent("""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    studio = sys.argv[1]
    page = ("<script>window.results = Promise.all(['/config', '/gradio_api/info', '/pml-live/x'].map(r => "
            "fetch('%s' + r, {credentials: 'include'}).then(x => x.text()).then(t => 'read ' + t.length, "
            "e => 'failed')));</script><img src='/pixel.png'><iframe src='%s/'></iframe>" % (studio, studio)).encode()
    class Recorder(BaseHTTPRequestHandler):
        def do_GET(self):
            print(json.dumps({"path": self.path, "headers": self.headers.items()}), flush=True)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page)
        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    print(server.server_address[1], flush=True)
    server.serve_forever()
""")


def test_a_server_of_another_account_on_another_port_receives_nothing_it_can_replay(served, tmp_path):
    """The user opens the studio at the URL it printed, in chromium, and uses it; then follows a link to a page of
    another account's server on another port of 127.0.0.1. That server records every header it receives; replaying
    any of them to the studio (config, info, a file link, Import from Python) is refused and runs no code."""
    from tools.screenshot import CHROMIUM, CHROMIUM_ARGS

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    sync_playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed").sync_playwright
    demo, port = served
    studio = f"http://127.0.0.1:{port}"
    as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
    other = subprocess.Popen(["/usr/bin/python3", "-c", RECORDER, studio], stdout=subprocess.PIPE,
                             text=True, cwd="/", env={"PATH": "/usr/bin:/bin"}, **as_nobody)
    marker = tmp_path / "ran.txt"
    owner = client(port, headers=AUTH)
    path = upload(owner, marker).json()[0]
    try:
        evil = f"http://127.0.0.1:{other.stdout.readline().strip()}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(guard.page_url("127.0.0.1", port, TOKEN))  # what the console printed
                page.wait_for_selector("#schema-validation .pml-status.ok", timeout=120_000)
                assert page.url == f"{studio}/" and page.context.cookies() == []  # the token left the address bar
                page.evaluate("(href) => Object.assign(document.createElement('a'), {href}).click()", f"{evil}/from")
                page.wait_for_url(f"{evil}/from")
                assert page.evaluate("window.results") == ["failed"] * 3
                page.goto(f"http://localhost:{evil.rsplit(':', 1)[1]}/direct")
                time.sleep(0.5)
            finally:
                browser.close()
    finally:
        other.kill()
        log = other.communicate()[0]
    received = [json.loads(line) for line in log.splitlines()]
    assert {r["path"] for r in received} >= {"/from", "/pixel.png", "/direct"}
    assert TOKEN not in log and not any(k.lower() == "referer" and str(port) in v
                                                   for r in received for k, v in r["headers"])
    routes = [("GET", "/config"), ("GET", "/gradio_api/info"), ("GET", f"/gradio_api/file={path}"),
              ("GET", "/")]
    for r in received:  # replay: every header it got, each request's set as a whole and each header alone
        sets = [r["headers"]] + [[h] for h in r["headers"]]
        for headers in sets:
            headers = [(k, v) for k, v in headers if k.lower() not in ("host", "content-length")]
            with client(port, headers=headers) as c:
                for method, route in routes:
                    resp = c.request(method, route)
                    assert resp.status_code in (401, 403) and "gradio_config" not in resp.text, (headers, route)
                body = {**join_body(event_of(demo, "on_python_upload"), path)}
                assert c.post("/gradio_api/queue/join", json=body).status_code in (401, 403)
    time.sleep(0.3)
    assert not marker.exists()


def test_a_token_given_by_the_user_is_checked():
    assert len(guard.make_token()) >= 43 and guard.make_token() != guard.make_token()
    assert guard.make_token("abcdefgh" * 2) == "abcdefgh" * 2
    for bad in ("short", "x" * 20 + " space", "x" * 20 + ";", "é" * 20):
        with pytest.raises(guard.TokenError, match="at least 16 characters"):
            guard.make_token(bad)
    for weak in ("a" * 16, "ab" * 16, "0123456" * 4, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab"):
        with pytest.raises(guard.TokenError, match=r"too easy to guess: it has \d different characters, at least 8"):
            guard.make_token(weak)
    assert guard.page_url("0.0.0.0", 7860, "t" * 16) == f"http://127.0.0.1:7860/#token={'t' * 16}"
    assert guard.page_url("::1", 7860, None) == "http://[::1]:7860/"


@pytest.mark.parametrize("argv, said", [
    (["--no-token", "--host", "0.0.0.0"], "--no-token serves only a loopback address"),
    (["--token", "short"], "at least 16 characters"),
    (["--token", "a" * 16], "too easy to guess: it has 1 different characters"),
    (["--no-token", "--share"], "--no-token cannot go with --share"),
    (["--host", "256.1.1.1"], "--host 256.1.1.1: not an address or a name this machine knows"),
    (["--host", "192.0.2.1"], "--host 192.0.2.1: it is not an address of this machine"),
])
def test_serve_refuses_unsafe_or_impossible_launches_by_name(argv, said, capsys, monkeypatch):
    import app
    import engine.session

    def launched(**kw):
        raise AssertionError(f"{argv} was not refused before the model loads")

    monkeypatch.setattr(engine.session, "Engine", launched)
    assert app.main(argv + ["--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and "port" not in err.split(said)[0]


def test_app_py_passes_its_options_to_the_served_studio(monkeypatch):
    """`make run ARGS=...` parses app.py's options and hands every one of them to studio.launch.serve."""
    import app
    from studio import launch

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda options: seen.update(vars(options)) or 0)
    assert app.main(["--port", "7999", "--allow-host", "studio.lan", "--allow-host", "proxy.lan"]) == 0
    assert seen["port"] == 7999 and seen["host"] == "127.0.0.1" and seen["share"] is False
    assert seen["allow_hosts"] == ("studio.lan", "proxy.lan")
    assert seen["token"] is None and seen["no_token"] is False  # None: $PML_STUDIO_TOKEN, else a random token
    assert app.main(["--token", "x" * 16, "--no-token"]) == 0 and seen["token"] == "x" * 16 and seen["no_token"]


def test_uploads_over_5_mb_are_refused(served):
    demo, port = served
    big = client(port, headers=AUTH).post(
        "/gradio_api/upload", files={"files": ("big.xml", b"<schema name='x'>" + b" " * (6 << 20), "text/xml")})
    assert big.status_code == 413


def test_handlers_refuse_files_over_5_mb_by_name(tmp_path):
    import gradio as gr

    from studio.files import MAX_FILE_BYTES, import_program, read_upload

    big_xml, big_py = tmp_path / "big.xml", tmp_path / "big.py"
    big_xml.write_bytes(b"<schema name='x'>" + b" " * MAX_FILE_BYTES + b"</schema>")
    big_py.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(gr.Error, match=r"big.xml is 5.0 MB; schema and program files are limited to 5 MB"):
        read_upload(str(big_xml))
    imp = import_program(str(big_py))
    assert not imp.ok and "limited to 5 MB" in imp.status


def burst(c: httpx.Client, path: str, headers: list[dict]) -> list[httpx.Response]:
    """One request per headers, all sent at once: a busy machine must not spread them over more than a second."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(headers)) as pool:
        return list(pool.map(lambda h: c.get(path, headers=h), headers))


def test_wrong_tokens_past_the_limit_get_429_and_the_right_token_is_answered_at_once(served):
    demo, port = served
    with client(port, limits=httpx.Limits(max_connections=64)) as c:
        wrong = [{"Authorization": f"Bearer wrong-{i}"} for i in range(guard.FAILS_PER_S + 5)]
        for _ in range(3):  # a second may end inside a burst; the next burst then fills one
            answers = burst(c, "/config", wrong)
            statuses = [a.status_code for a in answers]
            if 429 in statuses:
                break
            time.sleep(1.05)
        assert set(statuses) == {401, 429} and statuses.count(401) >= guard.FAILS_PER_S, statuses
        limited = next(a for a in answers if a.status_code == 429)
        assert limited.headers["retry-after"] == "1" and "too many wrong tokens" in limited.text
        t = time.perf_counter()
        assert c.get("/config", headers=AUTH).status_code == 200  # during the limit: the right token goes through
        assert time.perf_counter() - t < 2
        codes = [a.json()["error"]["code"] for a in burst(c, "/v1/models", [{"Authorization": "Bearer wrong"}] *
                                                          (guard.FAILS_PER_S + 1))]  # the limit holds, or fills again
        assert "rate_limit_exceeded" in codes and set(codes) <= {"rate_limit_exceeded", "invalid_api_key"}
        time.sleep(1.05)
        assert c.get("/config", headers={"Authorization": "Bearer wrong"}).status_code == 401  # the second passed


def test_the_failure_count_is_per_second():
    now = [0.0]
    failures = guard.Failures(limit=3, clock=lambda: now[0])
    assert [failures.full() for _ in range(5)] == [False, False, False, True, True]
    now[0] = 0.99
    assert failures.full()
    now[0] = 1.0
    assert not failures.full()


def test_an_account_past_the_limit_is_locked_and_the_owner_never_is():
    now = [0.0]
    failures = guard.Failures(limit=3, clock=lambda: now[0], own=0)
    for _ in range(3):
        failures.full(NOBODY)
        failures.full(0)
    assert failures.any_full() and failures.locked(NOBODY) and not failures.locked(0) and not failures.locked(None)
    assert not failures.locked(1000)  # another account's count is its own
    now[0] = 1.0
    assert not failures.locked(NOBODY) and not failures.any_full()


def test_the_peer_account_of_a_loopback_connection_is_its_owner():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as conn:
        scope = {"client": conn.getsockname(), "server": server.getsockname()}
        assert guard.peer_account(scope) == os.getuid()
    assert guard.peer_account({"client": ("10.0.0.2", 5), "server": ("10.0.0.1", 7)}) is None


GUESSER = textwrap.dedent("""
    import json, sys, urllib.request, urllib.error
    base, token = sys.argv[1], sys.argv[2]
    def get(key):
        req = urllib.request.Request(base + "/config", headers={"Authorization": "Bearer " + key})
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code
    wrong = []
    while len(wrong) < int(sys.argv[3]) and 429 not in wrong:  # guess until locked out
        wrong.append(get("guess-%d" % len(wrong)))
    print(json.dumps({"wrong": wrong, "right": get(token)}))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another account needs root")
def test_another_account_past_the_limit_gets_its_tokens_unread_while_the_owner_is_served(served):
    """The guesser's right guess during its lock is refused like the wrong ones, so the limit bounds guessing;
    the owner's requests meanwhile are answered."""
    demo, port = served
    out = subprocess.run(["/usr/bin/python3", "-c", GUESSER, f"http://127.0.0.1:{port}", TOKEN,
                          "400"], capture_output=True, text=True, timeout=60, cwd="/",
                         env={"PATH": "/usr/bin:/bin"}, user=NOBODY, group=NOBODY, extra_groups=[])
    assert out.returncode == 0, out.stderr[-2000:]
    tried = json.loads(out.stdout)
    assert set(tried["wrong"][:-1]) == {401} and tried["wrong"][-1] == 429
    assert tried["right"] == 429  # locked: even the right token is not read
    with client(port, headers=AUTH) as owner:
        assert owner.get("/config").status_code == 200


def raw_request(port: int, lines: list[str]) -> int:
    """The status of a GET sent byte for byte (httpx would merge or refuse repeated Host headers)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(["GET /config HTTP/1.1", *lines, "Connection: close", "", ""])).encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_two_host_or_two_origin_headers_are_refused(served):
    demo, port = served
    own, evil = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
    auth = f"Authorization: Bearer {TOKEN}"
    assert raw_request(port, [f"Host: {own}", auth]) == 200
    assert raw_request(port, [f"Host: {own}", f"Origin: http://{own}", auth]) == 200
    for lines in ([f"Host: {own}", f"Origin: http://{evil}", f"Origin: http://{own}"],
                  [f"Host: {own}", f"Origin: http://{own}", f"Origin: http://{own}"]):
        assert raw_request(port, [*lines, auth]) == 403, lines
    for lines in ([f"Host: {evil}", f"Host: {own}"], [f"Host: {own}", f"Host: {own}"]):
        assert raw_request(port, [*lines, auth]) in (400, 403), lines  # uvicorn's h11 refuses two Hosts itself

    # the guard on its own (a server that passes both Host headers on): refused too, whichever comes last
    import asyncio

    async def app(scope, receive, send):
        raise AssertionError("the request reached the app")

    sent = []

    async def send(message):
        sent.append(message)

    checked = guard.LocalGuard(app, guard.allowed_hosts("127.0.0.1"), token=TOKEN)
    for hosts in ((evil, own), (own, own)):
        scope = {"type": "http", "method": "GET", "path": "/config", "server": ("127.0.0.1", port),
                 "headers": [(b"host", h.encode()) for h in hosts] + [(b"authorization", f"Bearer {TOKEN}".encode())]}
        asyncio.run(checked(scope, None, send))
        assert sent[-2]["status"] == 403 and b"more than one Host header" in sent[-1]["body"]


def test_a_malformed_queue_join_is_not_echoed_whole_to_the_console(served, capfd):
    """A join whose data do not fit its event makes Gradio print a traceback that quotes what it received (a 20 MB
    body went to the console whole); that, and uvicorn's log of a failed request, are cut to MAX_TRACEBACK
    characters."""
    import io
    import logging

    from studio.errors import MAX_TRACEBACK

    demo, port = served
    big = "x" * (2 << 20)
    capfd.readouterr()
    join = f"http://127.0.0.1:{port}/gradio_api/queue/join"
    assert httpx.post(join, headers=AUTH, json={"data": [big], "fn_index": 0, "session_hash": "echo-1"}).is_success
    with client(port, headers=AUTH) as c:
        wait_done(c, "echo-1", seconds=120)
    console = "".join(capfd.readouterr())
    assert "Traceback" in console and len(console) < 2 * MAX_TRACEBACK and "x" * 20_000 not in console
    logged, log = io.StringIO(), logging.getLogger("uvicorn.error")
    handler = logging.StreamHandler(logged)
    log.addHandler(handler)
    try:
        try:
            raise KeyError(big)
        except KeyError:
            log.exception("Exception in ASGI application")
    finally:
        log.removeHandler(handler)
    assert "KeyError" in logged.getvalue() and len(logged.getvalue()) < 2 * MAX_TRACEBACK
