"""Nothing lost or left behind when the studio stops (issue 37, items 3 and 4).

Runs the run log could not take are written at stop, or saved to the recovery file and written at the next start;
the temporary download folder (it holds the CSV export of the whole run log) is removed on SIGTERM and SIGHUP as
on Ctrl-C. The signal tests serve the studio in a child process the way `make run` does (studio.launch.serve);
each signal's stop during a stream is tested in test_private_files.py, on a studio another account also searches.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from engine.runlog import RunLog
from tests.conftest import ROOT, free_port
from tests.engine.test_runlog import fake_comparison
from tests.studio_fixtures import AUTH, TOKEN, write_lock_held

FIRST, SECOND = "2026-01-01T00:00:01+00:00", "2026-01-01T00:00:02+00:00"


def bare_studio(path, timeout: float = 0.2):
    """A studio on the run log at ``path`` whose engine is never used (its runs are written as given)."""
    from studio.state import Studio

    engine = SimpleNamespace(loaded=False, config=SimpleNamespace(model="tiny"))
    return Studio(engine, RunLog(path, timeout=timeout))


def stored(path) -> list[tuple]:
    """(created_at, schema_text, prompt_text, baseline text) of every run in id order, read with plain sqlite3."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("select r.created_at, r.schema_text, r.prompt_text, a.text from runs r join arm_runs a "
                            "on a.run_id = r.id and a.arm = 'baseline' order by r.id").fetchall()
    finally:
        conn.close()


def record_at(studio, monkeypatch, created_at: str, name: str) -> dict:
    from studio import state

    monkeypatch.setattr(state, "utc_now", lambda: created_at)  # the time the run finished
    data = fake_comparison(name)
    data["baseline"]["text"] = f"answer of {name}"
    return studio.record(data, f"<schema name='{name}'/>", f"prompt of {name}")


def test_runs_waiting_at_stop_are_saved_and_written_by_the_next_start(tmp_path, monkeypatch, capsys):
    from studio.shutdown import stop

    path = tmp_path / "runs.db"
    studio = bare_studio(path)
    downloads = tmp_path / "pml-studio-downloads"
    (downloads / "sub").mkdir(parents=True)
    (downloads / "pml-runs.csv").write_text("id\n")
    with write_lock_held(path):
        assert record_at(studio, monkeypatch, FIRST, "a")["pending"] == 1
        assert record_at(studio, monkeypatch, SECOND, "b")["pending"] == 2
        capsys.readouterr()
        stop(studio, downloads)  # what a stop runs: the log is still locked
    saved = tmp_path / "runs.db.pending.jsonl"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"2 finished runs the run log could not take saved in {saved}" in err[0], err
    assert "locked by another writer" in err[0] and "next start" in err[0]
    assert not downloads.exists() and stored(path) == [] and not studio.pending
    assert [json.loads(line)["created_at"] for line in saved.read_text().splitlines()] == [FIRST, SECOND]

    fresh = bare_studio(path)  # the next start
    err = capsys.readouterr().err.splitlines()
    assert err == [f"PML Studio: 2 finished runs saved at the last stop written to the run log {path}"]
    assert stored(path) == [(FIRST, "<schema name='a'/>", "prompt of a", "answer of a"),
                            (SECOND, "<schema name='b'/>", "prompt of b", "answer of b")]
    assert not saved.exists() and not fresh.pending and fresh.log_problem() is None
    bare_studio(path)  # a third start finds nothing to write again
    assert len(stored(path)) == 2 and capsys.readouterr().err == ""


def test_a_stop_writes_the_waiting_runs_when_the_log_takes_them_again(tmp_path, monkeypatch, capsys):
    from studio.shutdown import stop

    path = tmp_path / "runs.db"
    studio = bare_studio(path)
    with write_lock_held(path):
        record_at(studio, monkeypatch, FIRST, "a")
    capsys.readouterr()
    stop(studio, None)
    assert capsys.readouterr().err.splitlines() == [
        f"pml-studio: stopped: 1 finished run waiting in memory written to the run log {path}"]
    assert [r[0] for r in stored(path)] == [FIRST]
    assert not (tmp_path / "runs.db.pending.jsonl").exists()


