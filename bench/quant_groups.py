"""Group sizes of int8 / int4 module storage: error, bytes and needle accuracy per choice.

KIVI's layout (engine/kv/quant.py QuantKV): keys per channel in groups of G_k tokens, values per token in
groups of G_v channels, each group with an fp16 scale and minimum. Smaller groups are more
precise and cost more scale bytes. For each needle prompt (4-module prompts of the set of bench/fidelity.py) the
modules are encoded once in fp32; every choice below quantizes those same entries, and the
cached run is compared with the fp32 cached run (first-token KL, agreement, needle found).

    python bench/quant_groups.py            # 12 prompts of 4 modules (~10 min on 2 CPU cores)
    python bench/quant_groups.py --quick    # 2 tiny prompts, no file written
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, doc_schema, emit, essay_chunks, machine, model_help, table
from bench.workloads import SYSTEM, make_cases, question, wilson

from engine.kv import QuantKV
from engine.arms.registry import Sampling
from engine.arms.compare import agreement
from engine.arms.compare import run_arm
from engine.arms.registry import ArmContext
from engine.session import Engine
from engine.cache.store import ModuleStore

CHOICES = [("int8", 64, 64), ("int8", 128, 64), ("int4", 32, 32), ("int4", 64, 32), ("int4", 64, 64),
           ("int4", 128, 64)]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--modules", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=28)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    args.chunk_tokens = 250
    if args.quick:
        args.prompts, args.modules, args.chunk_tokens = 2, 2, 80
    return args


def summarise(rows: dict[str, list[dict]], ref_found: list[bool]) -> dict:
    """Per storage choice: answers found, bytes against fp32, relative K/V error, KL and agreement with fp32."""
    summary = {"fp32 cached": {"found": sum(ref_found), "n": len(ref_found), "ci95": wilson(sum(ref_found),
                                                                                          len(ref_found))}}
    for name, rs in rows.items():
        k = sum(r["found"] for r in rs)
        summary[name] = {"found": k, "n": len(rs), "accuracy": round(k / len(rs), 4), "ci95": wilson(k, len(rs)),
                         "bytes_ratio": round(max(r["bytes_ratio"] for r in rs), 4),
                         "key_rel_error": round(statistics.mean(r["key_error"] for r in rs), 5),
                         "value_rel_error": round(statistics.mean(r["value_error"] for r in rs), 5),
                         "mean_kl": round(statistics.mean(r["kl"] for r in rs), 6),
                         "agree": round(statistics.mean(r["agree"] for r in rs), 4),
                         "same_text": round(statistics.mean(r["same_text"] for r in rs), 4)}
    return summary


def main() -> None:
    args = parse_args()
    eng = Engine(model=bench_model(args.model, args.quick).spec, persist=False)
    chunks = essay_chunks(eng.codec.encode, args.chunk_tokens)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    rows: dict[str, list[dict]] = {f"{p} k{kg}/v{vg}": [] for p, kg, vg in CHOICES}
    ref_found = []
    t0 = time.perf_counter()
    for i, case in enumerate(make_cases(chunks, [args.modules], args.prompts, [0.1, 0.5, 0.9], args.seed)):
        schema = doc_schema(f"q{i}", case["docs"], system=SYSTEM)
        prompt = (f'<prompt schema="q{i}">' + "".join(f"<doc{j}/>" for j in range(args.modules)) +
                  f" {escape(question(case['name']))}</prompt>")
        lay = eng.layout(schema)
        plan = eng.plan(lay, prompt, sampling.max_new_tokens)
        enc = eng.encode(lay).encoded
        store = eng.store()
        ref = run_arm(ArmContext(eng.lm, plan, enc, store, sampling), "cached").run
        ref_found.append(case["number"] in ref.text.replace(",", ""))
        for (precision, kg, vg), name in zip(CHOICES, rows):
            qstore = ModuleStore("cpu")
            err_k, err_v, quant_bytes, full_bytes = [], [], 0, 0
            for path, key in enc.module_keys.items():
                entry = store.get(key)
                if not path:  # the anonymous text stays in the compute dtype
                    qstore.put(key, entry)
                    continue
                q = QuantKV.quantize(entry, precision, kg, vg)
                diff = q.dequantize() - entry.kv
                err_k.append(float(diff[:, 0].norm() / entry.kv[:, 0].norm()))
                err_v.append(float(diff[:, 1].norm() / entry.kv[:, 1].norm()))
                quant_bytes += q.nbytes
                full_bytes += entry.nbytes
                qstore.put(key, q)
            run = run_arm(ArmContext(eng.lm, plan, enc, qstore, sampling), "cached").run
            a = agreement(ref, run)
            rows[name].append({"found": case["number"] in run.text.replace(",", ""), "kl": a["first_token_kl"],
                               "agree": a["first_token_agree"], "same_text": a["same_text"],
                               "key_error": statistics.mean(err_k), "value_error": statistics.mean(err_v),
                               "bytes_ratio": quant_bytes / full_bytes})
        for key in list(store.keys()):
            store.evict(key)
        print(f"[{i + 1}/{args.prompts}] fp32={'Y' if ref_found[-1] else 'n'} " +
              " ".join(f"{k}={'Y' if v[-1]['found'] else 'n'}" for k, v in rows.items()), flush=True)
    summary = summarise(rows, ref_found)
    print(table(["storage", "bytes (max)", "key err", "value err", "KL vs fp32", "same text", "found"],
                [[k, f"{s['bytes_ratio']:.1%}", s["key_rel_error"], s["value_rel_error"], s["mean_kl"],
                  s["same_text"], f"{s['found']}/{s['n']}"] for k, s in summary.items() if "bytes_ratio" in s]))
    emit("quant_groups", {"benchmark": "quant_groups", "model": eng.lm.name, "prompts": args.prompts,
                          "modules_per_prompt": args.modules, "machine": machine(),
                          "seconds": round(time.perf_counter() - t0, 1), "summary": summary}, write=not args.quick)


if __name__ == "__main__":
    main()
