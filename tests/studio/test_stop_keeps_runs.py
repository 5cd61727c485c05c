"""Nothing answered is lost at a stop, and no work holds the engine after it is abandoned (issue 45, items 3 and 5).

With the run log locked by another writer, a Compare and an API request are answered, wait in memory, are saved to
the private recovery file at stop and written at the next start; a cancelled ``/compare`` frees the engine within a
token; a stop string of a million characters and 40,000 content parts are answered without stalling the server.
The signals, in a child process, are tests/studio/test_shutdown.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.run import forward
from engine.arms.compare import Comparison
from engine.runlog import RunLog
from studio import recovery
from studio.arm_views import document
from studio.shutdown import stop
from studio.state import PendingRun, Studio
from studio.tabs import compare as cmp
from tests.studio.test_shutdown import bare_studio, stored
from tests.studio_fixtures import AUTH, served_studio, settings, studio, travel, write_lock_held  # noqa: F401

MODEL = "tiny-llama"


def test_a_waiting_run_of_a_real_compare_round_trips_through_the_private_recovery_file(studio, travel, tmp_path):
    """A real run's document holds EntryName strings, which dataclasses.asdict cannot copy (the crash at every
    stop): its line is plain JSON, read back as the same run, and the run log gets the same rows from both."""
    schema, prompt, _ = travel
    res = studio.engine.compare(schema, prompt, cmp.sampling_of(3), config=studio.run_config(settings()))
    run = PendingRun(document(res), schema, prompt, "2026-01-01T00:00:01+00:00", "api")
    assert any(type(u["unit"]) is not str for u in run.data["encode"]["detail"])  # EntryName: what asdict broke on
    with pytest.raises(TypeError):
        dataclasses.asdict(run)
    where = recovery.save([run], tmp_path / "runs.db")
    assert stat.S_IMODE(where.stat().st_mode) == 0o600  # prompts and answers: the user's alone
    [back] = recovery.read(where)
    assert isinstance(back, PendingRun) and (back.schema_text, back.prompt_text, back.created_at, back.source) == \
        (schema, prompt, run.created_at, "api")
    assert Comparison.from_json(back.data).to_json() == Comparison.from_json(run.data).to_json() == \
        json.loads(json.dumps(res.to_json()))
    one, two = RunLog(tmp_path / "one.db"), RunLog(tmp_path / "two.db")
    for log, r in ((one, run), (two, back)):
        log.record(r.data, r.schema_text, r.prompt_text, created_at=r.created_at, source=r.source)
    strip = lambda row: {k: v for k, v in row.items() if k != "id"}  # noqa: E731
    assert strip(one.runs()[0]) == strip(two.runs()[0]) and one.runs()[0]["source"] == "api"


def test_a_compare_and_an_api_request_the_locked_log_refuses_are_saved_at_stop_and_written_next_start(
        tiny_engine, tmp_path, travel, capsys):
    schema, prompt, _ = travel
    path = tmp_path / "runs.db"
    log = RunLog(path, timeout=0.2)
    with served_studio(tiny_engine, log) as (demo, port), write_lock_held(path):
        page = cmp.compare_json(demo.studio, schema, prompt, 3, settings=settings())  # what a Compare runs
        assert page["logged"]["ok"] is False and "locked by another writer" in page["logged"]["error"]
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=AUTH, timeout=120,
                            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert answer.status_code == 200 and answer.json()["pml"]["run_id"] is None
        assert [r.source for r in demo.studio.pending] == [None, "api"]  # the API's run waits too
        capsys.readouterr()
        stop(demo.studio, None)
    saved = tmp_path / "runs.db.pending.jsonl"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"pml-studio: stopped: 2 finished runs the run log could not take "
                                               f"saved in {saved} (the run log {path} is locked by another writer")
    assert err[0].endswith("): written to the run log at the next start"), err
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600 and stored(path) == []
    bare_studio(path)  # the next start
    rows = [(r["source"], r["prompt_text"]) for r in reversed(RunLog(path).runs())]
    assert rows[0] == (None, prompt) and rows[1][0] == "api" and len(rows) == 2 and not saved.exists()


@pytest.fixture
def slow_steps(monkeypatch):
    """Every decode step counted and slowed to ~0.1 s (the tiny model decodes in a blink)."""
    steps: list[float] = []
    real = forward.step

    def step(*args, **kwargs):
        time.sleep(0.1)
        steps.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "step", step)
    return steps


@contextlib.contextmanager
def compare_decoding(engine, db, travel, slow_steps):
    """(studio, client, job) of a long /compare served over ``engine``, once it has decoded five steps."""
    from gradio_client import Client

    schema, prompt, _ = travel
    with served_studio(engine, RunLog(db)) as (demo, port):
        client = Client(f"http://127.0.0.1:{port}/", headers=AUTH, verbose=False)
        job = client.submit(schema, prompt, 1000, api_name="/compare")
        _wait_for(lambda: len(slow_steps) >= 5, 120)
        yield demo, client, job


def test_a_cancelled_compare_frees_the_engine_within_a_token(tiny_engine, tmp_path, travel, slow_steps):
    schema, prompt, _ = travel
    with compare_decoding(tiny_engine, tmp_path / "runs.db", travel, slow_steps) as (demo, client, job):
        job.cancel()
        cancelled = time.monotonic()
        _wait_for(lambda: time.monotonic() - (slow_steps[-1] if slow_steps else 0) > 0.5, 30)
        late = [t for t in slow_steps if t > cancelled]
        assert len(late) <= 2, f"{len(late)} decode steps after the cancel"
        start = time.monotonic()
        second = client.predict(schema, prompt, 2, api_name="/compare")
        assert second["logged"]["ok"] and time.monotonic() - start < 30
        assert demo.studio.runlog.count() == 1  # the cancelled run is not logged


def test_a_compare_whose_caller_is_gone_frees_the_engine(tiny_engine, tmp_path, travel, slow_steps):
    """The caller's stream closes (its process killed): Gradio marks the event not alive, and the run stops."""
    with compare_decoding(tiny_engine, tmp_path / "runs.db", travel, slow_steps) as (demo, _, job):
        queue = demo._queue
        events = [e for jobs in queue.active_jobs if jobs for e in jobs]
        assert events
        gone = time.monotonic()
        for e in events:
            e.alive = False  # what Gradio does when the caller's stream closes (queue.clean_events)
        _wait_for(lambda: time.monotonic() - slow_steps[-1] > 0.5, 30)
        assert len([t for t in slow_steps if t > gone]) <= 4  # the watch looks every 0.2 s, a step takes 0.1
        job.cancel()


