"""Smaller stored modules: what storage precision and layer-wise compression cost in fidelity.

The needle-in-a-haystack set of `bench/fidelity.py` (its own, smaller copy: 4 essay modules per
prompt). For each prompt, one baseline (full prefill) and one uncompressed cached run (fp32,
prefixed) are the references; then every configuration re-encodes the prompt's modules and runs
the cached path again:

* storage dtype float16 / bfloat16 (no compression);
* retention 75 / 50 / 30 % with `pyramid` (fewer tokens with depth, chosen by attention),
  `uniform` (same fraction in every layer, by attention) and `recent` (last tokens only).

Reported per configuration: stored module bytes (relative to fp32, uncompressed), cached TTFT
(median over prompts), needle accuracy with a 95 % Wilson interval, and — against the
uncompressed cached run and against the baseline — first-token agreement and mean KL.

    python bench/compression.py            # 12 prompts, ~15 min on 2 CPU cores
    python bench/compression.py --quick    # 2 tiny prompts, 2 configurations, no files written
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from xml.sax.saxutils import escape

from common import doc_schema, emit, essay_chunks, machine, table
from fidelity import NAMES, SYSTEM, insert, needle, question, wilson

from engine.compress import Compression
from engine.runner import Sampling, agreement, run_baseline, run_cached
from engine.session import Engine

CONFIGS = [("float16", 1.0, "pyramid"), ("bfloat16", 1.0, "pyramid")] + [
    ("float32", r, m) for r in (0.75, 0.5, 0.3) for m in ("pyramid", "uniform", "recent")]


def label(cfg) -> str:
    dtype, r, m = cfg
    return dtype if r >= 1.0 else f"{m} {r:.0%}"


def cases(chunks: list[str], n: int, modules: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = rng.randrange(0, len(chunks) - modules)
        docs = list(chunks[start:start + modules])
        depth = (0.1, 0.5, 0.9)[i % 3]
        k = min(modules - 1, int(depth * modules))
        name, number = rng.choice(NAMES), str(rng.randrange(1_000_000, 9_999_999))
        docs[k] = insert(docs[k], needle(name, number), rng.random())
        out.append({"docs": docs, "name": name, "number": number, "depth": depth})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--modules", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=28)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2 prompts of 2 small modules, 2 configurations")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    configs = CONFIGS
    chunk_tokens = 250
    if args.quick:
        args.prompts, args.modules, args.new_tokens, chunk_tokens = 2, 2, 28, 80
        configs = [("float16", 1.0, "pyramid"), ("float32", 0.5, "pyramid")]
    eng = Engine(model=args.model, persist=False)
    chunks = essay_chunks(eng.codec.encode, chunk_tokens)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    store = eng.store()
    rows: dict[str, list[dict]] = {label(c): [] for c in configs}
    refs = {"baseline": [], "cached fp32": []}
    full_bytes = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases(chunks, args.prompts, args.modules, args.seed)):
        schema = doc_schema(f"c{i}", case["docs"], system=SYSTEM)
        prompt = (f'<prompt schema="c{i}">' + "".join(f"<doc{j}/>" for j in range(args.modules)) +
                  f" {escape(question(case['name']))}</prompt>")
        lay = eng.layout(schema)
        plan = eng.plan(lay, prompt, sampling.max_new_tokens)
        base = run_baseline(eng.lm, plan, sampling)
        enc = eng.encode(lay, eng.config.with_(storage_dtype="float32", compression=Compression())).encoded
        ref = run_cached(eng.lm, plan, enc, store, sampling)
        module_keys = [k for path, k in enc.module_keys.items() if path]
        full = sum(store.entry_bytes(k) for k in module_keys)
        full_bytes.append(full)
        refs["baseline"].append({"found": case["number"] in base.text})
        refs["cached fp32"].append({"found": case["number"] in ref.text, **agreement(base, ref),
                                    "ttft_ms": ref.ttft_ms})
        for cfg in configs:
            dtype, r, m = cfg
            e = eng.encode(lay, eng.config.with_(storage_dtype=dtype, compression=Compression(r, m))).encoded
            run = run_cached(eng.lm, plan, e, store, sampling)
            nbytes = sum(store.entry_bytes(k) for path, k in e.module_keys.items() if path)
            vs_ref, vs_base = agreement(ref, run), agreement(base, run)
            rows[label(cfg)].append({"found": case["number"] in run.text, "bytes_ratio": nbytes / full,
                                     "ttft_ms": run.ttft_ms, "agree_ref": vs_ref["first_token_agree"],
                                     "kl_ref": vs_ref["first_token_kl"], "agree_base": vs_base["first_token_agree"],
                                     "kl_base": vs_base["first_token_kl"]})
        for key in list(store.keys()):
            store.evict(key)
        print(f"[{i + 1}/{args.prompts}] baseline={'Y' if refs['baseline'][-1]['found'] else 'n'} cached="
              f"{'Y' if refs['cached fp32'][-1]['found'] else 'n'} " +
              " ".join(f"{k}={'Y' if v[-1]['found'] else 'n'}" for k, v in rows.items()), flush=True)

    def acc(rs):
        k = sum(r["found"] for r in rs)
        return {"accuracy": round(k / len(rs), 4), "found": k, "n": len(rs), "ci95": wilson(k, len(rs))}

    summary = {"baseline": acc(refs["baseline"]),
               "cached fp32": {**acc(refs["cached fp32"]), "bytes_ratio": 1.0,
                               "ttft_ms": round(statistics.median(r["ttft_ms"] for r in refs["cached fp32"]), 2),
                               "agree_base": round(statistics.mean(r["first_token_agree"] for r in refs["cached fp32"]), 4),
                               "kl_base": round(statistics.mean(r["first_token_kl"] for r in refs["cached fp32"]), 5)}}
    for name, rs in rows.items():
        summary[name] = {**acc(rs), "bytes_ratio": round(statistics.mean(r["bytes_ratio"] for r in rs), 4),
                         "ttft_ms": round(statistics.median(r["ttft_ms"] for r in rs), 2),
                         "agree_ref": round(statistics.mean(r["agree_ref"] for r in rs), 4),
                         "kl_ref": round(statistics.mean(r["kl_ref"] for r in rs), 5),
                         "agree_base": round(statistics.mean(r["agree_base"] for r in rs), 4),
                         "kl_base": round(statistics.mean(r["kl_base"] for r in rs), 5)}
    verdicts = []
    for r in (0.75, 0.5, 0.3):
        names = {m: f"{m} {r:.0%}" for m in ("pyramid", "uniform", "recent")}
        if all(n in summary for n in names.values()):
            p, u, w = (summary[names[m]]["accuracy"] for m in ("pyramid", "uniform", "recent"))
            beats = p > u and p > w
            verdicts.append(f"retention {r:.0%}: pyramid {p:.0%}, uniform {u:.0%}, recent {w:.0%} -> pyramid "
                            f"{'beats both' if beats else 'does NOT beat both'} controls at equal bytes")
    print(table(["config", "bytes", "TTFT ms", "accuracy", "95% CI", "agree vs cached", "KL vs cached",
                 "agree vs baseline", "KL vs baseline"],
                [[k, f"{s['bytes_ratio']:.0%}" if "bytes_ratio" in s else "-",
                  s.get("ttft_ms", "-"), f"{s['accuracy']:.0%}", f"{s['ci95'][0]:.0%}-{s['ci95'][1]:.0%}",
                  s.get("agree_ref", "-"), s.get("kl_ref", "-"), s.get("agree_base", "-"), s.get("kl_base", "-")]
                 for k, s in summary.items()]))
    for v in verdicts:
        print(v)
    emit("compression", {"benchmark": "compression", "model": eng.lm.name, "prompts": args.prompts,
                         "modules_per_prompt": args.modules, "new_tokens": args.new_tokens, "machine": machine(),
                         "seconds": round(time.perf_counter() - t0, 1), "module_bytes_fp32": full_bytes,
                         "summary": summary, "verdicts": verdicts}, write=not args.quick)


if __name__ == "__main__":
    main()
