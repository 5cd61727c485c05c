"""What a user meets: `pml-studio run --model MODEL` with no --weights, its own JSON, decode ms/token per run.

Each sample schema's example prompt runs ``--reps`` times through the CLI as a user types it (a fresh process
each time: the model's default weights chosen by the CLI, not by this script), greedy, ``--new-tokens`` tokens,
the modular arm. Reported: the weights the CLI chose, decode ms/token and TTFT min/median/max. JSON last.

    python bench/cli_decode.py                                # the default model, ~3 min on 2 cores
    python bench/cli_decode.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import ROOT, emit, machine, result_name, spread, table

from engine.model import MODEL_ENV, START_MODEL

SAMPLES = ROOT / "sample_schemas"


def run_once(model: str | None, schema: str, new_tokens: int) -> dict:
    argv = [sys.executable, "-m", "studio.cli", "run", str(SAMPLES / f"{schema}.xml"), str(SAMPLES / f"{schema}.prompt.xml"),
            "--arms", "cached", "--max-new-tokens", str(new_tokens), "--temperature", "0", "--json"]
    argv += ["--model", model] if model else []
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"pml-studio run failed on {schema}:\n{done.stderr[-2000:]}")
    data = json.loads(done.stdout)
    arm = data["cached"]
    return {"schema": schema, "model": data["model"], "weights": data["weights"], "new_tokens": arm["new_tokens"],
            "decode_ms_per_token": arm["decode_ms_per_token"], "ttft_ms": arm["ttft_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="as --model of pml-studio run (default: none given, so "
                    f"the CLI's own: {START_MODEL}, or ${MODEL_ENV} where set)")
    ap.add_argument("--schemas", default="codegen,doc_qa,travel")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = [run_once(args.model, s, args.new_tokens) for s in args.schemas.split(",") for _ in range(args.reps)]
    for r in rows:
        print(f"{r['schema']}: {r['weights']} {r['new_tokens']} tokens, {r['decode_ms_per_token']} ms/token", file=sys.stderr)
    decode = spread([r["decode_ms_per_token"] for r in rows if r["new_tokens"] > 1], every=False)
    print(table(["model", "weights", "decode ms/token min", "median", "max"],
                [[rows[0]["model"], rows[0]["weights"], decode["min"], decode["median"], decode["max"]]]))
    emit(result_name("cli-decode", args.model), {
        "benchmark": "cli-decode", "model": rows[0]["model"], "weights": sorted({r["weights"] for r in rows}),
        "model_argument": args.model, "new_tokens": args.new_tokens, "machine": machine(),
        "decode_ms_per_token": decode, "ttft_ms": spread([r["ttft_ms"] for r in rows], 1, every=False), "runs": rows})


if __name__ == "__main__":
    main()