def test_a_million_character_stop_string_and_40000_parts_leave_the_server_answering(served_api, monkeypatch):
    port, engine = served_api
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    models = f"http://127.0.0.1:{port}/v1/models"
    user = [{"role": "user", "content": "Tell me a long story."}]
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        long = pool.submit(httpx.post, url, headers=AUTH, timeout=120,
                           json={"model": MODEL, "messages": user, "max_tokens": 200, "temperature": 0,
                                 "stream": True, "stop": "x" * 1_000_000})
        time.sleep(0.5)
        for _ in range(3):  # the event loop answers while the stream runs
            t = time.monotonic()
            assert httpx.get(models, headers=AUTH, timeout=5).status_code == 200
            assert time.monotonic() - t < 3.0  # a stalled loop waits for the whole stream (seconds); 1 s flaked at load 4
        answer = long.result()
        assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
        assert time.monotonic() - start < 20
    parts = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(40_000)]
    laid_out = []
    monkeypatch.setattr(engine, "layout", lambda *a, **k: laid_out.append(1))
    start = time.monotonic()
    refused = httpx.post(url, headers=AUTH, timeout=60,
                         json={"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    # ~1.3 s of it is pydantic reading 40,000 parts (3 MB of JSON) on a busy 2-core machine; no engine work
    assert refused.status_code == 400 and time.monotonic() - start < 10 and laid_out == []
    error = refused.json()["error"]
    assert error["code"] == "too_many_parts" and error["param"] == "messages" and "40000" in error["message"]


@pytest.fixture
def served_api(tiny_engine, tmp_path):
    with served_studio(tiny_engine, RunLog(tmp_path / "runs.db")) as (_, port):
        yield port, tiny_engine


def test_visible_text_is_found_incrementally_as_the_whole_text_finds_it():
    """The streamed text (usage.Visible) equals usage.visible on every step of random growing texts, a changed
    last character included, and a stop string of a million characters costs milliseconds a run."""
    import random

    from studio.api.usage import Visible, visible

    rng = random.Random(0)
    for trial in range(2000):
        alphabet = "ab\ufffd" if trial % 2 else "abc"
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3)))
        shown, text = Visible(stops), ""
        for _ in range(rng.randint(1, 30)):
            if text and rng.random() < 0.2:
                text = text[: -rng.randint(1, min(3, len(text)))]
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
            assert shown(text) == visible(text, stops), (stops, text)
    shown, text, start = Visible(("a" * 1_000_000, "a" * 50_000 + "b")), "", time.perf_counter()
    for _ in range(2000):
        text += "aaaaa"
        assert shown(text) == ""  # all of it may still become the second stop string
    assert time.perf_counter() - start < 2.0


def test_a_front_shows_growing_text_as_the_whole_text_would_be_shown():
    """The front's text grows one upstream delta at a time (usage.StopCut): until a stop string appears, what it
    has shown is usage.visible of the text so far; the answer ends at the delta that completes one, cut where the
    text so far first holds one (usage.cut), as a generation stops at the first stop string it writes."""
    import random

    from studio.api.usage import StopCut, cut, visible

    rng = random.Random(1)
    for _ in range(3000):
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3)))
        shown, text, out, expected = StopCut(stops), "", "", None
        for _ in range(rng.randint(1, 30)):
            delta = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            text += delta
            out += shown.add(delta)
            kept, found = cut(text, stops)
            if found:
                expected = kept
                break
            assert out == visible(text, stops), (stops, text, out)
        out += shown.flush()
        assert out == (text if expected is None else expected) and shown.stopped == (expected is not None)


def _wait_for(ready, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stop_waits_a_second_at_most_for_a_locked_log_or_a_run_being_logged(tmp_path, monkeypatch, capsys):
    """The log's own wait (30 s by default) is cut to STOP_WAIT_S at stop, and a run being logged on another thread
    (holding the studio's log lock) is not waited for: the waiting runs are saved as they are."""
    from studio.state import STOP_WAIT_S
    from tests.studio.test_shutdown import FIRST, SECOND, record_at

    for held, when in ((False, FIRST), (True, SECOND)):
        path = tmp_path / f"{held}.db"
        studio = bare_studio(path)
        with write_lock_held(path):
            record_at(studio, monkeypatch, when, "a")
            studio.runlog.timeout = 30.0
            if held:
                studio._log_lock.acquire()  # as a Compare's thread does while the locked log makes it wait
            start = time.monotonic()
            stop(studio, None)
            took = time.monotonic() - start
        assert took < 2 * STOP_WAIT_S + 0.5, took
        saved = path.with_name(path.name + ".pending.jsonl")
        assert [r.created_at for r in recovery.read(saved)] == [when]
        assert "saved in" in capsys.readouterr().err
