"""Nothing of the user's is readable by another account, and nothing is left in the temporary folders at a stop.

A studio is served in a child process the way `make run` serves it (studio.launch.serve, the tiny model), with its
own world-writable TMPDIR (as /tmp is) and a cache folder other accounts may enter (as a 0755 home is). The user
loads the page's first events (schema validation: the schema download; History: the CSV export of the whole run
log), runs a Compare and an API request, and downloads the CSV export; every prompt carries a marker. Then another
account (uid 65534, where the tests run as root) reads every file it can under those folders and Gradio's default
/tmp/gradio: none holds the marker, while this account finds it (so the search would notice). After SIGINT, SIGTERM
and SIGHUP, no file under the TMPDIR holds it at all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port
from tests.studio.test_shutdown import wait_until_serving
from tests.studio_fixtures import AUTH, TOKEN, TRAVEL_PROMPT

MARKER = "quasar-zebra-4711"
NOBODY = 65534

CHILD = textwrap.dedent("""
    import json, pathlib, sys
    import gradio as gr
    import engine.session
    from engine.model import SMALL_MODEL
    from engine.model.load import load_tokenizer
    from studio import app, launch
    from tests.conftest import make_tiny_llama

    Engine = engine.session.Engine
    engine.session.Engine = lambda **kw: Engine.from_loaded(make_tiny_llama(load_tokenizer(SMALL_MODEL)[1]))
    build = app.build_app
    def build_app(*args, **kwargs):  # the events the page runs at load, by name, for the test to call
        demo = build(*args, **kwargs)
        names = {getattr(getattr(fn.fn, "func", fn.fn), "__name__", ""): fn._id for fn in demo.fns.values()}
        pathlib.Path(sys.argv[3]).write_text(json.dumps({k: names[k] for k in ("_validate_ui", "_refresh_ui")}))
        return demo
    app.build_app = build_app
    wait = gr.Blocks.block_thread
    def block_thread(self):
        pathlib.Path(sys.argv[2]).touch()
        return wait(self)
    gr.Blocks.block_thread = block_thread
    sys.exit(launch.serve(launch.StudioOptions(port=int(sys.argv[1]), preload=False, token=sys.argv[4])))
""")

# Another account: every file it can read under the folders given, and which of them hold the marker
READER = textwrap.dedent("""
    import json, os, sys
    marker, hits, read = sys.argv[1].encode(), [], 0
    for top in sys.argv[2:]:
        for folder, dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                read += 1
                if marker in data:
                    hits.append(path)
    print(json.dumps({"read": read, "hits": hits}))