def test_runs_go_to_the_cache_folder_when_the_log_folder_cannot_take_the_file(tmp_path, monkeypatch, capsys):
    from studio.shutdown import stop

    cache = tmp_path / "cache"
    monkeypatch.setenv("PML_STUDIO_CACHE", str(cache))
    path = tmp_path / "logs" / "runs.db"
    path.parent.mkdir()
    studio = bare_studio(path)
    (path.parent / "runs.db.pending.jsonl").mkdir()  # nothing can be written under that name (root writes anyway)
    with write_lock_held(path):
        record_at(studio, monkeypatch, FIRST, "a")
        stop(studio, None)
    saved = list(cache.glob("runs.db.*.pending.jsonl"))
    assert len(saved) == 1 and f"saved in {saved[0]}" in capsys.readouterr().err
    assert list(path.parent.glob("*.tmp")) == [] and list(cache.glob("*.tmp")) == []  # no half-written file left

    other = tmp_path / "elsewhere" / "runs.db"  # another run log of the same name: not its runs
    other.parent.mkdir()
    bare_studio(other)
    assert stored(other) == [] and saved[0].exists()
    bare_studio(path)
    assert [r[0] for r in stored(path)] == [FIRST] and not saved[0].exists()


def test_saved_runs_the_log_refuses_at_start_wait_in_memory_and_in_their_file(tmp_path, monkeypatch, capsys):
    from studio.shutdown import stop

    path = tmp_path / "runs.db"
    saved = tmp_path / "runs.db.pending.jsonl"
    first = bare_studio(path)
    with write_lock_held(path):
        record_at(first, monkeypatch, FIRST, "a")
        stop(first, None)
        capsys.readouterr()
        second = bare_studio(path)  # starts while the log is still locked
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "0 of 1 finished run saved at the last stop written" in err[0], err
        assert len(second.pending) == 1 and saved.exists()
    logged = record_at(second, monkeypatch, SECOND, "b")  # the next run writes it first, then its file goes
    assert logged["ok"] and logged["flushed"] == 1
    assert [r[0] for r in stored(path)] == [FIRST, SECOND] and not saved.exists()
    bare_studio(path)
    assert len(stored(path)) == 2  # not written twice


@pytest.mark.parametrize("content", ['{"created_at": "2026-01-01T00:00:01+00:00"', '{"created_at": 1}\n',
                                     b"\xff\xfe not text", '{"created_at": "x", "schema_text": "s", '
                                     '"prompt_text": "p", "data": {"model": "tiny"}}\n'])
def test_a_damaged_recovery_file_is_set_aside_with_one_warning(tmp_path, capsys, content):
    path = tmp_path / "runs.db"
    saved = tmp_path / "runs.db.pending.jsonl"
    if isinstance(content, bytes):
        saved.write_bytes(content)
    else:
        saved.write_text(content)
    studio = bare_studio(path)
    err = capsys.readouterr().err.splitlines()
    aside = tmp_path / "runs.db.pending.jsonl.corrupt"
    assert len(err) == 1 and err[0].startswith("pml-studio: warning: saved runs not recovered: ") and \
        f"{saved}" in err[0] and f"moved to {aside}" in err[0], err
    assert "Traceback" not in err[0] and aside.exists() and not saved.exists()
    assert stored(path) == [] and not studio.pending


