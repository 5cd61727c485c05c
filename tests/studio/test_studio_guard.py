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


@pytest.fixture
def served(tiny_engine, tmp_path):
    with served_studio(tiny_engine, RunLog(tmp_path / "runs.db")) as served:
        yield served


def import_event(demo) -> int:
    """fn_index of the Import from Python upload event (its function is studio.tabs.schema.on_python)."""
    ids = [fn._id for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "on_python"
           and type(fn.inputs[0]).__name__ == "UploadButton"]
    assert len(ids) == 1
    return ids[0]


def program(marker) -> bytes:
    return (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "from engine.programs import prompt_program\n\n"
            "@prompt_program\ndef hello():\n    return 'Hello.'\n").encode()


def client(port: int, **kw) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, **kw)


def upload(c: httpx.Client, marker, **kw) -> httpx.Response:
    return c.post("/gradio_api/upload", files={"files": ("evil.py", program(marker), "text/x-python")}, **kw)


def join_body(fn_index: int, path: str | None) -> dict:
    data = [{"path": path, "orig_name": "evil.py", "meta": {"_type": "gradio.FileData"}}] if path else [None]
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
    resp = owner.post("/gradio_api/queue/join", json=(body := join_body(import_event(demo), path)))
    assert resp.status_code == 200
    wait_done(owner, body["session_hash"])
    assert marker.read_text() == "ran"


def test_the_page_without_the_token_is_a_login_form_that_says_where_the_token_is(served):
    demo, port = served
    with client(port) as c:
        page = c.get("/")
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert "printed to its console" in page.text and "<form" in page.text
        assert TOKEN not in page.text and "gradio" not in page.text.lower() and "set-cookie" not in page.headers
        wrong = c.get("/?token=not-the-token")
        assert wrong.status_code == 401 and "not this studio's" in wrong.text
        for route in ("/config", "/gradio_api/info", "/gradio_api/queue/data?session_hash=x", "/pml-live/x",
                      "/theme.css"):
            resp = c.get(route)
            assert resp.status_code == 401 and "launch token" in resp.text, route


def test_the_token_in_the_url_sets_the_cookie_once_and_leaves_the_address_bar(served):
    demo, port = served
    with client(port) as c:
        entered = c.get(f"/?token={TOKEN}&__theme=dark")
        assert entered.status_code == 303 and entered.headers["location"] == "/?__theme=dark"
        cookie = entered.headers["set-cookie"]
        assert cookie.startswith(f"pml_studio_{port}={TOKEN};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        page = c.get("/")  # the cookie, as the browser sends it after the redirect
        assert page.status_code == 200 and "PML Studio" in page.text
        assert c.get("/config").status_code == 200
    forged = client(port, cookies={f"pml_studio_{port}": "not-the-token"})
    assert forged.get("/config").status_code == 401


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
        resp = owner.post("/gradio_api/queue/join", json=join_body(import_event(demo), path), headers=headers)
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


def test_a_page_on_another_local_port_reads_nothing_in_chromium(served, tmp_path):
    """Chromium holds the studio's cookie (the user opened it); a page of another local server then tries to read
    the studio's answers with credentials. Every read fails."""
    from tools.screenshot import CHROMIUM, CHROMIUM_ARGS

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    sync_playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed").sync_playwright
    demo, port = served
    studio = f"http://127.0.0.1:{port}"
    evil = (f"<script>window.results = Promise.all(['/config', '/gradio_api/info', '/pml-live/x'].map(r => "
            f"fetch('{studio}' + r, {{credentials: 'include'}}).then(x => x.text()).then(t => 'read ' + t.length,"
            " e => 'failed')));</script>").encode()

    class Evil(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(evil)

        def log_message(self, *args):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", free_port()), Evil)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(f"{studio}/?token={TOKEN}")
                assert page.url == f"{studio}/" and page.context.cookies()[0]["name"] == f"pml_studio_{port}"
                for host in ("localhost", "127.0.0.1"):
                    page.goto(f"http://{host}:{other.server_address[1]}/")
                    assert page.evaluate("window.results") == ["failed"] * 3, host
            finally:
                browser.close()
    finally:
        other.shutdown()


def test_a_token_given_by_the_user_is_checked():
    assert len(guard.make_token()) >= 43 and guard.make_token() != guard.make_token()
    assert guard.make_token("a" * 16) == "a" * 16
    for bad in ("short", "x" * 20 + " space", "x" * 20 + ";", "é" * 20):
        with pytest.raises(guard.TokenError, match="at least 16 characters"):
            guard.make_token(bad)
    assert guard.page_url("0.0.0.0", 7860, "t" * 16) == f"http://127.0.0.1:7860/?token={'t' * 16}"
    assert guard.page_url("::1", 7860, None) == "http://[::1]:7860/"


@pytest.mark.parametrize("argv, said", [
    (["--no-token", "--host", "0.0.0.0"], "--no-token serves only a loopback address"),
    (["--token", "short"], "at least 16 characters"),
    (["--host", "256.1.1.1"], "--host 256.1.1.1: not an address or a name this machine knows"),
    (["--host", "192.0.2.1"], "--host 192.0.2.1: it is not an address of this machine"),
])
def test_serve_refuses_unsafe_or_impossible_launches_by_name(argv, said, capsys):
    import app

    assert app.main(argv + ["--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and "port" not in err.split(said)[0]


def test_app_py_passes_its_options_to_the_served_studio(monkeypatch):
    """`make run ARGS=...` parses app.py's options and hands every one of them to studio.launch.serve."""
    import app
    from studio import launch

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda **kw: seen.update(kw) or 0)
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