""")


def read_as(uid: int | None, folders: list[Path]) -> dict:
    """Files under ``folders`` readable by ``uid`` (None: this account), and those holding the marker."""
    who = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    out = subprocess.run(["/usr/bin/python3", "-c", READER, MARKER, *map(str, folders)], capture_output=True,
                         text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"}, **who)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def open_to_others(folders: list[Path]) -> list[str]:
    """Files under ``folders`` that the mode bits let any other account read (every folder above searchable)."""
    found = []
    for top in folders:
        for folder, dirs, files in os.walk(top):
            here = Path(folder)
            if any(not (p.stat().st_mode & stat.S_IXOTH) for p in [here, *here.parents]):
                continue
            found += [str(here / f) for f in files if (here / f).stat().st_mode & stat.S_IROTH]
    return found


def use_the_studio(port: int, events: dict) -> None:
    """What the user does: the page's load events, a Compare (/compare), History again, the CSV download, an API
    request; every prompt holds the marker."""
    prompt = TRAVEL_PROMPT.replace("Answer in one sentence.", f"Answer in one sentence. {MARKER}")
    schema = (ROOT / "sample_schemas" / "travel.xml").read_text()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=120) as c:
        assert c.get("/").status_code == 200
        run_event(c, events["_validate_ui"], [schema.replace("</schema>", f"<!-- {MARKER} --></schema>"), None])
        from gradio_client import Client

        program = Client(f"http://127.0.0.1:{port}/", headers=AUTH, verbose=False, download_files=False)
        assert program.predict(schema, prompt, 2, "cpu", "prefixed", 0.0, api_name="/compare")["baseline"]
        export = run_event(c, events["_refresh_ui"], ["all"])[3]
        csv = c.get(f"/gradio_api/file={export['path']}")
        assert csv.status_code == 200 and MARKER in csv.text
        api = c.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 2, "temperature": 0,
                                                   "messages": [{"role": "user", "content": f"Hello {MARKER}"}]})
        assert api.status_code == 200, api.text


def run_event(c: httpx.Client, fn_index: int, data: list) -> list:
    """Run one of the page's events through Gradio's queue; its outputs."""
    session = os.urandom(6).hex()
    body = {"data": data, "fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None}
    assert c.post("/gradio_api/queue/join", json=body).status_code == 200
    with c.stream("GET", f"/gradio_api/queue/data?session_hash={session}") as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and '"process_completed"' in line:
                message = json.loads(line[5:])
                assert message["success"], message
                return message["output"]["data"]
    raise AssertionError("the event did not complete")


def start_studio(base: Path, private: Path) -> tuple[subprocess.Popen, int, Path, Path, Path]:
    """A served studio under ``base``: (child, port, its events file, its TMPDIR, its home)."""
    from engine.devices import cache_root

    base.mkdir(mode=0o755)
    base.chmod(0o755)
    tmp, home = base / "tmp", base / "home"
    tmp.mkdir()
    tmp.chmod(0o1777)  # as /tmp: everyone may create files in it
    cache = home / ".cache" / "pml-studio"
    cache.mkdir(parents=True)
    for folder in (home, home / ".cache", cache):
        folder.chmod(0o755)  # a home folder other accounts may enter (Debian's default before bookworm)
    (cache / "models").symlink_to(cache_root() / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADIO_", "HF_HUB", "DO_NOT_TRACK"))}
    env.update(PML_STUDIO_CACHE=str(cache), TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    port, serving, events = free_port(), private / f"{base.name}.serving", private / f"{base.name}.json"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(port), str(serving), str(events), TOKEN], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return child, port, events, tmp, home


def test_another_account_reads_nothing_of_the_user_and_a_stop_leaves_nothing():
    """One studio per signal, started together (their start is most of the time)."""
    names = [n for n in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, n)]
    top = Path(tempfile.mkdtemp(prefix="pml-private-test-", dir="/tmp"))
    private = Path(tempfile.mkdtemp())  # this account's: the serving flags and the events' ids
    top.chmod(0o755)
    studios = {name: start_studio(top / name, private) for name in names}
    try:
        for name, (child, port, events, tmp, home) in studios.items():
            wait_until_serving(child, events.with_suffix(".serving"))
            try:
                use_the_studio(port, json.loads(events.read_text()))
            except AssertionError as err:
                child.kill()
                raise AssertionError(f"{str(err)[-2000:]}\nthe studio's console: {child.communicate()[1][-3000:]}")
            folders = [tmp, home, Path("/tmp/gradio")]
            mine = read_as(None, folders)
            assert any(h.endswith(".csv") for h in mine["hits"]) and any("runs.db" in h for h in mine["hits"]), mine
            assert open_to_others([tmp, home]) == []
            if os.geteuid() == 0:
                theirs = read_as(NOBODY, folders)
                assert theirs["hits"] == [], theirs
            signum = getattr(signal, name)
            child.send_signal(signum)
            out, err = child.communicate(timeout=60)
            assert child.returncode in (0, 128 + signum), (name, err[-3000:])
            assert read_as(None, [tmp])["hits"] == [], name  # nothing of the user's left in the temporary folder
            assert list(tmp.glob("pml-studio-*")) == [] and [p for p in tmp.rglob("*") if p.is_file()] == [], name
    finally:
        for child, *_ in studios.values():
            if child.poll() is None:
                child.kill()
                child.communicate()
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
