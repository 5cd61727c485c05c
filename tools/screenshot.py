"""Drive the studio in Debian's chromium: pick a sample, encode, compare, screenshot the Compare tab.

Shared by tests/studio/test_browser.py (which writes its screenshot to a temporary folder) and by
``make screenshot``, which refreshes the README's ``assets/screenshot.png``:

    python tools/screenshot.py                       # assets/screenshot.png
    python tools/screenshot.py --out /tmp/shot.png --sample travel --max-new-tokens 16

It prints each shown arm's answer and fails when an arm shows none.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
README_SCREENSHOT = ROOT / "assets" / "screenshot.png"
SAMPLE = "doc_qa"
VIEWPORT = {"width": 1400, "height": 1000}
README_TOKENS = 32  # the README's picture shows whole answers; the browser test keeps 4 to stay quick


def free_port() -> int:
    """A loopback port nobody listens on (for a studio served by a test, a benchmark or this script)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def compare_and_screenshot(url: str, out: str | Path, sample: str = SAMPLE, max_new_tokens: int = 4) -> dict:
    """Load ``url``, pick ``sample``, encode it, compare, and save a full-page screenshot of the Compare tab.

    Returns what the page showed (summary and the arms' texts) for the caller to check.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(url)
            page.wait_for_selector("#schema-validation .pml-status.ok", timeout=60_000)

            page.get_by_label("Sample schema").click()
            page.get_by_role("option", name=sample, exact=True).click()
            page.wait_for_selector(f"#schema-validation .pml-status.ok:has-text('{sample}')", timeout=30_000)

            page.get_by_role("tab", name="2 · Prompt").click()  # the builder, generated from the schema
            page.wait_for_selector(".pml-module", timeout=30_000)
            builder_modules = page.locator(".pml-module").count()

            page.get_by_role("tab", name="3 · Encode").click()
            page.click("#encode-btn")
            page.wait_for_selector(".pml-cards", timeout=120_000)
            encode_cards = page.inner_text(".pml-cards")

            page.get_by_role("tab", name="4 · Compare").click()
            box = page.locator("#max-new-tokens input[type=number]")
            box.fill(str(max_new_tokens))
            box.press("Enter")
            page.click("#compare-btn")
            page.wait_for_selector("#compare-summary .speedup", timeout=120_000)
            page.wait_for_selector("#cached-text .pml-output:not(.active)", timeout=10_000)
            shown = {"builder_modules": builder_modules, "encode": encode_cards, "summary": page.inner_text("#compare-summary"),
                     # the answer alone, not the divergence key drawn below it when the arms differ
                     "baseline": page.inner_text("#baseline-text .pml-output"),
                     "cached": page.inner_text("#cached-text .pml-output"),
                     "prefix_visible": page.locator("#prefix-text").is_visible(),
                     "texts": {el.get_attribute("id").removesuffix("-text"): el.inner_text()
                               for el in page.locator(".pml-col [id$='-text']").all() if el.is_visible()}}
            page.mouse.move(0, 0)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    return shown


def serve_and_screenshot(out: str | Path, sample: str = SAMPLE, max_new_tokens: int = README_TOKENS) -> dict:
    """The studio on the default model, served as `python app.py` serves it, then the run above."""
    sys.path.insert(0, str(ROOT))
    from engine.runlog import RunLog
    from engine.session import Engine
    from studio.app import build_app, launch_options
    from studio.guard import make_token, page_url

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pml-screenshot-") as tmp:
        engine = Engine(persist=False)
        engine.lm
        demo = build_app(engine, RunLog(Path(tmp) / "runs.db"))
        token = make_token()
        demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                    **launch_options(demo, token=token))
        try:
            shown = compare_and_screenshot(page_url("127.0.0.1", port, token), out, sample, max_new_tokens)
            return shown | {"default_arms": engine.config.arms}
        finally:
            demo.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(README_SCREENSHOT))
    ap.add_argument("--sample", default=SAMPLE)
    ap.add_argument("--max-new-tokens", type=int, default=README_TOKENS)
    args = ap.parse_args()
    if not Path(CHROMIUM).exists():
        print(f"screenshot: error: {CHROMIUM} is missing (apt-get install chromium)", file=sys.stderr)
        return 2
    shown = serve_and_screenshot(args.out, args.sample, args.max_new_tokens)
    print(f"wrote {args.out}: {shown['summary'].splitlines()[0] if shown['summary'] else ''}")
    for arm, text in shown["texts"].items():
        print(f"  {arm}: {' '.join(text.split())}")
    empty = [arm for arm in shown["default_arms"] if not shown["texts"].get(arm, "").replace("∅", "").strip()]
    if empty:
        print(f"screenshot: error: no answer shown for {', '.join(empty)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
