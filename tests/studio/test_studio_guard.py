"""Only this machine's user drives the studio (studio/guard.py), tried as a hostile page would.

The studio is served as `make run` serves it; requests go straight to Gradio's routes with httpx. The
code-execution case uploads a prompt program whose top-level code writes a marker file and calls the
"Import from Python" event directly: with a foreign Host and Origin (DNS rebinding), with a foreign
Origin (a cross-site page), and from a local program without the page's token. The marker must not
appear. A positive control runs the same call as the page does (its cookie) and sees the marker, so
the test would notice code that ran.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from engine.runlog import RunLog
from tests.studio_fixtures import served_studio

EVIL = "attacker.example"


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


def page_client(port: int) -> httpx.Client:
    """A client that opened the page, as the browser does: it holds the page's cookie."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    assert client.get("/").status_code == 200
    return client


def upload(client: httpx.Client, marker, **kw) -> httpx.Response:
    return client.post("/gradio_api/upload", files={"files": ("evil.py", program(marker), "text/x-python")}, **kw)


def join(client: httpx.Client, fn_index: int, path: str, **kw) -> httpx.Response:
    body = {"data": [{"path": path, "orig_name": "evil.py", "meta": {"_type": "gradio.FileData"}}],
            "fn_index": fn_index, "session_hash": uuid.uuid4().hex[:11], "event_data": None, "trigger_id": None}
    return client.post("/gradio_api/queue/join", json=body, **kw), body["session_hash"]


def wait_done(client: httpx.Client, session: str, seconds: float = 20) -> None:
    with client.stream("GET", f"/gradio_api/queue/data?session_hash={session}", timeout=seconds) as resp:
        for line in resp.iter_lines():
            if "process_completed" in line:
                return


def test_foreign_host_is_refused_and_the_page_gets_its_token(served):
    demo, port = served
    evil = httpx.get(f"http://127.0.0.1:{port}/", headers={"Host": f"{EVIL}:{port}"})
    assert evil.status_code == 403 and "Host" in evil.text and "set-cookie" not in evil.headers
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        ok = httpx.get(f"http://127.0.0.1:{port}/", headers={"Host": host})
        assert ok.status_code == 200
        cookie = ok.headers["set-cookie"]
        assert cookie.startswith(f"pml_studio_{port}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    # another port on the same name is another origin
    assert httpx.get(f"http://127.0.0.1:{port}/", headers={"Host": f"127.0.0.1:{port + 1}"}).status_code == 403


def test_import_from_python_runs_no_code_for_another_origin(served, tmp_path):
    demo, port = served
    fn_index = import_event(demo)
    marker = tmp_path / "ran.txt"
    page = page_client(port)
    # the file, uploaded as the page would upload it: the strongest case, a valid upload path in hand
    path = upload(page, marker).json()[0]

    rebinding = {"Host": f"{EVIL}:{port}", "Origin": f"http://{EVIL}:{port}"}
    cross_site = {"Origin": f"http://{EVIL}"}
    other_local_page = {"Origin": f"http://127.0.0.1:{port + 1}"}
    for headers in (rebinding, cross_site, other_local_page):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as evil:
            assert upload(evil, marker, headers=headers).status_code == 403
            resp, _ = join(evil, fn_index, path, headers=headers)
            assert resp.status_code == 403, headers
            assert evil.post("/gradio_api/call/on_python", json={"data": [None]}, headers=headers).status_code == 403
    # a local program without the page's token: private events are the page's alone
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as local:
        assert upload(local, marker).status_code == 403
        resp, _ = join(local, fn_index, path)
        assert resp.status_code == 403 and "page" in resp.text
    time.sleep(0.5)
    assert not marker.exists(), "a refused call ran the uploaded file's code"

    # positive control: the page itself imports the file, and its code runs (as the Schema tab says)
    resp, session = join(page, fn_index, path)
    assert resp.status_code == 200
    wait_done(page, session)
    assert marker.read_text() == "ran"


def test_page_token_is_per_studio(served, tiny_engine, tmp_path):
    demo, port = served
    page = page_client(port)
    forged = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          cookies={f"pml_studio_{port}": "not-the-token"})
    marker = tmp_path / "never.txt"
    assert upload(forged, marker).status_code == 403
    assert upload(page, marker).status_code == 200


def test_uploads_over_5_mb_are_refused(served):
    demo, port = served
    page = page_client(port)
    big = page.post("/gradio_api/upload", files={"files": ("big.xml", b"<schema name='x'>" + b" " * (6 << 20), "text/xml")})
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


def test_app_py_passes_its_options_to_the_served_studio(monkeypatch):
    """`make run ARGS=...` parses app.py's options and hands every one of them to studio.launch.serve."""
    import app
    from studio import launch

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda **kw: seen.update(kw) or 0)
    assert app.main(["--port", "7999", "--allow-host", "studio.lan", "--allow-host", "proxy.lan"]) == 0
    assert seen["port"] == 7999 and seen["host"] == "127.0.0.1" and seen["share"] is False
    assert seen["allow_hosts"] == ("studio.lan", "proxy.lan")
