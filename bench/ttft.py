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
    python bench/ttft.py --device cuda --storage cuda --random-shape llama-2-7b   # gpu-ttft-cuda-llama-2-7b-random.json

The GPU paths (docs/module-memory.md): ``--pinned``, ``--layerwise`` and ``--cuda-graphs`` (auto: on where the
model computes on CUDA) set pinned CPU storage, layer-by-layer copies and CUDA graphs for every arm; with
``--eager-too`` the same lengths are measured again in the same process with all three off (``results_eager``),
after ``results``. On CUDA the JSON also holds the time to read every weight once (``weight_read_ms``, median
of 5 after a warm-up): the floor of a decode step.

    python bench/ttft.py --device cuda --storage cpu --random-shape llama-2-7b --lengths 1024 2048 4096 --eager-too

``--random-shape llama-2-7b`` measures the paper's GPU setting without the weights: a Llama model of Llama-2-7B's
shape (32 layers, hidden 4096, MLP 11008, 32 heads, context 4096) built from its config with random weights,
bf16, directly on the device. TTFT does not depend on the weights' values, only on the shapes of the work. Its
text is tokenized by ``--model``'s tokenizer (the default model's unless named), and its vocabulary is that
tokenizer's (49,152 for SmolLM2's, against Llama-2's 32,000): that changes only the embedding and output
matrices, not the attention or MLP work. Lengths are cut to fit its context less the new tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, emit, essay_chunks, machine, model_help, result_name, table, ttft_point
from bench.shapes import SHAPES, random_model

from engine.config import COMPUTE_DTYPES, DEVICES, STORAGES
from engine.session import Engine

PATHS = {"pinned": "page-locked CPU storage of module KV, copied asynchronously",
         "layerwise": "module KV copied layer by layer on a side stream while the forward runs",
         "cuda-graphs": "the question's prefill and each decode step replayed from a CUDA graph, every arm"}


def set_paths(eng, paths: dict[str, str]) -> None:
    """Turn the GPU paths of ``eng`` on or off ("auto": on where the model computes on CUDA); before encoding."""
    from engine.kv.pinned import PinState
    from engine.model import graphs

    cuda = str(eng.lm.device).startswith("cuda")
    store = eng.store()
    pin = paths["pinned"] == "on" or (paths["pinned"] == "auto" and cuda)
    if pin != store.pinning.wanted:
        store.clear()
        store.pinning = PinState.for_store(pin, store.device)
    layered = paths["layerwise"] == "on" or (paths["layerwise"] == "auto" and cuda)
    eng.pool.layerwise = layered
    graphs.set_mode(eng.lm.model, paths["cuda-graphs"])


def gpu_paths(eng) -> dict:
    """What the GPU paths did in ``eng``'s runs: the store's pinning, layer-wise copies, CUDA graphs."""
    from engine.model import graphs

    return {"pinned_storage": eng.store().pinning.why, "pinned_bytes": eng.store().pinning.pinned_bytes,
            "layerwise_copies": "on" if eng.pool.layerwise else "off",
            "cuda_graphs": graphs.status(eng.lm.model), "graphs_captured": graphs.captured(eng.lm.model)}


def measure(eng, paths: dict[str, str], args, chunks) -> list[dict]:
    set_paths(eng, paths)
    return [ttft_point(eng, n, args.reps, args.new_tokens, chunks, floor=True) for n in args.lengths]


