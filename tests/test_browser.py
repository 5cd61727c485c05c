"""Browser: Debian's chromium (Playwright) loads the studio, picks a sample, encodes, compares, screenshots.

The screenshot is saved to assets/screenshot.png, which the README shows.
"""

from __future__ import annotations

import os
import socket

import pytest

from tests.conftest import ROOT

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SCREENSHOT = ROOT / "assets" / "screenshot.png"
SAMPLE = "doc_qa"

pytestmark = [pytest.mark.browser, pytest.mark.real_model]


@pytest.fixture
def served(real_engine, tmp_path):
    """The studio, styled as `python app.py` serves it, on a free port of 127.0.0.1."""
    from engine.runlog import RunLog
    from studio.app import build_app, launch_options

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = build_app(real_engine, RunLog(tmp_path / "runs.db"))
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, **launch_options())
    yield demo, f"http://127.0.0.1:{port}/"
    demo.close()


def test_pick_encode_compare_and_screenshot(served):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium) — the browser test drives Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
    demo, url = served

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#schema-validation .pml-status.ok", timeout=60_000)

            page.get_by_label("Sample schema").click()
            page.get_by_role("option", name=SAMPLE, exact=True).click()
            page.wait_for_selector(f"#schema-validation .pml-status.ok:has-text('{SAMPLE}')", timeout=30_000)

            page.get_by_role("tab", name="3 · Encode").click()
            page.click("#encode-btn")
            page.wait_for_selector(".pml-cards", timeout=120_000)
            assert "MB" in page.inner_text(".pml-cards")

            page.get_by_role("tab", name="4 · Compare").click()
            box = page.locator("#max-new-tokens input[type=number]")
            box.fill("4")
            box.press("Enter")
            page.click("#compare-btn")
            page.wait_for_selector("#compare-summary .speedup", timeout=120_000)
            page.wait_for_selector("#cached-text .pml-output:not(.active)", timeout=10_000)
            assert "faster first token" in page.inner_text("#compare-summary")
            assert page.inner_text("#baseline-text").strip() and page.inner_text("#cached-text").strip()
            page.mouse.move(0, 0)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()

    assert SCREENSHOT.stat().st_size > 20_000
    assert demo.studio.runlog.count() == 1
