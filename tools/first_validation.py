"""How long the studio's first schema validation takes after the page loads (issue 13, item 4).

Starts ``python app.py`` from ``--root`` (default: this checkout) on a free port, waits until the
server answers, opens the page in Debian's chromium and times, from the page's ``load`` event,
until the validation status and the prompt builder are shown. ``validation_s`` splits into
``page_boot_s`` (until the page sends its first event: Gradio's front end, not the studio) and
``server_s`` (from that event until the validation is shown). Each trial is a fresh server, so
every trial measures a *first* validation. Prints one JSON document last.

    python tools/first_validation.py --trials 3
    python tools/first_validation.py --root /tmp/old-checkout     # the same measurement on another tree
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.screenshot import CHROMIUM, CHROMIUM_ARGS, free_port  # noqa: E402

TOKEN = "first-validation-token-0123456789"  # the launch token the studio is given

ROOT = Path(__file__).resolve().parent.parent


def wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the studio exited with code {proc.returncode}")
        try:
            page = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(page, timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the studio did not answer on {url} within {timeout} s")


def one_trial(root: Path, python: str) -> dict:
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory(prefix="pml-first-validation-") as tmp:
        env = dict(os.environ, PML_STUDIO_MODULES=str(Path(tmp) / "modules"), PML_STUDIO_TOKEN=TOKEN)
        proc = subprocess.Popen([python, "app.py", "--port", str(port), "--db", str(Path(tmp) / "runs.db")],
                                cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            startup_s = wait_until_up(url, proc)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    page = browser.new_page(viewport={"width": 1400, "height": 1000})
                    joins: list[float] = []  # when the page sends its events (the first is the validation)
                    page.on("request", lambda r: joins.append(time.perf_counter()) if "/queue/join" in r.url else None)
                    page.goto(f"{url}#token={TOKEN}", wait_until="load")
                    t_load = time.perf_counter()
                    page.wait_for_selector("#schema-validation .pml-status.ok", timeout=120_000)
                    t_valid = time.perf_counter()
                    page.get_by_role("tab", name="2 · Prompt").click()
                    page.wait_for_selector(".pml-module", timeout=120_000)
                    t_builder = time.perf_counter()
                finally:
                    browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    first_event = min(joins) if joins else t_load
    return {"startup_s": round(startup_s, 2), "validation_s": round(t_valid - t_load, 3),
            "page_boot_s": round(first_event - t_load, 3), "server_s": round(t_valid - first_event, 3),
            "builder_s": round(t_builder - t_load, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(ROOT), help="checkout whose app.py is served")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    trials = [one_trial(Path(args.root), args.python) for _ in range(args.trials)]
    out = {"root": args.root, "trials": trials}
    for key in ("startup_s", "validation_s", "page_boot_s", "server_s", "builder_s"):
        vals = [t[key] for t in trials]
        out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
