"""Two checkouts of the studio side by side: each arm's TTFT and decode ms/token, old against new, in one run.

A refactor that must not slow a run is judged here: ``pml-studio run --json`` (what a user runs) on one schema and
prompt, from the ``--old`` checkout and the ``--new`` one in turn (the order swapped every repetition, so a drift
of the machine falls on both), each in its own process, after one untimed run per checkout (the modules encoded,
the weights' packed copy saved). Both read the same module store. Per arm: the medians of each side, and new/old as
min/median/max over the repetitions. Run it on a quiet machine. JSON last.

    python bench/ab_commits.py --old /path/to/old/checkout --new . --reps 5
    python bench/ab_commits.py --old ../old --new . --model SmolLM2-135M-Instruct --reps 2 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import ROOT, bench_model, emit, machine, model_help, result_name, spread, table

FIGURES = ("ttft_ms", "decode_ms_per_token")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="the checkout to compare against")
    ap.add_argument("--new", default=ROOT, type=Path, help="the checkout under test (default: this one)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sample", default="doc_qa", help="a sample schema in sample_schemas/ (default doc_qa)")
    ap.add_argument("--arms", default="baseline,prefix,cached,routed,blend")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help=model_help(quick=False))
    ap.add_argument("--no-write", action="store_true", help="print the JSON only")
    return ap.parse_args()


def run_once(checkout: Path, args, model: str) -> dict:
    """One ``run --json`` from ``checkout``, its own code imported (it runs in that folder)."""
    schema = ROOT / "sample_schemas" / f"{args.sample}.xml"
    prompt = ROOT / "sample_schemas" / f"{args.sample}.prompt.xml"
    argv = [sys.executable, "-c", "import sys, studio.cli; sys.exit(studio.cli.main(sys.argv[1:]))", "run",
            str(schema), str(prompt), "--json", "--model", model, "--arms", args.arms,
            "--max-new-tokens", str(args.max_new_tokens)]
    out = subprocess.run(argv, cwd=checkout, capture_output=True, text=True, env=_env(checkout))
    if out.returncode:
        raise SystemExit(f"{checkout}: run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def _env(checkout: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(checkout.resolve())}  # before the editable install's finder


def measure(args, model: str) -> dict[str, list[dict]]:
    """Each side's documents, untimed first run left out."""
    sides = {"old": args.old, "new": args.new}
    for checkout in sides.values():
        run_once(checkout, args, model)
    docs: dict[str, list[dict]] = {"old": [], "new": []}
    for rep in range(args.reps):
        for side in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            docs[side].append(run_once(sides[side], args, model))
            print(f"{side} [{rep + 1}/{args.reps}] " + " ".join(
                f"{a}={docs[side][-1][a]['ttft_ms']:.0f}ms" for a in docs[side][-1]["arms"]), file=sys.stderr)
    return docs


def compare(docs: dict[str, list[dict]]) -> dict:
    """Per arm and figure: each side's median and new/old over the repetitions."""
    out = {}
    for arm in docs["new"][0]["arms"]:
        out[arm] = {}
        for fig in FIGURES:
            old = [d[arm][fig] for d in docs["old"] if d.get(arm) and d[arm][fig] is not None]
            new = [d[arm][fig] for d in docs["new"] if d.get(arm) and d[arm][fig] is not None]
            if old and new:
                out[arm][fig] = {"old_median": round(statistics.median(old), 3),
                                 "new_median": round(statistics.median(new), 3),
                                 "new_over_old": round(statistics.median(new) / statistics.median(old), 3),
                                 "per_rep": spread([n / o for n, o in zip(new, old)], 3)}
    return out


def main() -> None:
    args = parse()
    bm = bench_model(args.model)
    docs = measure(args, bm.spec)
    result = compare(docs)
    print(table(["arm", "TTFT old ms", "new ms", "new/old", "decode old ms/tok", "new", "new/old"],
                [[arm, *(v for fig in FIGURES for v in (
                    (r[fig]["old_median"], r[fig]["new_median"], r[fig]["new_over_old"]) if fig in r else ("-",) * 3))]
                 for arm, r in result.items()]), file=sys.stderr)
    emit(result_name("ab-commits", bm.spec), {
        "benchmark": "ab-commits", "model": bm.spec, "sample": args.sample, "arms": args.arms.split(","),
        "max_new_tokens": args.max_new_tokens, "reps": args.reps, "machine": machine(),
        "old": {"path": str(args.old), "commit": _commit(args.old)}, "new": {"path": str(args.new),
                                                                           "commit": _commit(args.new)},
        "results": result}, write=not args.no_write)


def _commit(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


if __name__ == "__main__":
    main()
