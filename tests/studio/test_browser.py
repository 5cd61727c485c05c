"""Browser: Debian's chromium (Playwright) loads the studio, picks a sample, encodes, compares, screenshots.

The screenshot goes to a temporary folder; ``make screenshot`` (tools/screenshot.py, the same
steps) refreshes the README's assets/screenshot.png.
"""

from __future__ import annotations

import os

import pytest

from studio.guard import page_url
from tests.studio_fixtures import TOKEN, served_studio
from tools.screenshot import CHROMIUM, README_SCREENSHOT, compare_and_screenshot

pytestmark = [pytest.mark.browser, pytest.mark.real_model]


@pytest.fixture
def served(real_engine, tmp_path):
    """The studio, styled as `python app.py` serves it, on a free port of 127.0.0.1."""
    from engine.runlog import RunLog

    with served_studio(real_engine, RunLog(tmp_path / "runs.db")) as (demo, port):
        yield demo, page_url("127.0.0.1", port, TOKEN)  # the URL the console prints


def test_pick_encode_compare_and_screenshot(served, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium) — the browser test drives Debian's chromium")
    pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
    demo, url = served
    readme_shot = README_SCREENSHOT.stat().st_mtime_ns if README_SCREENSHOT.exists() else None
    out = tmp_path / "screenshot.png"

    shown = compare_and_screenshot(url, out)

    assert shown["builder_modules"] >= 1  # the builder is drawn from the validated schema
    assert "MB" in shown["encode"]
    assert "faster first token" in shown["summary"]
    assert shown["baseline"].strip() and shown["cached"].strip()
    assert not shown["prefix_visible"] or "prefix" in demo.studio.engine.config.arms
    assert out.stat().st_size > 20_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = demo.studio.runlog.runs()
    assert len(rows) == 1 and rows[0]["schema_name"] == "doc_qa"
    assert rows[0]["arms"]["baseline"]["text"].strip() == shown["baseline"].replace("∅", "").strip()  # the page shows the run
    assert (README_SCREENSHOT.stat().st_mtime_ns if README_SCREENSHOT.exists() else None) == readme_shot


def test_a_compare_streams_its_texts_through_the_live_route(served):
    """While a Compare runs, the page shows each arm's text growing, fetched from studio/live.py (not through
    Gradio's stream), and the final update replaces it with the run's texts."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
    import time

    from studio import live
    from tools.screenshot import CHROMIUM_ARGS, VIEWPORT

    demo, url = served
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(url)
            page.wait_for_selector("#schema-validation .pml-status.ok", timeout=120_000)
            page.get_by_role("tab", name="4 · Compare").click()
            box = page.locator("#max-new-tokens input[type=number]")
            box.fill("48")
            box.press("Enter")
            page.click("#compare-btn")
            page.wait_for_selector(".pml-live", state="attached", timeout=120_000)
            shown, t = [], time.monotonic()
            while page.locator(".pml-live").count() and time.monotonic() - t < 300:
                shown.append(page.locator("#cached-text .pml-output").inner_text())
                time.sleep(0.05)
            page.wait_for_selector("#compare-summary .speedup", timeout=60_000)
            final = page.locator("#cached-text .pml-output").inner_text()
        finally:
            browser.close()
    run = demo.studio.runlog.runs()[0]
    assert run["arms"]["cached"]["text"].strip() == final.replace("∅", "").strip()
    growing = [s for s in shown if s.strip() and s.strip() != final.strip()]
    assert growing and all(final.strip().startswith(s.strip()) for s in growing), (growing[:3], final)
    newest = next(reversed(live.RUNS._runs.values()))
    assert newest.done and newest.polled > float("-inf")  # the page fetched it
