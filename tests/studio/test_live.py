"""A running Compare's texts read by the page (studio/live.py) instead of streamed through Gradio: the route's stream,
the guard in front of it, and compare_stream sending no per-token Gradio update while a page reads."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from studio import live
from studio.tabs import compare as cmp
from engine.runlog import RunLog
from tests.studio_fixtures import AUTH, served_studio, settings, studio, travel  # noqa: F401 (fixtures)


@pytest.fixture
def served(tiny_engine, tmp_path):
    with served_studio(tiny_engine, RunLog(tmp_path / "runs.db")) as (_, port):
        yield port


def test_a_run_streams_by_its_id_and_only_on_the_studios_own_host(served, monkeypatch):
    # an arm counts as active for ACTIVE_S after its last token: a loaded machine may answer later than that
    monkeypatch.setattr(live, "ACTIVE_S", 60.0)
    run = live.RUNS.open(("baseline", "cached"))
    run.show("cached", "Nara is", "cached: decoding…")
    with httpx.Client(base_url=f"http://127.0.0.1:{served}", timeout=10, headers=AUTH) as client:
        with client.stream("GET", f"/pml-live/{run.id}") as got:
            assert got.status_code == 200 and got.headers["cache-control"] == "no-store"
            assert got.headers["content-type"] == "application/x-ndjson"
            assert "access-control-allow-origin" not in got.headers  # another site's page cannot read it
            lines = got.iter_lines()
            assert json.loads(next(lines)) == {"texts": {"baseline": "", "cached": "Nara is"}, "active": ["cached"],
                                               "message": "cached: decoding…", "done": False}
            assert run.watched and run.streams == 1
            run.show("cached", "Nara is known", "cached: decoding…")  # the next line, within a period
            assert json.loads(next(lines))["texts"]["cached"] == "Nara is known"
            run.finish()
            last = json.loads(next(lines))
            assert last["done"] is True and last["active"] == [] and last["texts"]["cached"] == "Nara is known"
            assert list(lines) == []  # the line that says done ends the response
        # the server counts the stream closed after its last byte is sent: on a loaded machine, a moment after the
        # client has read it
        deadline = time.monotonic() + 10
        while run.streams and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.streams == 0
        missing = client.get("/pml-live/not-a-run")
        assert missing.status_code == 404 and missing.json()["done"] is True
        # a rebinding page (its own name for 127.0.0.1) is refused before the route sees it
        foreign = client.get(f"/pml-live/{run.id}", headers={"host": "attacker.example"})
        assert foreign.status_code == 403 and "Nara" not in foreign.text
        assert [json.loads(line)["done"] for line in client.get(f"/pml-live/{run.id}").text.splitlines()] == [True]


def test_a_stream_sends_a_line_only_when_the_run_moved_and_ends_when_the_page_goes(served):
    run = live.RUNS.open(("cached",))
    with httpx.Client(base_url=f"http://127.0.0.1:{served}", timeout=10, headers=AUTH) as client:
        with client.stream("GET", f"/pml-live/{run.id}") as got:
            lines = got.iter_lines()
            next(lines)
            t = time.monotonic()
            time.sleep(3 * live.EVERY_S)  # nothing changed: nothing sent
            run.show("cached", "Nara", "cached: decoding…")
            assert json.loads(next(lines))["texts"]["cached"] == "Nara" and time.monotonic() - t >= 3 * live.EVERY_S
        deadline = time.monotonic() + 5
        while run.streams and time.monotonic() < deadline:  # the page went: the stream stops with it
            time.sleep(0.05)
        assert run.streams == 0 and not run.done


def test_ids_are_unguessable_and_old_runs_are_dropped():
    runs = live.LiveRuns()
    opened = [runs.open(("cached",)) for _ in range(live.KEEP + 3)]
    assert len({r.id for r in opened}) == len(opened) and all(len(r.id) >= 22 for r in opened)  # 128 bits
    assert runs.get(opened[0].id) is None and runs.get(opened[-1].id) is opened[-1]


def test_while_a_page_fetches_the_texts_gradio_streams_none_of_them(studio, travel, monkeypatch):
    """A poller standing in for the page: only the start, the encoding progress and the end go through Gradio, and
    what the poller saw was each arm's final text growing."""
    schema, prompt, _ = travel
    monkeypatch.setattr(cmp, "UPDATE_EVERY", 0.02)  # without the poller this streams many updates (see below)
    seen, stop = [], threading.Event()

    def page(run):
        while not stop.is_set():
            reply = run.reply()
            seen.append(reply)
            if reply["done"]:
                return
            time.sleep(0.005)

    updates, poller = [], None
    for upd in cmp.compare_stream(studio, schema, prompt, 12, settings=settings()):
        updates.append(upd)
        if poller is None:
            assert upd.live is not None and upd.live.id in upd.live.marker()
            seen.append(upd.live.reply())  # watched from the start, as the page is within a poll period
            poller = threading.Thread(target=page, args=(upd.live,))
            poller.start()
    stop.set()
    poller.join(10)
    assert {u.phase for u in updates} <= {"encoding", "first", "done"}, [u.phase for u in updates]
    firsts = [u for u in updates if u.phase == "first"]  # each arm's TTFT, once, as its first token exists
    assert [len(u.firsts) for u in firsts] == list(range(1, len(updates[-1].arms) + 1))
    final = updates[-1].result
    grown = [r["texts"]["cached"] for r in seen if r["texts"]["cached"]]
    assert grown and all(final["cached"]["text"].startswith(t) for t in grown)
    assert updates[-1].live.done


def test_with_nobody_fetching_gradio_streams_the_texts(studio, travel, monkeypatch):
    schema, prompt, _ = travel
    monkeypatch.setattr(cmp, "UPDATE_EVERY", 0.02)
    updates = list(cmp.compare_stream(studio, schema, prompt, 12, settings=settings()))
    assert any(u.phase in ("baseline", "prefix", "cached") for u in updates)
    assert not updates[-1].live.watched and updates[-1].live.done


def test_an_arm_is_active_for_a_moment_after_its_last_token(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(live.time, "monotonic", lambda: clock[0])
    run = live.LiveRun(("baseline", "cached"))
    run.show("cached", "Nara", "cached: decoding…")
    clock[0] += live.ACTIVE_S / 2
    assert run.reply()["active"] == ["cached"]
    clock[0] += live.ACTIVE_S
    assert run.reply()["active"] == []
    run.show("baseline", "Nara is", "baseline: decoding…")
    assert run.reply()["active"] == ["baseline"]
    run.finish()
    assert run.reply()["active"] == []
