"""How TTFT scales with prompt length: baseline (full prefill) vs cached, the paper's Fig. 5.

Document-QA prompts from ~256 to ~4096 tokens (~95 % or more in cached modules, 32 uncached
tokens: question, turn end, generation prompt). Per length: a warm-up pair, then `--reps`
alternating runs; medians. The cached TTFT is split into assembly/copy, uncached prefill and
first-token sampling, and set against the floor (as in bench/ttft.py: stock transformers over
a DynamicCache of the same KV, and the same tokens without a cache, min/median/max). Fits: cached TTFT against cached tokens (linear, R^2) and a power law
for both paths (exponent > 1 means faster than linear). With a CUDA device present it adds
the paper's three storage cases: GPU storage, CPU storage copied host-to-device, baseline.

Writes `assets/scaling.png` and `bench/results/scaling.json`; prints a table, then the JSON.

    python bench/scaling.py            # full run (~5 min on 2 CPU cores)
    python bench/scaling.py --quick    # CI-sized smoke run (no files written)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import ROOT, bench_model, emit, essay_chunks, machine, model_help, table, ttft_point

from engine.session import Engine


def fit_linear(xs: list[float], ys: list[float]) -> dict:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    icpt = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (icpt + slope * x)) ** 2 for x, y in zip(xs, ys))
    return {"slope_ms_per_token": round(slope, 5), "intercept_ms": round(icpt, 2),
            "r2": round(1 - ss_res / ss_tot, 4) if ss_tot else 1.0}


def fit_power(xs: list[float], ys: list[float]) -> dict:
    """y = a * x^k fitted in log-log space; k is the growth exponent."""
    lin = fit_linear([math.log(x) for x in xs], [math.log(y) for y in ys])
    return {"exponent": round(lin["slope_ms_per_token"], 3), "r2": lin["r2"]}


def plot(rows: list[dict], path, gpu_rows: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ax.plot(x, [r["baseline_ttft_ms"] / 1000 for r in rows], "o-", color="#c0392b", label="baseline (full prefill)")
    ax.plot(x, [r["cached_ttft_ms"] / 1000 for r in rows], "o-", color="#2471a3", label="cached (copy included)")
    for name, grows in (gpu_rows or {}).items():
        ax.plot([r["prompt_tokens"] for r in grows], [r["cached_ttft_ms"] / 1000 for r in grows], "s--", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(x, [r["speedup"] for r in rows], "d:", color="#1e8449", label="speedup (right axis)")
    ax2.set_ylabel("speedup (×)", color="#1e8449")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=9)
    ax.set_title("TTFT vs prompt length — SmolLM2-135M, fp32, 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 1536, 2048, 3072, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 short lengths, 1 rep, no files written")
    ap.add_argument("--model", default=None, help=model_help())
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.reps = [96, 128, 192], 1
    model = bench_model(args.model, args.quick)
    eng = Engine(model=model.spec, persist=False)
    chunks = essay_chunks(eng.codec.encode, 250)
    rows = [ttft_point(eng, n, args.reps, args.new_tokens, chunks, floor=True) for n in args.lengths]

    gpu: dict[str, list[dict]] = {}
    import torch

    if torch.cuda.is_available():
        for label, storage in (("GPU storage", "cuda"), ("CPU storage, copied to GPU", "cpu")):
            geng = Engine(model=model.spec, storage=storage, device="cuda", persist=False)
            gpu[label] = [ttft_point(geng, n, args.reps, args.new_tokens, chunks) for n in args.lengths]

    cached_tokens = [r["cached_tokens"] for r in rows]
    fits = {
        "cached_ttft_vs_cached_tokens_linear": fit_linear(cached_tokens, [r["cached_ttft_ms"] for r in rows]),
        "baseline_ttft_vs_prompt_tokens_linear": fit_linear([r["prompt_tokens"] for r in rows],
                                                            [r["baseline_ttft_ms"] for r in rows]),
        "cached_ttft_power": fit_power(cached_tokens, [r["cached_ttft_ms"] for r in rows]),
        "baseline_ttft_power": fit_power([r["prompt_tokens"] for r in rows], [r["baseline_ttft_ms"] for r in rows]),
    }
    print(table(["prompt", "cached", "uncached", "baseline ms", "cached ms", "copy", "prefill", "sample", "speedup",
                 "floor ms", "no-cache ms", "cached/floor", "floor/no-cache"],
                [[r["prompt_tokens"], r["cached_tokens"], r["uncached_tokens"], r["baseline_ttft_ms"],
                  r["cached_ttft_ms"], r["cached_copy_ms"], r["cached_prefill_ms"], r["cached_sample_ms"],
                  f'{r["speedup"]}x', f'{r["floor_ms"]} ({r["floor_ms_min"]}-{r["floor_ms_max"]})', r["nocache_ms"],
                  r["cached_over_floor"], r["floor_over_nocache"]] for r in rows]))
    print(f"baseline grows as tokens^{fits['baseline_ttft_power']['exponent']}, cached as "
          f"tokens^{fits['cached_ttft_power']['exponent']} (linear fit R^2 "
          f"{fits['cached_ttft_vs_cached_tokens_linear']['r2']})")
    if not args.quick:
        plot(rows, ROOT / "assets" / "scaling.png", gpu)
    emit("scaling", {"benchmark": "scaling", "model": eng.lm.name, "dtype": eng.lm.dtype, "mode": eng.config.mode,
                     "storage": "cpu", "ttft_includes_copy": True, "reps": args.reps, "machine": machine(),
                     "results": rows, "fits": fits, "gpu": gpu or None,
                     "gpu_note": None if gpu else "no CUDA device on this machine: GPU storage cases not run"},
         write=not args.quick)


if __name__ == "__main__":
    main()
