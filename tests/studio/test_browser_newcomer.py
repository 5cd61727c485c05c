"""Browser: a newcomer's walk in Debian's chromium, one served studio and one page for every check (issue 48).

- Schema tab: a '>' deleted and a module renamed to its sibling's name are reported at the line and column the
  editor shows, and the layout table says it is stale while the schema does not parse.
- Prompt tab: text pasted (clipboard, Ctrl+A Ctrl+V) or set by a script (an autocomplete: value + input event)
  into "New text (not cached)" reaches the PML prompt.
- Compare tab: the arm toggles sit there (not in Encode); turning the prefix arm off removes its column from
  the next Compare. Then a finished run, then a slow one: its start clears the first run's figures, each arm's TTFT shows
  while the arms still decode, and Stop leaves no figure of the earlier run on screen.

The tiny random model keeps it quick; the tokens are slowed on their way to the page (as tests/studio/
test_browser_stop.py does) so that the page can be read mid-run.
"""

from __future__ import annotations

import os
import time

import pytest

from engine.runlog import RunLog
from studio import live
from studio.files import load_sample
from tests.studio_fixtures import served_studio, studio_page
from tools.screenshot import CHROMIUM

pytestmark = pytest.mark.browser
QUESTION = "Which geothermal pools in Reykjavik are open in winter?"


def _set_editor(page, elem_id: str, text: str) -> None:
    """Replace a code editor's text as a user's select-all and paste does (one input of the whole text)."""
    page.click(f"#{elem_id} .cm-content")
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(text)


def _status(page) -> str:
    return page.inner_text("#schema-validation")


def _schema_checks(page, travel: str) -> None:
    lines = travel.split("\n")
    assert lines[3].endswith('"trip-plan">') and 'name="kyoto"' in lines[15]
    no_gt = "\n".join(lines[:3] + [lines[3][:-1]] + lines[4:])
    _set_editor(page, "schema-editor", no_gt)
    page.wait_for_selector("#schema-validation .pml-status.err", timeout=30_000)
    shown = _status(page)
    # line 4, the column just after "trip-plan" (where the '>' goes), not lxml's 5:9 ("mandates value for I")
    assert f"4:{len(lines[3])}:" in shown and "'>' is missing" in shown, shown
    assert "STALE" in page.inner_text("#layout-table"), "the layout of the last valid schema is marked stale"

    dup = "\n".join(lines[:15] + [lines[15].replace('name="kyoto"', 'name="lisbon"')] + lines[16:])
    _set_editor(page, "schema-editor", dup)
    page.wait_for_function("document.querySelector('#schema-validation').innerText.includes('declared twice')",
                           timeout=30_000)
    shown = _status(page)
    col = lines[15].index("kyoto") + 1  # the name the user typed, on line 16
    assert f"16:{col}:" in shown and "first on line 13" in shown, shown

    _set_editor(page, "schema-editor", travel)
    page.wait_for_selector("#schema-validation .pml-status.ok", timeout=30_000)
    assert "STALE" not in page.inner_text("#layout-table")


def _prompt_text(page) -> str:
    return page.inner_text("#prompt-editor .cm-content")


def _prompt_checks(page) -> None:
    page.get_by_role("tab", name="2 · Prompt").click()
    free = page.locator("#builder-free-text textarea")
    free.wait_for(timeout=30_000)
    page.evaluate(f"navigator.clipboard.writeText({QUESTION!r})")
    free.click()
    page.keyboard.press("Control+a")
    page.keyboard.press("Control+v")
    page.locator(".pml-builder .prose").first.click()  # click elsewhere
    page.wait_for_function(f"document.querySelector('#prompt-editor .cm-content').innerText.includes({QUESTION!r})",
                           timeout=20_000)
    assert "Kyoto to Nara" not in _prompt_text(page)

    other = "How many days should we spend in Marrakesh?"
    free.evaluate("(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }", other)
    page.locator(".pml-builder .prose").first.click()
    page.wait_for_function(f"document.querySelector('#prompt-editor .cm-content').innerText.includes({other!r})",
                           timeout=20_000)


def _compare(page, tokens: int) -> None:
    box = page.locator("#max-new-tokens input[type=number]")
    box.fill(str(tokens))
    box.press("Enter")
    page.click("#compare-btn")


def _arm_toggle(page, arm: str):
    from studio.arm_views import view_of

    return page.locator("#arms label").filter(has_text=view_of(arm).title).locator("input")


