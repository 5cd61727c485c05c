"""Where the cached arm's time goes with modules in CPU memory on a GPU: the copy, the launches, the forward.

At Llama-2-7B's shape (random bf16 weights, as ``bench/ttft.py --random-shape``), for each length, in one
process: the pinned host-to-device bandwidth of one contiguous copy of the store's bytes; the same bytes
copied as the cached arm copies them (per layer and module, into the run buffer's strided slots), alone; the
cached arm's TTFT under three ways of combining copy and forward, alternating reps:

- ``shipped``: what the engine does by default: copies deferred, launched whole on a side stream before the
  question's CUDA graph, which waits for them (engine/kv/layerwise.py);
- ``layerwise-eager``: CUDA graphs off: copies launched layer by layer on a side stream while the eager forward
  runs;
- ``copy-then-graph``: layer-wise copies off, every copy enqueued at fill time on the forward's stream, then
  the graph;
- ``resident``: the same KV already in GPU memory (``--storage cuda``'s path), the floor of any copy scheme;
  ``resident-eager``: the same with CUDA graphs off (what the eager forward alone costs).

Then, for the shipped way, where the host waits on the GPU (``torch.cuda.set_sync_debug_mode``) and, from a
profiler trace, how long the GPU copied, computed, and did both at once. Prints one JSON document last.

    python bench/gpu_profile.py --model .tok/SmolLM2-135M-Instruct          # on a lent GPU (bench/gpu.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, essay_chunks, machine, model_help
from bench.shapes import random_model

from engine.arms.compare import run_arm
from engine.arms.registry import ArmContext, Sampling
from engine.cache.assemble import copy_list
from engine.kv import dma, layerwise
from engine.model import graphs
from engine.run.pools import pool_of
from engine.session import Engine
from studio.docqa import doc_qa


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2)}


def copy_bandwidth(lm, plan, encoded, store, reps: int) -> dict:
    """One contiguous pinned copy of the run's bytes, and the run's own copies (strided slots), alone."""
    pairs = []
    real = layerwise.LayerCopies.launch

    def keep(self, *args, **kwargs):  # record the (dst, src) pairs the run defers, then launch them as usual
        pairs.extend((dst, src) for _, dst, src in self.pending)
        real(self, *args, **kwargs)

    layerwise.LayerCopies.launch = keep
    try:
        run_arm(ArmContext(lm, plan, encoded, store, Sampling(1)), "cached")
    finally:
        layerwise.LayerCopies.launch = real
    nbytes = sum(s.numel() * s.element_size() for _, s in pairs)
    host = torch.empty(nbytes, dtype=torch.uint8)
    host = host.pin_memory() if torch.cuda.is_available() else host
    dev = torch.empty(nbytes, dtype=torch.uint8, device=lm.device)
    scratch = [torch.empty_like(s, device=lm.device) for _, s in pairs]
    one = _ms(lambda: dev.copy_(host, non_blocking=True), reps)
    strided = _ms(lambda: [d.copy_(s, non_blocking=True) for d, s in pairs], reps)
    contiguous = _ms(lambda: [d.copy_(s, non_blocking=True) for d, (_, s) in zip(scratch, pairs)], reps)
    kept: list = []  # the DMA transfers' sources, alive until they are done
    rows = _ms(lambda: [dma.copy_into(d, s, kept) for d, s in pairs], reps)
    t = time.perf_counter()
    for d, s in pairs:
        d.copy_(s, non_blocking=True)
    enqueue = (time.perf_counter() - t) * 1000
    _sync()
    t = time.perf_counter()
    for d, s in pairs:
        dma.copy_into(d, s, kept)
    enqueue_rows = (time.perf_counter() - t) * 1000
    _sync()
    gbs = lambda ms: round(nbytes / (statistics.median(ms) / 1000) / 1e9, 1)  # noqa: E731
    return {"bytes": nbytes, "copies": len(pairs), "all_pinned": all(s.is_pinned() for _, s in pairs),
            "one_copy_ms": _stats(one), "one_copy_gb_s": gbs(one),
            "run_copies_ms": _stats(strided), "run_copies_gb_s": gbs(strided),
            "run_copies_contiguous_dst_ms": _stats(contiguous), "run_copies_contiguous_dst_gb_s": gbs(contiguous),
            "run_copies_enqueue_ms": round(enqueue, 2), "dma": dma.available(),
            "run_copies_2d_dma_ms": _stats(rows), "run_copies_2d_dma_gb_s": gbs(rows),
            "run_copies_2d_dma_enqueue_ms": round(enqueue_rows, 2)}


class _Run:
    """The cached arm on one prompt, as ``store.store`` holds the modules."""

    def __init__(self, lm, plan, encoded, store):
        self.lm, self.plan, self.encoded, self.store = lm, plan, encoded, store

    def __call__(self):
        return run_arm(ArmContext(self.lm, self.plan, self.encoded, self.store, Sampling(1)), "cached").run


def ways(lm, cpu_run: _Run, gpu_run: _Run, reps: int) -> dict:
    """The cached arm's TTFT per way of combining copy and forward, alternating reps after a warm-up each."""

    def shipped():
        pool_of(lm).layerwise = True
        return cpu_run()

    def layerwise_eager():
        pool_of(lm).layerwise = True
        graphs.set_mode(lm.model, "off")
        try:
            return cpu_run()
        finally:
            graphs.set_mode(lm.model, "auto")

    def copy_then_graph():
        pool_of(lm).layerwise = False
        return cpu_run()

    def resident():
        pool_of(lm).layerwise = True
        return gpu_run()

    def resident_eager():
        graphs.set_mode(lm.model, "off")
        try:
            return gpu_run()
        finally:
            graphs.set_mode(lm.model, "auto")

    arms = {"shipped": shipped, "layerwise-eager": layerwise_eager, "copy-then-graph": copy_then_graph,
            "resident": resident, "resident-eager": resident_eager}
    times = {k: [] for k in arms}
    for fn in arms.values():
        fn()
    for _ in range(reps):
        for k, fn in arms.items():
            times[k].append(fn().ttft_ms)
    pool_of(lm).layerwise = True
    return {k: _stats(v) for k, v in times.items()}


