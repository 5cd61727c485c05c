"""Fixtures and helpers shared by the studio's per-tab handler tests (tests/test_studio_*.py)."""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager

import pytest

from engine.arms.compare import Comparison
from engine.runlog import RunLog
from studio import files
from studio.state import Studio
from studio.tabs import schema as sch

TRAVEL_PROMPT = """<prompt schema="travel">
  <trip-plan duration="5 days"><overseas><kyoto/></overseas></trip-plan>
  Question: how long is the train ride from Kyoto to Nara, and what is Nara known for? Answer in one sentence.
</prompt>
"""
CPU = {"storage": "cpu", "mode": "prefixed"}
TOKEN = "tests-launch-token-0123456789"  # the launch token of a studio served by served_studio
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # what a program sends with each request (gradio_client: headers=AUTH)


@pytest.fixture
def studio(tiny_engine, tmp_path):
    return Studio(tiny_engine, RunLog(tmp_path / "runs.db"))


@pytest.fixture
def travel(studio):
    schema, prompt = files.load_sample("travel")
    return schema, prompt, sch.validate(studio, schema).spec


@contextmanager
def served_studio(engine, runlog: RunLog, token: str | None = TOKEN, api: dict | None = None, connections=None):
    """The studio around ``engine`` served as `make run` serves it (guard, page script, live route, the API with
    the options ``api``, deadlines for slow clients under ``connections``: launch_options) on a free port of
    127.0.0.1 with the launch ``token`` (:data:`AUTH` carries it); yields (demo, port) and closes it after."""
    from studio.app import build_app, launch_options
    from tools.screenshot import free_port

    demo = build_app(engine, runlog)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                **launch_options(demo, token=token, api=api, connections=connections))
    try:
        yield demo, port
    finally:
        demo.close()


@contextmanager
def served_api(engine, runlog: RunLog | None, **options):
    """What `pml-studio api` serves (studio/api/serve.py's headless app under uvicorn, the API's ``options``, e.g.
    ``upstream``) on a free port of 127.0.0.1 with the launch token; yields the port and stops it after."""
    import threading
    import time

    import uvicorn

    from studio.api.serve import headless_app, server_config
    from tools.screenshot import free_port

    port = free_port()
    server = uvicorn.Server(server_config(headless_app(engine, runlog, TOKEN, **options), "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 60
        while not server.started:  # a readiness wait, not a timing assertion
            assert time.monotonic() < end and thread.is_alive(), "the API server did not start"
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def write_lock_held(path):
    """Another program holding the run log's write lock (a write transaction left open)."""
    other = sqlite3.connect(path)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        other.rollback()
        other.close()


def settings(**kw) -> dict:
    return {**CPU, **kw}


def doc(data: dict) -> Comparison:
    """A comparison read back from a (partial) run --json document, as the History tab reads the run log."""
    return Comparison.from_json(data)


@contextmanager
def studio_page(sync_api, port: int, wait_s: float = 120, init_script: str | None = None, **context):
    """A chromium page on the studio at ``port``, opened at the URL the console prints (the token in the fragment),
    once the schema editor has validated (within ``wait_s``); ``init_script`` runs before the page's own;
    ``context``: Playwright's browser-context options besides the viewport."""
    from studio.guard import page_url
    from tools.screenshot import CHROMIUM, CHROMIUM_ARGS, VIEWPORT

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport=VIEWPORT, **context)
            if init_script is not None:
                ctx.add_init_script(init_script)
            page = ctx.new_page()
            page.goto(page_url("127.0.0.1", port, TOKEN))
            page.wait_for_selector("#schema-validation .pml-status.ok", timeout=wait_s * 1000)
            yield page
        finally:
            browser.close()