def _arm_toggle_checks(page, demo) -> None:
    """Issue 48 item 5: the arms are chosen where they run; one turned off has no column in the next Compare."""
    page.get_by_role("tab", name="3 · Encode").click()
    page.wait_for_selector("#encode-btn", timeout=30_000)
    assert not page.locator("#arms").is_visible() and not page.locator("#repair").is_visible()
    page.get_by_role("tab", name="4 · Compare").click()
    page.wait_for_selector("#arms", timeout=30_000)
    assert "prefix" in demo.studio.engine.config.arms and _arm_toggle(page, "prefix").is_checked()
    assert page.locator("#prefix-metrics").is_visible()
    _arm_toggle(page, "prefix").uncheck()
    _compare(page, 4)
    page.wait_for_selector("#compare-summary .speedup", timeout=120_000)
    assert not page.locator("#prefix-metrics").is_visible() and page.locator("#baseline-metrics").is_visible()
    page.screenshot(path=str(OUT / "compare-arm-toggles.png"))
    assert set(demo.studio.runlog.runs()[0]["arms"]) == set(demo.studio.engine.config.arms) - {"prefix"}
    _arm_toggle(page, "prefix").check()


def _compare_checks(page, demo, shown: list) -> dict:
    _arm_toggle_checks(page, demo)
    _compare(page, 4)
    page.wait_for_function("document.querySelector('#prefix-metrics') && "
                           "document.querySelector('#prefix-metrics').innerText.includes('new tokens')",
                           timeout=120_000)
    page.wait_for_selector("#compare-summary .speedup", timeout=120_000)
    first = {"summary": page.inner_text("#compare-summary"), "metrics": page.inner_text("#baseline-metrics")}
    assert "new tokens" in first["metrics"] and page.locator("#compare-tokens .pml-tokens").count() == 1

    live.SLOW = True
    _compare(page, 200)
    deadline = time.monotonic() + 120
    while len(shown) < 6 and time.monotonic() < deadline:  # every arm has its first token; they decode
        time.sleep(0.05)
    arms = demo.studio.engine.config.arms
    page.wait_for_function(
        f"{list(arms)!r}.every(a => document.querySelector('#' + a + '-metrics .pml-first'))",
        timeout=30_000)
    during = {arm: page.inner_text(f"#{arm}-metrics") for arm in arms}
    run = next(reversed(live.RUNS._runs.values()))
    assert not run.done, "the TTFTs were read while the arms decode"
    assert all("decoding" in m and "new tokens" not in m for m in during.values()), during  # not the last run's
    assert page.locator("#compare-tokens .pml-tokens").count() == 0  # the first run's token view went with its figures
    page.screenshot(path=str(OUT / "compare-first-tokens.png"))
    page.click("#compare-stop")
    page.wait_for_function("document.querySelector('#compare-summary').innerText.includes('Stopped')",
                           timeout=30_000)
    time.sleep(1.0)
    after = {arm: page.inner_text(f"#{arm}-metrics") for arm in arms}
    assert all("new tokens" not in m for m in after.values()), after
    assert page.locator("#compare-summary .speedup").count() == 0 and page.locator("#compare-tokens .pml-tokens").count() == 0
    return {"first": first, "during": during}


OUT = None  # the folder the screenshots go to (the test's tmp_path)


def test_a_newcomers_walk(tiny_engine, tmp_path, monkeypatch):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")

    global OUT
    OUT = tmp_path
    shown: list[float] = []
    show = live.LiveRun.show

    def slow(self, arm, text, message):  # once asked: the tiny model's tokens reach the page ~4 a second
        if getattr(live, "SLOW", False):
            shown.append(time.monotonic())
            time.sleep(0.25)
        show(self, arm, text, message)

    monkeypatch.setattr(live.LiveRun, "show", slow)
    monkeypatch.setattr(live, "SLOW", False, raising=False)
    travel, _ = load_sample("travel")
    with served_studio(tiny_engine, RunLog(tmp_path / "runs.db")) as (demo, port):
        with studio_page(sync_api, port, permissions=["clipboard-read", "clipboard-write"]) as page:
            # the page opens on the travel sample (picking it again would reload it while the checks edit it)
            page.wait_for_selector("#schema-validation .pml-status.ok:has-text('travel')", timeout=30_000)
            _schema_checks(page, travel)
            _prompt_checks(page)
            _compare_checks(page, demo, shown)
        assert demo.studio.runlog.count() == 2  # the stopped run is not logged
        assert "Marrakesh" in demo.studio.runlog.runs()[0]["prompt_text"]  # the Compare ran the prompt shown
