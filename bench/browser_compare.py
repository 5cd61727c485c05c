"""What a user waits for in the browser, and the studio's decoding against `pml-studio run`'s (issue 26).

One run, on the studio's default model and weights (studio/launch.py STUDIO_MODEL / STUDIO_WEIGHTS):

1. **serve** — ``python app.py`` started as ``make run`` starts it (own process, own run log); seconds
   until ``/`` answers HTTP 200;
2. **Compares in chromium** (Playwright, Debian's chromium) — the page opens on the default sample; the
   Compare tab's button with the default arms and 32 new tokens, ``--compares`` times. Each Compare is
   timed from the click until the run is in the run log and the page shows the finished texts; the
   first one includes loading the model (if the background load has not finished) and encoding;
3. **decode per token** — then ``--pairs`` more Compares of ``--ratio-tokens`` new tokens (128: a 32-token
   decode lasts ~1 s, and one second of this machine varies by ±20 %), each paired with a ``pml-studio run
   --json`` of the same sample, model, weights, arms and tokens in its own process while the studio and its
   page stay open and idle. The machine's speed drifts over minutes (a shared virtual machine: the share of
   time the host takes, "steal", is recorded for every Compare and CLI run), so the pairs run in alternating
   order (Compare, CLI, CLI, Compare, Compare, CLI, ...: a drift in time favours neither side). Each side's
   figure is the median of its arms' ``decode_ms_per_token``; the bar's ratio is the median over pairs of
   studio / CLI (``studio_over_cli_paired``); ``studio_over_cli`` is the ratio of the two sides' medians.

Prints a table, then one JSON document last (bench/results/browser-compare.json).

    python bench/browser_compare.py                              # 5 Compares, then 8 pairs of 128 tokens
    python bench/browser_compare.py --compares 2 --pairs 1 --ratio-tokens 32 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import ROOT, emit, machine, spread, table
from studio.guard import TOKEN_ENV
from studio.launch import STUDIO_MODEL, STUDIO_WEIGHTS
from tools.screenshot import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, free_port

SAMPLE = "travel"  # the sample the studio opens on
SETTLE_S = 5.0  # after a CLI run, before the next Compare: without this pause the Compares right after a CLI run
# decoded ~10 % slower than the one that followed none (observed on 2 cores; the CLI process exits holding ~3 GB)


def logged_runs(db: Path) -> list[dict]:
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        try:
            rows = con.execute("select id, result_json from runs order by id").fetchall()
        except sqlite3.OperationalError:  # not created yet
            return []
    return [{"id": i, **json.loads(doc)} for i, doc in rows]


def logged_count(db: Path) -> int:
    """How many runs the log holds: what the Compare loop polls (reading every document each poll would take CPU
    from the studio it is timing, on the same cores)."""
    if not db.exists():
        return 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        try:
            return con.execute("select count(*) from runs").fetchone()[0]
        except sqlite3.OperationalError:  # not created yet
            return 0


TOKEN = secrets.token_urlsafe(32)  # the studio's launch token, given to it in its environment


def serve(port: int, db: Path) -> tuple[subprocess.Popen, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--db", str(db)], cwd=ROOT,
                            env={**os.environ, TOKEN_ENV: TOKEN},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    page = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Authorization": f"Bearer {TOKEN}"})
    while True:
        try:
            with urllib.request.urlopen(page, timeout=5) as resp:
                if resp.status == 200:
                    return proc, time.perf_counter() - t0
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the studio exited: {proc.stderr.read()[-2000:]}")
        if time.perf_counter() - t0 > 600:
            raise SystemExit("the studio did not answer within 10 minutes")
        time.sleep(0.2)


def cpu_times() -> list[int]:
    """This machine's CPU time counters (/proc/stat's first line: user, nice, system, idle, iowait, irq, softirq,
    steal, ...), or [] where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def steal_pct(before: list[int], after: list[int]) -> float | None:
    """The share of CPU time the host took from this machine between two :func:`cpu_times` (percent)."""
    d = [b - a for a, b in zip(before, after)]
    return round(100 * d[7] / sum(d), 1) if len(d) > 7 and sum(d) > 0 else None


def compares(url: str, db: Path, rounds: list[int], between=lambda i: None) -> list[tuple[float, float | None]]:
    """(seconds, steal %) of one Compare in chromium per entry of ``rounds`` (its new tokens); ``between(i)`` runs
    after Compare ``i``."""
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(url)
            page.wait_for_selector(f"#schema-validation .pml-status.ok:has-text('{SAMPLE}')", timeout=120_000)
            page.get_by_role("tab", name="4 · Compare").click()
            box, shown = page.locator("#max-new-tokens input[type=number]"), None
            for i, new_tokens in enumerate(rounds):
                if new_tokens != shown:
                    box.fill(str(new_tokens))
                    box.press("Enter")
                    shown = new_tokens
                before, cpu = logged_count(db), cpu_times()
                t = time.perf_counter()
                page.click("#compare-btn")
                while logged_count(db) == before:
                    if time.perf_counter() - t > 600:
                        raise SystemExit("a Compare did not finish within 10 minutes")
                    time.sleep(0.05)
                # the final update: it replaces the summary that named the running Compare (studio/live.py)
                page.wait_for_function("!document.querySelector('.pml-live')", timeout=60_000)
                page.wait_for_selector("#cached-text .pml-output:not(.active)", timeout=60_000)
                times.append((time.perf_counter() - t, steal_pct(cpu, cpu_times())))
                between(i)
        finally:
            browser.close()
    return times