# -- signals: a served studio in a child process ----------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, pathlib, sys, time
    import gradio as gr
    from studio import app, launch
    from studio.state import PendingRun

    wait = gr.Blocks.block_thread
    def block_thread(self):  # serving, and waiting for Ctrl-C: the parent may signal now
        pathlib.Path(sys.argv[5]).touch()
        return wait(self)
    gr.Blocks.block_thread = block_thread
    build = app.build_app
    def build_app(*args, **kwargs):  # a finished run the run log could not take, waiting as a Compare leaves it
        demo = build(*args, **kwargs)
        demo.studio.pending.append(PendingRun(json.loads(sys.argv[3]), "<schema/>", "the prompt", sys.argv[4]))
        demo.studio.runlog.timeout = 0.5  # a locked log refuses within half a second, not the default 30
        # the page's load events by name, for a test that runs them as the page does
        names = {getattr(getattr(fn.fn, "func", fn.fn), "__name__", ""): fn._id for fn in demo.fns.values()}
        pathlib.Path(sys.argv[6]).write_text(json.dumps({k: names[k] for k in ("_validate_ui", "_refresh_ui")}))
        return demo
    app.build_app = build_app
    from engine import session
    from engine.run import decode
    from engine.model import SMALL_MODEL
    from engine.model.load import load_tokenizer
    from tests.conftest import make_tiny_llama
    engine_class = session.Engine  # the tiny random model (tiny-llama): the child serves in seconds
    session.Engine = lambda **_: engine_class.from_loaded(make_tiny_llama(load_tokenizer(SMALL_MODEL)[1]))
    def ended(lm, tokens, sampling):  # runs decode their max new tokens, a long one ~50 a second: a stream
        if sampling.max_new_tokens > 100:  # still decodes when the signal comes
            time.sleep(0.02)
        return len(tokens) >= sampling.max_new_tokens
    decode.ended = ended
    sys.exit(launch.serve(launch.StudioOptions(port=int(sys.argv[1]), db=sys.argv[2], preload=False)))
""")


def serve_and_signal(tmp_path, signum: int, locked: bool, work=None, sigint=signal.SIG_DFL, folders=None,
                     first=None) -> tuple[subprocess.CompletedProcess, list, float]:
    """Serve the studio in a child (its temp folder under tmp_path), run ``work(port)`` once it answers (the log
    locked when ``locked``), send ``signum``; (the child's outcome, the ``pml-studio-*`` folders it made that are
    still there, seconds from the signal to its end). The child starts with SIGINT as ``sigint``: a background
    shell's children inherit it ignored, and the suite may run from one (pytest would wait for ever); SIGHUP as
    the default (``nohup`` ignores it). ``folders``: (cache, TMPDIR, run log) made by the caller instead of under
    tmp_path; ``first(port, events)``: run before the log is locked, with the page's load events by name."""
    from engine.devices import cache_root

    if folders is None:
        folders = (tmp_path / "cache", tmp_path / "tmp", tmp_path / "runs.db")
        for folder in folders[:2]:
            folder.mkdir()
    cache, tmp, db = folders
    (cache / "models").symlink_to(cache_root() / "models")  # the converted default model, not a new copy
    port = free_port()
    RunLog(db)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADIO_", "HF_HUB", "DO_NOT_TRACK"))}
    env.update(PML_STUDIO_CACHE=str(cache), TMPDIR=str(tmp), PYTHONPATH=str(ROOT), PML_STUDIO_TOKEN=TOKEN)
    serving, events = tmp_path / "serving", tmp_path / "events.json"
    args = [sys.executable, "-c", CHILD, str(port), str(db), json.dumps(fake_comparison("kept")), FIRST, str(serving),
            str(events)]
    child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: _signals_of_a_terminal(sigint))
    try:
        wait_until_serving(child, serving)
        assert list(tmp.glob("pml-studio-*")), "the studio made its download folder"
        if first is not None:
            first(port, json.loads(events.read_text()))
        with write_lock_held(db) if locked else nullcontext():
            if work is not None:
                work(port)
            child.send_signal(signum)
            sent = time.monotonic()
            out, err = child.communicate(timeout=120)
            took = time.monotonic() - sent
    except AssertionError as err:
        child.kill()
        raise AssertionError(f"{str(err)[-2000:]}\nthe studio's console: {child.communicate()[1][-3000:]}") from None
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return subprocess.CompletedProcess(args, child.returncode, out, err), list(tmp.glob("pml-studio-*")), took


def _signals_of_a_terminal(sigint) -> None:
    """In the child before it runs: SIGHUP as a terminal's child has it (``nohup`` ignores it, and a studio keeps
    an ignored SIGHUP ignored), SIGINT as ``sigint``."""
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, sigint)


