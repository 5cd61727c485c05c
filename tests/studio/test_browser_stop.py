"""Browser: the Compare tab's Stop button, clicked in Debian's chromium while the arms decode, ends the run within a
token on the engine's thread, says so above the columns, logs nothing, and the next Compare runs whole."""

from __future__ import annotations

import os
import time

import pytest

from engine.runlog import RunLog
from studio import live
from tests.studio_fixtures import served_studio, studio_page
from tools.screenshot import CHROMIUM

pytestmark = pytest.mark.browser


def test_stop_in_the_page_ends_the_running_compare_and_the_next_one_runs(tiny_engine, tmp_path, monkeypatch):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")

    shown: list[float] = []  # when each token reached the page's live run
    show = live.LiveRun.show

    def slow(self, arm, text, message):  # the tiny model decodes 3 x 200 tokens in a blink: ~4 tokens a second
        shown.append(time.monotonic())
        time.sleep(0.25)
        show(self, arm, text, message)

    monkeypatch.setattr(live.LiveRun, "show", slow)
    with served_studio(tiny_engine, RunLog(tmp_path / "runs.db")) as (demo, port):
        with studio_page(sync_api, port) as page:
            page.get_by_role("tab", name="4 · Compare").click()
            box = page.locator("#max-new-tokens input[type=number]")
            box.fill("200")
            box.press("Enter")
            page.click("#compare-btn")
            deadline = time.monotonic() + 120
            while len(shown) < 5 and time.monotonic() < deadline:  # the arms are decoding
                time.sleep(0.05)
            assert len(shown) >= 5
            page.click("#compare-stop")
            clicked = time.monotonic()
            page.wait_for_function("document.querySelector('#compare-summary').innerText.includes('Stopped')",
                                   timeout=30_000)
            deadline = time.monotonic() + 30
            while live.RUNS._runs and not next(reversed(live.RUNS._runs.values())).done \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # a run the stop missed would go on showing tokens, 4 a second
            late = [t for t in shown if t > clicked]
            assert len(late) <= 3, f"{len(late)} tokens after Stop"  # the batch step under way, at most
            assert demo.studio.runlog.count() == 0  # a stopped run is not logged
            monkeypatch.setattr(live.LiveRun, "show", show)
            box.fill("8")
            box.press("Enter")
            page.click("#compare-btn")
            page.wait_for_selector("#compare-summary .speedup", timeout=120_000)
        assert demo.studio.runlog.count() == 1
