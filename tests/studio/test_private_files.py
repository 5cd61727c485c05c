"""Nothing of the user's is readable by another account, nothing is left in the temporary folders at a stop, and
each signal keeps the runs the run log could not take (issue 37, items 3 and 4).

One studio per signal is served in a child process the way `make run` serves it (studio.launch.serve, the tiny
model; tests/studio/test_shutdown.py), with its own world-writable TMPDIR (as /tmp is) and a cache folder other
accounts may enter (as a 0755 home is). The user loads the page's first events (schema validation: the schema
download; History: the CSV export of the whole run log), runs a Compare and an API request, and downloads the CSV
export; every prompt carries a marker. Another account (uid 65534, where the tests run as root) reads every file it
can under those folders and Gradio's default /tmp/gradio: none holds the marker, while this account finds it (so the
search would notice). Then the run log is locked, a Compare and an API request are answered and a stream is
decoding when the signal comes: the studio ends within 5 s, says where the runs went, the next start writes them,
and no file is left under its TMPDIR.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import textwrap
from pathlib import Path

import httpx
import pytest

from engine.runlog import RunLog
from tests.conftest import ROOT
from tests.studio.test_shutdown import FIRST, answer_then_stream, bare_studio, serve_and_signal
from tests.studio_fixtures import AUTH, TRAVEL_PROMPT

MARKER = "quasar-zebra-4711"
NOBODY = 65534

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


def private_folders(base: Path) -> tuple[Path, Path, Path, Path]:
    """(cache, TMPDIR, run log, home) under ``base``: a TMPDIR everyone may write in, as /tmp, and the cache in a
    home other accounts may enter (Debian's default before bookworm)."""
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    tmp, home = base / "tmp", base / "home"
    tmp.mkdir()
    tmp.chmod(0o1777)
    cache = home / ".cache" / "pml-studio"
    cache.mkdir(parents=True)
    for folder in (home, home / ".cache", cache):
        folder.chmod(0o755)
    return cache, tmp, cache / "runs.db", home


def nobody_reads_the_user(tmp: Path, home: Path) -> None:
    """This account finds the marker in the CSV export and the run log; no other account finds it anywhere."""
    folders = [tmp, home, Path("/tmp/gradio")]
    mine = read_as(None, folders)
    assert any(h.endswith(".csv") for h in mine["hits"]) and any("runs.db" in h for h in mine["hits"]), mine
    assert open_to_others([tmp, home]) == []
    if os.geteuid() == 0:
        theirs = read_as(NOBODY, folders)
        assert theirs["hits"] == [], theirs


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_another_account_reads_nothing_and_each_signal_keeps_the_runs_and_leaves_nothing(tmp_path, name):
    """Ctrl-C works though the studio was started with SIGINT ignored (it installs its own handler)."""
    if not hasattr(signal, name):
        pytest.skip(f"no {name} on this platform")
    signum = getattr(signal, name)
    top = Path(tempfile.mkdtemp(prefix="pml-private-test-", dir="/tmp"))  # every folder above searchable
    top.chmod(0o755)
    try:
        cache, tmp, db, home = private_folders(top / "studio")

        def first(port, events):  # the log takes these runs, and the child's waiting one with the first
            use_the_studio(port, events)
            nobody_reads_the_user(tmp, home)

        out, left, took = serve_and_signal(tmp_path, signum, locked=True, work=answer_then_stream, first=first,
                                           sigint=signal.SIG_IGN if name == "SIGINT" else signal.SIG_DFL,
                                           folders=(cache, tmp, db))
        saved = cache / "runs.db.pending.jsonl"
        assert out.returncode == (0 if name == "SIGINT" else 128 + signum), out.stderr[-3000:]  # Ctrl-C: clean
        assert took < 5.0 and left == [] and "Traceback" not in out.stderr, (took, out.stderr[-3000:])
        lines = [line for line in out.stderr.splitlines() if line.startswith("pml-studio: stopped: ")]
        assert len(lines) == 1 and f"2 finished runs the run log could not take saved in {saved}" in lines[0], lines
        assert "locked by another writer" in lines[0] and f"; removed {tmp / 'pml-studio-'}" in lines[0]
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert read_as(None, [tmp])["hits"] == [] and [p for p in tmp.rglob("*") if p.is_file()] == []
        assert not os.path.lexists(tmp / "gradio")  # Gradio's folder was the studio's own, and went with it
        bare_studio(db)  # the next start
        rows = RunLog(db).runs()
        assert [(r["created_at"], r["prompt_text"]) for r in rows][-1] == (FIRST, "the prompt") and not saved.exists()
        assert sorted(str(r["source"]) for r in rows) == ["None", "None", "None", "api", "api"]
    finally:
        shutil.rmtree(top, ignore_errors=True)