def sync_sites(run) -> list[dict]:
    """Where the host waited on the GPU during one shipped run (each call site, counted)."""
    seen: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:][::-1])
        key = f"{str(message).splitlines()[0][:80]} @ {where}"
        seen[key] = seen.get(key, 0) + 1

    pool_of(run.lm).layerwise = True
    old = warnings.showwarning
    warnings.showwarning = record
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return [{"site": k, "count": v} for k, v in sorted(seen.items(), key=lambda kv: -kv[1])]


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _total(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs, ys) -> float:
    out = 0.0
    for a, b in xs:
        for c, d in ys:
            out += max(0.0, min(b, d) - max(a, c))
    return out


def timeline(run) -> dict:
    """From a profiler trace of one shipped run: GPU time copying host to device, computing, and both at once."""
    from torch.profiler import ProfilerActivity, profile

    pool_of(run.lm).layerwise = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        _sync()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text()).get("traceEvents", [])
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e]
    launches = [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e.get("cat") == "cuda_runtime" and "dur" in e]
    if not kernels:
        return {"error": "no kernels in the trace"}
    c, k = _busy(copies), _busy(kernels)
    start = min([a for a, _ in c] + [a for a, _ in k])
    end = max([b for _, b in c] + [b for _, b in k])
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e
             and any(w in e.get("name", "") for w in ("Synchronize", "MemcpyAsync", "Memcpy"))]
    longest = sorted(waits, key=lambda e: -e["dur"])[:5]
    return {"gpu_span_ms": round((end - start) / 1000, 2), "htod_busy_ms": round(_total(c) / 1000, 2),
            "htod_copies": len(copies), "kernels_busy_ms": round(_total(k) / 1000, 2), "kernels": len(kernels),
            "copy_and_compute_at_once_ms": round(_overlap(c, k) / 1000, 2),
            "cuda_runtime_calls": len(launches), "cuda_runtime_ms": round(sum(b - a for a, b in launches) / 1000, 2),
            "longest_host_waits": [{"name": e["name"], "ms": round(e["dur"] / 1000, 2)} for e in longest]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help(quick=False) + "; only its tokenizer is used (a folder "
                    "on a lent GPU)")
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run of the script's code
    args = ap.parse_args()
    lm, tok_name, cfg = random_model(args.shape, bench_model(args.model).spec, args.device,
                                     "bfloat16" if args.device == "cuda" else "float32")
    eng = Engine.from_loaded(lm, storage="cpu")
    gpu_eng = Engine.from_loaded(lm, storage=args.device)
    graphs.set_mode(lm.model, "auto")
    chunks = essay_chunks(eng.codec.encode, 250)
    out = {"benchmark": "gpu_profile", "shape": args.shape, "tokenizer": tok_name, "machine": machine(),
           "reps": args.reps, "results": []}
    for n in args.lengths:
        n = min(n, cfg.max_position_embeddings - 32)
        case = doc_qa(eng, n, 1, chunks)
        gpu_case = doc_qa(gpu_eng, n, 1, chunks)
        shipped = _Run(lm, case.plan, case.encoded, eng.store())
        resident = _Run(lm, gpu_case.plan, gpu_case.encoded, gpu_eng.store())
        row = {"target_tokens": n, "prompt_tokens": case.plan.prompt_tokens, "cached_tokens": case.plan.cached_tokens,
               "copy_ranges": len(copy_list(case.plan, case.encoded, eng.store()))}
        for name, fn in (("ways_ms", lambda: ways(lm, shipped, resident, args.reps)),
                         ("copies", lambda: copy_bandwidth(lm, case.plan, case.encoded, eng.store(), args.reps)),
                         ("sync_sites", lambda: sync_sites(shipped)),
                         ("timeline", lambda: timeline(shipped))):
            try:
                row[name] = fn()
            except Exception as err:  # one failed probe must not cost the others' figures
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(name, json.dumps(row[name])[:1500], flush=True)
        out["results"].append(row)
    out["graphs"] = graphs.status(lm.model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