def cli_run(new_tokens: int, arms: list[str]) -> dict:
    """``pml-studio run --json``'s document, with the steal % while it ran (``steal_pct``)."""
    schema, prompt = ROOT / "sample_schemas" / f"{SAMPLE}.xml", ROOT / "sample_schemas" / f"{SAMPLE}.prompt.xml"
    cpu = cpu_times()
    done = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(schema), str(prompt), "--json",
                           "--model", STUDIO_MODEL, "--weights", STUDIO_WEIGHTS, "--max-new-tokens",
                           str(new_tokens), "--arms", ",".join(arms), "--no-persist"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout), "steal_pct": steal_pct(cpu, cpu_times())}


def decode_ms(doc: dict) -> float:
    """One run's decode figure: the median of its arms' ``decode_ms_per_token`` (arms decoded together share it)."""
    return statistics.median(doc[a]["decode_ms_per_token"] for a in doc["arms"] if doc[a]["decode_ms_per_token"])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compares", type=int, default=5, help="Compares of --new-tokens (the first includes load and "
                    "encode)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=8, help="Compares of --ratio-tokens, each paired with a CLI run")
    ap.add_argument("--ratio-tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not os.path.exists(CHROMIUM):
        raise SystemExit(f"{CHROMIUM} is missing (apt-get install chromium)")
    if args.compares < 1 or args.pairs < 1:
        raise SystemExit("--compares and --pairs must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    # the latency Compares; one Compare of --ratio-tokens to settle (a longer decode's first buffers); the pairs
    rounds = [args.new_tokens] * args.compares + [args.ratio_tokens] * (1 + args.pairs)
    first_pair = args.compares + 1
    with tempfile.TemporaryDirectory() as tmp:
        db, port = Path(tmp) / "runs.db", free_port()
        proc, serve_s = serve(port, db)
        cli_docs: list[dict] = []

        def run_cli(i: int):  # after pair j's Compare (j odd): its CLI run, then the one pair j + 1's Compare follows
            j = i - first_pair + 1
            if j >= 1 and j % 2:
                for _ in range(2 if j < args.pairs else 1):
                    cli_docs.append(cli_run(args.ratio_tokens, logged_runs(db)[-1]["arms"]))
                    time.sleep(SETTLE_S)
        try:
            times = compares(f"http://127.0.0.1:{port}/#token={TOKEN}", db, rounds, run_cli)
            studio_docs = [{k: v for k, v in d.items() if k != "id"} for d in logged_runs(db)]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    arms = studio_docs[-1]["arms"]
    latency, ratio_docs = times[:args.compares], studio_docs[first_pair:]
    studio_ms, cli_ms = [decode_ms(d) for d in ratio_docs], [decode_ms(d) for d in cli_docs]
    ratio = statistics.median(studio_ms) / statistics.median(cli_ms)
    paired = [a / b for a, b in zip(studio_ms, cli_ms)]  # pair j: the j-th Compare and CLI run, side by side
    paired_ratio = statistics.median(paired)
    steal = [t[1] for t in times[first_pair:]] + [d["steal_pct"] for d in cli_docs]
    first, later = latency[0][0], [t[0] for t in latency[1:]]
    result = {
        "benchmark": "browser_compare", "machine": machine(), "model": studio_docs[-1]["model"],
        "weights": studio_docs[-1].get("weights"), "decode": studio_docs[-1].get("decode"), "sample": SAMPLE,
        "arms": arms, "new_tokens": args.new_tokens, "serve_s": round(serve_s, 2),
        "first_compare_s": round(first, 2), "later_compare_s": spread(later) if later else None,
        "latency_decode_ms_per_token": spread([decode_ms(d) for d in studio_docs[1:args.compares]]),
        "ratio_new_tokens": args.ratio_tokens, "pairs": args.pairs,
        "studio_decode_ms_per_token": spread(studio_ms), "cli_decode_ms_per_token": spread(cli_ms),
        "studio_over_cli": round(ratio, 3), "studio_over_cli_paired": spread(paired, 3),
        "steal_pct": spread([x for x in steal if x is not None], 1),
        "order": "Compare, CLI, CLI, Compare, Compare, CLI, ... (pair j: the j-th Compare and CLI run)",
        "texts": {a: studio_docs[args.compares - 1][a]["text"] for a in arms},
        "bars": {"serve_s<=180": serve_s <= 180, "first_compare_s<=15": first <= 15,
                 "later_compare_s<=4": bool(later) and max(later) <= 4,
                 "studio_within_10pct_of_cli": paired_ratio <= 1.10},
    }
    print(table(["what", "measured"], [
        ["HTTP 200 after start", f"{serve_s:.1f} s"], ["first Compare", f"{first:.1f} s"],
        [f"later Compares, {args.new_tokens} tokens (min/median/max)",
         f"{min(later):.2f} / {statistics.median(later):.2f} / {max(later):.2f} s" if later else "-"],
        [f"decode ms/token at {args.ratio_tokens} tokens, studio (median)", f"{statistics.median(studio_ms):.1f}"],
        [f"decode ms/token at {args.ratio_tokens} tokens, pml-studio run (median)", f"{statistics.median(cli_ms):.1f}"],
        ["studio / run (medians)", f"{ratio:.3f}"],
        [f"studio / run, {len(paired)} pairs side by side (min/median/max)",
         f"{min(paired):.3f} / {paired_ratio:.3f} / {max(paired):.3f}"],
        ["CPU time taken by the host (steal, min/median/max %)",
         " / ".join(f"{result['steal_pct'][k]}" for k in ("min", "median", "max"))]]))
    emit("browser-compare", result, write=not args.no_write)


if __name__ == "__main__":
    main()
