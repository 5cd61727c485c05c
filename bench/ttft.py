"""TTFT of baseline (full prefill) vs cached (module KV copied + question prefilled), side by side.

Document-QA prompts of about 512 / 1024 / 2048 / 4096 tokens: essay chunks as modules of a
schema (all imported), ~32 uncached question tokens. For each length: one warm-up pair, then
`--reps` alternating baseline/cached runs; medians reported. Cached TTFT includes the copy of
the modules' KV into the run's buffer. Prints a table, then one JSON document last.

    python bench/ttft.py            # full run (~3 min on 2 CPU cores)
    python bench/ttft.py --quick    # CI-sized smoke run
"""

from __future__ import annotations

import argparse

from common import QUESTION, doc_prompt, doc_schema, emit, essay_chunks, machine, median, table

from engine.runner import Sampling, run_baseline, run_cached
from engine.session import Engine


def measure(eng: Engine, target: int, reps: int, new_tokens: int, chunk_tokens: int, chunks: list[str]) -> dict:
    codec = eng.codec
    q_tokens = len(codec.encode(" " + QUESTION))
    overhead = lay_overhead(eng) + q_tokens
    docs: list[str] = []
    total = 0
    for c in chunks:
        n = len(codec.encode(c))
        if total + n + overhead > target:
            words = c.split()  # fill the rest of the budget with the start of the next chunk
            while words and total + len(codec.encode(" ".join(words))) + overhead > target:
                words = words[: int(len(words) * 0.9)]
            if len(words) > 20:
                docs.append(" ".join(words) + ".")
            break
        docs.append(c)
        total += n
    name = f"ttft{target}"
    schema, prompt = doc_schema(name, docs), doc_prompt(name, len(docs))
    lay = eng.layout(schema)
    plan = eng.plan(lay, prompt, max_new_tokens=new_tokens)
    enc = eng.encode(lay)
    store = eng.store()
    sampling = Sampling(max_new_tokens=new_tokens)
    run_baseline(eng.lm, plan, sampling)  # warm-up, discarded
    run_cached(eng.lm, plan, enc.encoded, store, sampling)
    base, cached = [], []
    for _ in range(reps):
        base.append(run_baseline(eng.lm, plan, sampling))
        cached.append(run_cached(eng.lm, plan, enc.encoded, store, sampling))
    b_ttft = median([r.ttft_ms for r in base])
    c_ttft = median([r.ttft_ms for r in cached])
    b_dec = median([r.decode_ms_per_token for r in base if r.decode_ms_per_token])
    c_dec = median([r.decode_ms_per_token for r in cached if r.decode_ms_per_token])
    return {
        "target_tokens": target, "prompt_tokens": plan.prompt_tokens, "cached_tokens": plan.cached_tokens,
        "uncached_tokens": plan.uncached_tokens, "modules": len(docs), "store_bytes": enc.store_bytes,
        "baseline_ttft_ms": round(b_ttft, 2), "cached_ttft_ms": round(c_ttft, 2),
        "cached_copy_ms": round(median([r.copy_ms for r in cached]), 2),
        "cached_prefill_ms": round(median([r.prefill_ms for r in cached]), 2),
        "speedup": round(b_ttft / c_ttft, 2),
        "baseline_decode_ms_per_token": round(b_dec, 2), "cached_decode_ms_per_token": round(c_dec, 2),
        "decode_ratio": round(c_dec / b_dec, 3),
        "baseline_ttft_ms_all": [round(r.ttft_ms, 2) for r in base],
        "cached_ttft_ms_all": [round(r.ttft_ms, 2) for r in cached],
        "same_text": all(b.token_ids == c.token_ids for b, c in zip(base, cached)),
    }


def lay_overhead(eng: Engine) -> int:
    """Tokens a one-module prompt adds besides module text and question (system text, role tags)."""
    lay = eng.layout(doc_schema("probe", ["x"]))
    plan = eng.plan(lay, doc_prompt("probe", 1, question="q"))
    return plan.prompt_tokens - len(eng.codec.encode("x")) - len(eng.codec.encode(" q"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per run (decode ms/token)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 256 and 512 tokens, 1 rep, 4 new tokens")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.reps, args.new_tokens = [256, 512], 1, 4
    eng = Engine(model=args.model)
    chunks = essay_chunks(eng.codec.encode, 250)
    rows = [measure(eng, n, args.reps, args.new_tokens, 250, chunks) for n in args.lengths]
    print(table(["prompt", "cached", "uncached", "baseline ms", "cached ms", "copy ms", "speedup", "dec ms/t b",
                 "dec ms/t c"],
                [[r["prompt_tokens"], r["cached_tokens"], r["uncached_tokens"], r["baseline_ttft_ms"],
                  r["cached_ttft_ms"], r["cached_copy_ms"], f'{r["speedup"]}x', r["baseline_decode_ms_per_token"],
                  r["cached_decode_ms_per_token"]] for r in rows]))
    emit("ttft",
         {"benchmark": "ttft", "model": eng.lm.name, "storage": "cpu", "mode": eng.mode, "dtype": eng.lm.dtype,
          "ttft_includes_copy": True, "reps": args.reps, "new_tokens": args.new_tokens, "machine": machine(),
          "results": rows}, write=not args.quick)


if __name__ == "__main__":
    main()
