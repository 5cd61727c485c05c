"""Why the scheduler prefills 256 tokens at a time (engine/run/timing.py ``PREFILL_CHUNK``): one long prompt
prefilled whole and in chunks of 1024, 512, 256 and 128 tokens into one lease, on the model the studio serves.
Per chunk size: the whole prefill's time and its longest chunk (min / median / max over repetitions, the sizes
interleaved in each repetition); the longest chunk is how long a run decoding beside it waits for its next token.
Run it on a quiet machine. JSON last.

    python bench/prefill_chunks.py             # the default model, 2048 tokens, 3 repetitions
    python bench/prefill_chunks.py --quick     # SmolLM2, 512 tokens, 1 repetition: no file written
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, emit, machine, model_help, result_name, spread, table

SIZES = (None, 1024, 512, 256, 128)  # None: the whole prompt in one forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="SmolLM2 unless --model, 512 tokens, 1 repetition")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps = 512, 1
    import torch

    from engine.run.timing import PREFILL_CHUNK
    from engine.session import Engine

    bm = bench_model(args.model, args.quick)
    engine = Engine(model=bm.spec)
    lm = engine.lm
    ids = torch.randint(100, lm.tokenizer.vocab_size - 100, (args.tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    once(engine, ids, 128)  # the kernels' first calls
    times: dict[str, list[float]] = {}
    longest: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for size in SIZES:
            whole, chunk = once(engine, ids, size or len(ids))
            times.setdefault(label(size), []).append(whole * 1000)
            longest.setdefault(label(size), []).append(chunk * 1000)
    rows = [{"chunk": label(s), "prefill_ms": spread(times[label(s)], 1), "longest_chunk_ms": spread(longest[label(s)], 1),
             "over_whole": round(min(times[label(s)]) / min(times[label(None)]), 3)} for s in SIZES]
    print(table(["chunk", "prefill ms (median)", "longest chunk ms (median)", "best / whole's best"],
                [[r["chunk"], r["prefill_ms"]["median"], r["longest_chunk_ms"]["median"], r["over_whole"]]
                 for r in rows]), file=sys.stderr)
    emit(result_name("prefill-chunks", bm.spec), {
        "benchmark": "prefill_chunks", "model": bm.name, "tokens": args.tokens, "reps": args.reps,
        "prefill_chunk": PREFILL_CHUNK, "weights": lm.info().get("weights"), "machine": machine(), "rows": rows},
        write=not args.quick)


def label(size: int | None) -> str:
    return "whole" if size is None else str(size)


def once(engine, ids: list[int], size: int) -> tuple[float, float]:
    """Seconds of the whole prefill of ``ids`` in ``size``-token forwards, and of its longest forward."""
    import torch

    from engine.kv.pool import lease_tokens
    from engine.run import forward

    lease = engine.pool.lease(lease_tokens(len(ids), 1))
    spans = []
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            for a in range(0, len(ids), size):
                t = time.perf_counter()
                b = min(a + size, len(ids))
                forward.prefill(engine.lm, lease, ids[a:b], list(range(a, b)), graphable=False)
                spans.append(time.perf_counter() - t)
            return time.perf_counter() - start, max(spans)
    finally:
        lease.release()


if __name__ == "__main__":
    main()
