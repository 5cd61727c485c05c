"""TTFT of baseline (full prefill) vs cached (module KV copied + question prefilled), side by side.

Document-QA prompts of about 512 / 1024 / 2048 / 4096 tokens: essay chunks as modules of a
schema (all imported), ~32 uncached question tokens. For each length: one warm-up pair, then
`--reps` alternating baseline/cached runs; medians reported, and the speedup's range over the
reps (each rep's baseline and cached ran side by side). Cached TTFT includes the copy of
the modules' KV into the run's buffer.

The speedup depends on how fast the machine prefills (the baseline), so the same machine type
gives different speedups; the **floor** does not: a stock transformers forward of the same
uncached tokens over an ordinary DynamicCache of the same cached KV, timed in the same process
(min/median/max of the reps), and the same tokens with no cache. `cached / floor` says how
close the cached path is to what stock transformers needs for the same work; `floor / no-cache`
what attending over the cache costs. Prints a table, then one JSON document last.

    python bench/ttft.py            # full run (~5 min on 2 quiet CPU cores)
    python bench/ttft.py --quick    # CI-sized smoke run
    python bench/ttft.py --model gemma3-270m   # another model: results go to bench/results/ttft-gemma3-270m.json
    python bench/ttft.py --device cuda --storage cuda   # on a GPU, modules in GPU memory: gpu-ttft-cuda.json
    python bench/ttft.py --device cuda --storage cpu    # on a GPU, modules in CPU memory: gpu-ttft-cpu.json
"""

from __future__ import annotations

import argparse

from common import emit, essay_chunks, machine, result_name, table, ttft_point

from engine.config import COMPUTE_DTYPES, DEVICES, STORAGES
from engine.session import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per run (decode ms/token)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 256 and 512 tokens, 1 rep, 4 new tokens")
    ap.add_argument("--model", default=None, help="model to measure (default: the default model)")
    ap.add_argument("--device", default=None, choices=DEVICES,
                    help="where the model computes (default: cuda with --storage cuda, else cpu)")
    ap.add_argument("--storage", default="cpu", choices=STORAGES,
                    help="where module KV is kept: the paper's two GPU settings are --device cuda with --storage "
                    "cuda and with --storage cpu (Fig. 4); GPU results go to bench/results/gpu-ttft-STORAGE.json")
    ap.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES, help="compute dtype (default: the device's)")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.reps, args.new_tokens = [256, 512], 1, 4
    eng = Engine(model=args.model, persist=False, device=args.device, storage=args.storage, dtype=args.dtype)
    chunks = essay_chunks(eng.codec.encode, 250)
    rows = [ttft_point(eng, n, args.reps, args.new_tokens, chunks, floor=True) for n in args.lengths]
    print(table(["prompt", "cached", "uncached", "baseline ms", "cached ms", "copy ms", "speedup", "range",
                 "floor ms", "no-cache ms", "cached/floor", "floor/no-cache", "dec ms/t b", "dec ms/t c"],
                [[r["prompt_tokens"], r["cached_tokens"], r["uncached_tokens"], r["baseline_ttft_ms"],
                  r["cached_ttft_ms"], r["cached_copy_ms"], f'{r["speedup"]}x', f'{r["speedup_min"]}-{r["speedup_max"]}x',
                  f'{r["floor_ms"]} ({r["floor_ms_min"]}-{r["floor_ms_max"]})', r["nocache_ms"], r["cached_over_floor"],
                  r["floor_over_nocache"], r["baseline_decode_ms_per_token"], r["cached_decode_ms_per_token"]]
                 for r in rows]))
    gpu = str(eng.lm.device).startswith("cuda")
    emit(result_name(f"gpu-ttft-{args.storage}" if gpu else "ttft", args.model),
         {"benchmark": "ttft", "model": eng.lm.name, "device": str(eng.lm.device), "storage": args.storage,
          "mode": eng.config.mode, "dtype": eng.lm.dtype,
          "ttft_includes_copy": True, "reps": args.reps, "new_tokens": args.new_tokens, "machine": machine(),
          "results": rows}, write=not args.quick)


if __name__ == "__main__":
    main()