def weight_read(lm, reps: int = 5) -> dict:
    """Milliseconds to read every weight once on CUDA (one norm per tensor, median of ``reps`` after a warm-up):
    the floor of a decode step. Empty on the CPU."""
    import statistics
    import time

    import torch

    if not str(lm.device).startswith("cuda"):
        return {}
    params = [p.detach() for p in lm.model.parameters()]
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch._foreach_norm(params)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1000)
    return {"weight_read_ms": round(statistics.median(times[1:]), 2),
            "weight_bytes": sum(p.numel() * p.element_size() for p in params)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per run (decode ms/token)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 128 and 256 tokens, 1 rep, 4 new tokens")
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--device", default=None, choices=DEVICES,
                    help="where the model computes (default: cuda with --storage cuda, else cpu)")
    ap.add_argument("--storage", default="cpu", choices=STORAGES,
                    help="where module KV is kept: the paper's two GPU settings are --device cuda with --storage "
                    "cuda and with --storage cpu (Fig. 4); GPU results go to bench/results/gpu-ttft-STORAGE.json")
    ap.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                    help="compute dtype (default: the device's; bfloat16 with --random-shape)")
    ap.add_argument("--random-shape", default=None, choices=sorted(SHAPES),
                    help="a random-weight Llama model of this shape instead of --model's weights (--model then "
                    "gives the tokenizer); results go to ...-SHAPE-random.json")
    for name, what in PATHS.items():
        ap.add_argument(f"--{name}", default="auto", choices=("auto", "on", "off"),
                        help=f"{what} (auto: on where the model computes on CUDA)")
    ap.add_argument("--eager-too", action="store_true",
                    help="measure again with pinned storage, layer-wise copies and CUDA graphs off (results_eager)")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.reps, args.new_tokens = [128, 256], 1, 4
    return args


def main() -> None:
    args = parse_args()
    extra, model = {}, bench_model(args.model, args.quick)
    if args.random_shape:
        device = args.device or ("cuda" if args.storage == "cuda" else "cpu")
        lm, tok_name, cfg = random_model(args.random_shape, model.spec, device, args.dtype or "bfloat16")
        eng = Engine.from_loaded(lm, storage=args.storage)
        # room for the new tokens (and the chunk cut's slack) inside the shape's context
        args.lengths = [min(n, cfg.max_position_embeddings - args.new_tokens - 16) for n in args.lengths]
        extra = {"random_weights": True, "shape": {"name": args.random_shape, "architecture": "LlamaForCausalLM",
                                                   **SHAPES[args.random_shape], "vocab_size": cfg.vocab_size},
                 "params": lm.n_params, "tokenizer": tok_name}
    else:
        eng = Engine(model=model.spec, persist=False, device=args.device, storage=args.storage, dtype=args.dtype)
    chunks = essay_chunks(eng.codec.encode, 250)
    paths = {name: getattr(args, name.replace("-", "_")) for name in PATHS}
    rows = measure(eng, paths, args, chunks)
    used = gpu_paths(eng)
    if args.eager_too:
        eager = Engine.from_loaded(eng.lm, storage=args.storage)
        extra["results_eager"] = measure(eager, dict.fromkeys(PATHS, "off"), args, chunks)
        extra["gpu_paths_eager"] = gpu_paths(eager)
        set_paths(eng, paths)
    extra.update(gpu_paths=used, **weight_read(eng.lm))
    print(table(["prompt", "cached", "uncached", "baseline ms", "cached ms", "copy ms", "speedup", "range",
                 "floor ms", "no-cache ms", "cached/floor", "floor/no-cache", "dec ms/t b", "dec ms/t c"],
                [[r["prompt_tokens"], r["cached_tokens"], r["uncached_tokens"], r["baseline_ttft_ms"],
                  r["cached_ttft_ms"], r["cached_copy_ms"], f'{r["speedup"]}x', f'{r["speedup_min"]}-{r["speedup_max"]}x',
                  f'{r["floor_ms"]} ({r["floor_ms_min"]}-{r["floor_ms_max"]})', r["nocache_ms"], r["cached_over_floor"],
                  r["floor_over_nocache"], r["baseline_decode_ms_per_token"], r["cached_decode_ms_per_token"]]
                 for r in rows]))
    gpu = str(eng.lm.device).startswith("cuda")
    emit(result_name(f"gpu-ttft-{args.storage}" if gpu else "ttft",
                     f"{args.random_shape}-random" if args.random_shape else args.model),
         {"benchmark": "ttft", "model": eng.lm.name, "device": str(eng.lm.device), "storage": args.storage,
          "mode": eng.config.mode, "dtype": eng.lm.dtype, **extra,
          "ttft_includes_copy": True, "paths_asked": paths, "reps": args.reps, "new_tokens": args.new_tokens, "machine": machine(),
          "results": rows}, write=not args.quick)


if __name__ == "__main__":
    main()