def wait_until_serving(child: subprocess.Popen, flag, limit_s: float = 180.0) -> None:
    """Return once the child has made ``flag`` (it serves); fail with its stderr if it exits first or never does."""
    deadline = time.monotonic() + limit_s
    while not flag.exists():
        if child.poll() is not None:
            pytest.fail(f"the studio exited ({child.returncode}) before serving: {child.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the studio did not serve within {limit_s:g} s")
        time.sleep(0.1)


def answer_then_stream(port: int, waiting: int = 0) -> None:
    """What a user does before the stop: a Compare and an API request answered (the locked log refuses both, with
    ``waiting`` runs already waiting), and an API stream still decoding when the signal comes."""
    import httpx
    from gradio_client import Client

    from studio import files

    base = f"http://127.0.0.1:{port}"
    schema, prompt = files.load_sample("travel")
    compared = Client(base + "/", headers=AUTH, verbose=False).predict(schema, prompt, 2, api_name="/compare")
    assert compared["logged"]["ok"] is False and compared["logged"]["pending"] == waiting + 1
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answered = httpx.post(base + "/v1/chat/completions", json=chat, headers=AUTH, timeout=120)
    assert answered.status_code == 200 and answered.json()["pml"]["run_id"] is None, answered.text
    streaming = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", base + "/v1/chat/completions", headers=AUTH, timeout=120,
                              json={**chat, "max_tokens": 1500, "stream": True, "temperature": 0}) as r:
                for _ in r.iter_lines():
                    streaming.set()
        except httpx.HTTPError:  # the studio ended under it
            pass

    threading.Thread(target=stream, daemon=True).start()
    assert streaming.wait(120), "the stream did not start"
    time.sleep(0.3)  # tokens flowing


def test_sighup_after_the_log_takes_runs_again_writes_the_waiting_run(tmp_path):
    """Also: ``$TMPDIR/gradio``, a link another account made to a folder of its own, is never followed."""
    cache, tmp, theirs = tmp_path / "cache", tmp_path / "tmp", tmp_path / "theirs"
    for folder in (cache, tmp, theirs):
        folder.mkdir()
    (tmp / "gradio").symlink_to(theirs)
    if os.geteuid() == 0:
        theirs.chmod(0o777)
        os.chown(theirs, 65534, 65534)
        os.lchown(tmp / "gradio", 65534, 65534)
    out, left, took = serve_and_signal(tmp_path, signal.SIGHUP, locked=False, folders=(cache, tmp, tmp_path / "runs.db"))
    assert list(theirs.iterdir()) == [], "the studio wrote into another account's folder"
    assert out.returncode == 128 + signal.SIGHUP, out.stderr[-3000:]
    assert left == [] and "Traceback" not in out.stderr
    assert "pml-studio: stopped: 1 finished run waiting in memory written to the run log" in out.stderr
    assert [(r[0], r[2]) for r in stored(tmp_path / "runs.db")] == [(FIRST, "the prompt")]
    assert not (tmp_path / "runs.db.pending.jsonl").exists()


KILLED = "import os, signal\nfrom studio.hosting import private_temp\nprivate_temp()\nos.kill(os.getpid(), signal.SIGKILL)\n"


def test_the_next_start_removes_the_temporary_folder_of_a_killed_studio_and_only_that(tmp_path, monkeypatch):
    """`kill -9` gives a studio no chance to remove its 0700 folder; the next start removes it, and never the folder
    of a studio still running, another account's, or one named otherwise."""
    import tempfile

    from studio.hosting import private_temp

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", KILLED], cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    (killed,) = tmp_path.glob("pml-studio-*")
    gone = killed.name.split("-")[2]  # the killed studio's pid
    running = tmp_path / f"pml-studio-{os.getpid()}-abcd_123"
    foreign = tmp_path / f"pml-studio-{gone}-foreign1"
    other = tmp_path / f"pml-studio-{gone}-not-a-studio"
    for folder in (running, foreign, other):
        folder.mkdir()
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("GRADIO_TEMP_DIR", os.environ.get("GRADIO_TEMP_DIR", ""))  # private_temp sets it
    made = private_temp()
    assert not killed.exists() and made.exists() and made.name.startswith(f"pml-studio-{os.getpid()}-")
    assert running.exists() and other.exists() and foreign.exists() == (os.geteuid() == 0)
