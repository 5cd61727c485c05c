"""Compute precision on this machine: fp32 against bf16 for one model, measured side by side.

Both precisions are loaded in one process (module KV stored in the precision each computes in)
and every measurement alternates between them, so a busy machine slows both alike:

* **TTFT** of a full prefill (baseline) and of a cached run (every essay module cached, the
  question's few tokens prefilled) on document-QA prompts of about 1K and 2K tokens; one
  warm-up pair per precision, then ``--reps`` rounds; min / median / max;
* **decode** ms per token of the same runs (``--new-tokens`` each);
* **first-token KL** of bf16 against fp32, baseline and cached, on the needle prompts;
* **needle accuracy** of both, baseline and cached (prefixed): varied needles and confusable ones
  (bench/needles.py).

Prints a table, then one JSON document last (bench/results/precision-MODEL.json), whose figures
docs/models.md quotes (`pml-studio info` and the studio's Model tab point there).

    python bench/precision.py                   # ~15 min on 2 quiet cores (the model: --help)
    python bench/precision.py --rows-out /tmp/p.json   # keep finished parts there; a rerun resumes
    python bench/precision.py --quick           # smoke run: 256 tokens, 1 rep, 2 prompts, no file
    python bench/precision.py --model default   # SmolLM2-135M
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import (bench_model, doc_prompt, doc_schema, emit, essay_chunks, has_roles, machine, model_help,
                          result_name, spread, table)
from bench.needles import confusable_cases, judge, varied_cases
from bench.workloads import SYSTEM, fill_docs, wilson
from engine.arms.registry import Sampling
from engine.arms.compare import agreement
from engine.arms.compare import run_arm
from engine.arms.registry import ArmContext
from engine.model import START_MODEL
from engine.session import Engine

DTYPES = ("float32", "bfloat16")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def ttft_row(engines: dict[str, Engine], target: int, reps: int, new_tokens: int, chunks: list[str], done: dict,
             save) -> dict:
    """Baseline and cached TTFT and decode ms/token per precision, rounds alternating between precisions.

    ``done`` holds the rounds already measured ({dtype: {baseline, cached, decode, same_text}}, lists of
    numbers); ``save`` is called after each new round.
    """
    any_eng = next(iter(engines.values()))
    sampling = Sampling(max_new_tokens=new_tokens)
    docs = fill_docs(any_eng, chunks, target)
    name = f"precision{target}"
    for dt in engines:
        done.setdefault(SHORT[dt], {"baseline": [], "cached": [], "decode": [], "same_text": []})
    setup = {}
    for dt, eng in engines.items():
        lay = eng.layout(doc_schema(name, docs, roles=has_roles(eng)))
        plan = eng.plan(lay, doc_prompt(name, len(docs)), max_new_tokens=new_tokens)
        enc = eng.encode(lay).encoded
        if len(done[SHORT[dt]]["baseline"]) < reps:
            run_arm(ArmContext(eng.lm, plan, None, None, sampling), "baseline")  # warm-up
            run_arm(ArmContext(eng.lm, plan, enc, eng.store(), sampling), "cached")
        setup[dt] = (plan, enc)
    while len(done[SHORT[DTYPES[-1]]]["baseline"]) < reps:
        for dt, eng in engines.items():
            plan, enc = setup[dt]
            base = run_arm(ArmContext(eng.lm, plan, None, None, sampling), "baseline").run
            cached = run_arm(ArmContext(eng.lm, plan, enc, eng.store(), sampling), "cached").run
            d = done[SHORT[dt]]
            d["baseline"].append(base.ttft_ms), d["cached"].append(cached.ttft_ms)
            d["decode"] += [r.decode_ms_per_token for r in (base, cached) if r.decode_ms_per_token is not None]
            d["same_text"].append(base.token_ids == cached.token_ids)
        save()
        print(f"[ttft {target}] round {len(done[SHORT[DTYPES[-1]]]['baseline'])}/{reps} " + " ".join(
            f"{k} baseline {d['baseline'][-1]:.0f} cached {d['cached'][-1]:.0f} ms, {d['decode'][-1]:.0f} ms/token"
            for k, d in done.items()), flush=True)
    for eng in engines.values():
        for key in list(eng.store().keys()):
            eng.store().evict(key)
    plan = setup[DTYPES[0]][0]
    row = {"target_tokens": target, "prompt_tokens": plan.prompt_tokens, "cached_tokens": plan.cached_tokens,
           "uncached_tokens": plan.uncached_tokens, "new_tokens": new_tokens}
    for k, d in done.items():
        row[k] = {"baseline_ttft_ms": spread(d["baseline"][:reps]), "cached_ttft_ms": spread(d["cached"][:reps]),
                  "decode_ms_per_token": spread(d["decode"]), "same_text": all(d["same_text"])}
    return row


def needle_rows(engines: dict[str, Engine], cases: list[dict], label: str, new_tokens: int, rows: list[dict],
                save) -> list[dict]:
    """Each prompt's baseline and cached (prefixed) answer per precision; bf16's first-token KL against fp32.
    ``rows`` already finished are kept; ``save`` is called after each new one."""
    sampling = Sampling(max_new_tokens=new_tokens)
    for i, case in enumerate(cases):
        if i < len(rows):
            continue
        name = f"{label}{i}"
        prompt = doc_prompt(name, case["modules"], question=case["question"])
        runs = {}
        for dt, eng in engines.items():
            lay = eng.layout(doc_schema(name, case["docs"], system=SYSTEM, roles=has_roles(eng)))
            plan = eng.plan(lay, prompt, new_tokens)
            enc = eng.encode(lay).encoded
            runs[dt] = {"baseline": run_arm(ArmContext(eng.lm, plan, None, None, sampling), "baseline").run,
                        "cached": run_arm(ArmContext(eng.lm, plan, enc, eng.store(), sampling), "cached").run}
            for key in list(eng.store().keys()):  # modules are not shared between prompts
                eng.store().evict(key)
        row = {"modules": case["modules"], "answer": case["answer"], "prompt_tokens": plan.prompt_tokens}
        for dt, arms in runs.items():
            for arm, r in arms.items():
                found, confused = judge(r.text, case)
                row[f"{SHORT[dt]} {arm}"] = {
                    "text": r.text, "found": found, "confused": confused,
                    "kl_vs_fp32": round(agreement(runs[DTYPES[0]][arm], r)["first_token_kl"], 6),
                    "kl_vs_own_baseline": round(agreement(arms["baseline"], r)["first_token_kl"], 6)}
        rows.append(row)
        save()
        print(f"[{label} {i + 1}/{len(cases)}] tokens={row['prompt_tokens']} "
              + " ".join(f"{k}={'Y' if v['found'] else 'n'}" for k, v in row.items() if isinstance(v, dict)),
              flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    """Per arm ("fp32 baseline", ..., "bf16 cached"): accuracy with its 95 % interval and KL against fp32."""
    out = {}
    for arm in [k for k, v in rows[0].items() if isinstance(v, dict)]:
        found = sum(r[arm]["found"] for r in rows)
        kl = [r[arm]["kl_vs_fp32"] for r in rows]
        own = [r[arm]["kl_vs_own_baseline"] for r in rows]
        out[arm] = {"accuracy": round(found / len(rows), 4), "found": found, "prompts": len(rows),
                    "ci95": wilson(found, len(rows)), "confused": sum(r[arm]["confused"] for r in rows),
                    "kl_vs_fp32": {"mean": round(sum(kl) / len(kl), 6), "max": round(max(kl), 6)},
                    "kl_vs_own_baseline": {"mean": round(sum(own) / len(own), 6), "max": round(max(own), 6)}}
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help(START_MODEL))
    ap.add_argument("--targets", type=int, nargs="+", default=[1024, 2048], help="prompt lengths for TTFT")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per TTFT run (decode ms/token)")
    ap.add_argument("--prompts", type=int, default=12, help="varied-needle prompts (bench/needles.py)")
    ap.add_argument("--confusable", type=int, default=6, help="confusable-needle prompts (bench/needles.py)")
    ap.add_argument("--modules", type=int, default=4, help="essay modules of ~250 tokens per needle prompt")
    ap.add_argument("--needle-tokens", type=int, default=20, help="tokens decoded per needle answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 256 tokens, 1 rep, 2 prompts of 2 modules")
    ap.add_argument("--rows-out", type=Path, help="keep every finished part in this file; a rerun with the same "
                    "settings resumes from it")
    args = ap.parse_args()
    args.chunk_tokens = 250
    if args.quick:
        args.targets, args.reps, args.new_tokens, args.prompts, args.modules, args.chunk_tokens = [256], 1, 4, 2, 2, 80
        args.confusable = 2
    return args


def print_tables(ttft: list[dict], needles: dict, modules: int) -> None:
    print(table(["prompt", "dtype", "baseline ms (min-max)", "cached ms (min-max)", "decode ms/token"],
                [[r["prompt_tokens"], dt,
                  f'{r[dt]["baseline_ttft_ms"]["median"]} ({r[dt]["baseline_ttft_ms"]["min"]}-'
                  f'{r[dt]["baseline_ttft_ms"]["max"]})',
                  f'{r[dt]["cached_ttft_ms"]["median"]} ({r[dt]["cached_ttft_ms"]["min"]}-'
                  f'{r[dt]["cached_ttft_ms"]["max"]})',
                  r[dt]["decode_ms_per_token"]["median"]] for r in ttft for dt in ("fp32", "bf16")]))
    for label, summary in needles.items():
        if not summary:
            continue
        print(f"{label} needles, {modules} modules")
        print(table(["arm", "accuracy", "95% CI", "confused", "KL vs fp32 (mean/max)", "KL vs own baseline"],
                    [[arm, f'{s["accuracy"]:.0%}', f'{s["ci95"][0]:.0%}-{s["ci95"][1]:.0%}', s["confused"],
                      f'{s["kl_vs_fp32"]["mean"]}/{s["kl_vs_fp32"]["max"]}', s["kl_vs_own_baseline"]["mean"]]
                     for arm, s in summary.items()]))


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    engines, load_s = {}, {}
    model = bench_model(args.model, args.quick, START_MODEL)
    for dt in DTYPES:
        engines[dt] = Engine(model=model.spec, dtype=dt, storage_dtype=dt, persist=False)
        t = time.perf_counter()
        engines[dt].lm
        load_s[SHORT[dt]] = round(time.perf_counter() - t, 2)
    chunks = essay_chunks(engines[DTYPES[0]].codec.encode, args.chunk_tokens)
    kept = json.loads(args.rows_out.read_text()) if args.rows_out and args.rows_out.exists() else {}
    for part in ("ttft", "ttft_rounds"):
        kept.setdefault(part, {})
    kept.setdefault("single", []), kept.setdefault("confusable", [])

    def save():
        if args.rows_out:
            args.rows_out.write_text(json.dumps(kept))

    for target in args.targets:
        if str(target) not in kept["ttft"]:
            kept["ttft"][str(target)] = ttft_row(engines, target, args.reps, args.new_tokens, chunks,
                                                 kept["ttft_rounds"].setdefault(str(target), {}), save)
            save()
    ttft = [kept["ttft"][str(t)] for t in args.targets]
    single = needle_rows(engines, varied_cases(chunks, args.modules, args.prompts, args.seed),
                         "single", args.needle_tokens, kept["single"], save)
    confusable = needle_rows(engines, confusable_cases(chunks, args.modules, args.confusable, args.seed + 1),
                             "confusable", args.needle_tokens, kept["confusable"], save)
    needles = {"single": summarise(single), "confusable": summarise(confusable) if confusable else {}}
    print_tables(ttft, needles, args.modules)
    emit(result_name("precision", model.spec),
         {"benchmark": "precision", "model": engines[DTYPES[0]].lm.name, "device": "cpu", "mode": "prefixed",
          "storage_dtype": "same as compute", "reps": args.reps, "new_tokens": args.new_tokens,
          "needle_prompts": args.prompts, "confusable_prompts": args.confusable, "needle_modules": args.modules, "machine": machine(),
          "seconds": round(time.perf_counter() - t0, 1), "load_s": load_s, "ttft": ttft, "needles": needles,
          "needle_rows": {"single": single, "confusable": confusable}}, write=not args.quick)


if __name__ == "__main__":
    main()
