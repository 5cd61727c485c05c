"""Smaller module memory: what storage precision and retention cost in retrieval, bytes and decode speed.

The needle-in-a-haystack set of `bench/fidelity.py` (the same 48 prompts: 4 and 8 essay modules of
~250 tokens, needle at depth 10 / 50 / 90 %). For each prompt one baseline (full prefill) and one
uncompressed cached run (fp32, prefixed) are the references; then every configuration runs the
cached path again:

* storage precision float16 / bfloat16 / int8 / int4 (whole modules; int8 and int4 in KIVI's layout,
  scales included in the bytes);
* query-agnostic retention 75 / 50 / 30 %, chosen when the modules are encoded: `pyramid` (fewer
  tokens with depth, by the module's own attention), `uniform` (same fraction in every layer) and
  `recent` (last tokens only) — the controls;
* `question` retention 75 / 50 / 30 %: full modules stored, the run's buffer thinned after the
  question was prefilled, by its attention (PyramidInfer's schedule, pooled over 31 tokens);
* int8 storage with question retention 50 %.

Reported per configuration: needle accuracy with a 95 % Wilson interval, stored module bytes and
the KV decoding ran over (relative to the fp32 cached run), cached TTFT and decode ms/token
(medians), and first-token agreement and mean KL against the fp32 cached run and the baseline.
A separate measurement at ~4K tokens (16 modules) times decoding over the full and the thinned
buffers, and the dequantizing copy, side by side (interleaved repetitions, median, min and max).
`assets/memory.png` plots accuracy against bytes.

    python bench/compression.py                        # 48 prompts, all configurations (hours on 2 cores)
    python bench/compression.py --per-setting 12       # 24 prompts
    python bench/compression.py --configs int8 int4 "question 50%"   # a subset (references always run)
    python bench/compression.py --quick                # 2 tiny prompts, 5 configurations, no files written
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import (ROOT, bench_model, doc_schema, emit, essay_chunks, machine, model_help, result_name, spread,
                          table)
from bench.needles import varied_cases
from bench.compressed_runs import label, run_prompt
from bench.workloads import SYSTEM, insert, make_cases, needle, question, wilson

from engine.config import Compression
from engine.arms.registry import Sampling
from engine.arms.compare import run_arm
from engine.arms.registry import ArmContext
from engine.session import Engine

STORAGE = [("float16", 1.0, "pyramid"), ("bfloat16", 1.0, "pyramid"), ("int8", 1.0, "pyramid"),
           ("int4", 1.0, "pyramid")]
AGNOSTIC = [("float32", r, m) for r in (0.75, 0.5, 0.3) for m in ("pyramid", "uniform", "recent")]
QUESTION = [("float32", r, "question") for r in (0.75, 0.5, 0.3)] + [("int8", 0.5, "question")]
CONFIGS = STORAGE + AGNOSTIC + QUESTION
QUICK = [("float16", 1.0, "pyramid"), ("int8", 1.0, "pyramid"), ("int4", 1.0, "pyramid"),
         ("float32", 0.5, "pyramid"), ("float32", 0.5, "question")]
AT_4K = [("fp32 full", "float32", 1.0), ("question 75%", "float32", 0.75), ("question 50%", "float32", 0.5),
         ("question 30%", "float32", 0.3), ("int8", "int8", 1.0), ("int4", "int4", 1.0)]


def summarise(rows: list[dict], names: list[str]) -> dict:
    def mean(rs, key):
        xs = [r[key] for r in rs if r.get(key) is not None]
        return round(statistics.mean(xs), 5) if xs else None

    def median(rs, key):
        xs = [r[key] for r in rs if r.get(key) is not None]
        return round(statistics.median(xs), 2) if xs else None

    out = {}
    for name in ["baseline", "cached fp32", *names]:
        rs = [row[name] for row in rows]
        k = sum(r["found"] for r in rs)
        s = {"accuracy": round(k / len(rs), 4), "found": k, "n": len(rs), "ci95": wilson(k, len(rs)),
             "by_modules": {str(m): round(statistics.mean(row[name]["found"] for row in rows if row["modules"] == m), 4)
                            for m in sorted({row["modules"] for row in rows})}}
        if name != "baseline":
            s.update(bytes_ratio=mean(rs, "store_ratio"), buffer_ratio=mean(rs, "buffer_ratio"),
                     ttft_ms=median(rs, "ttft_ms"), decode_ms_per_token=median(rs, "decode_ms"))
        if name == "cached fp32":
            s.update(agree_base=mean(rs, "first_token_agree"), kl_base=mean(rs, "first_token_kl"))
        elif name != "baseline":
            s.update(copy_ms=median(rs, "copy_ms"), agree_ref=mean(rs, "agree_ref"), kl_ref=mean(rs, "kl_ref"),
                     agree_base=mean(rs, "agree_base"), kl_base=mean(rs, "kl_base"))
        out[name] = s
    return out


def measure_4k(eng: Engine, chunks: list[str], modules: int, reps: int, sampling: Sampling) -> dict:
    """Decode ms/token over the full and the thinned buffers at ~4K tokens, and the dequantizing copy,
    in interleaved repetitions (the machine's load shifts all configurations alike)."""
    rng = random.Random(7)
    docs = list(chunks[:modules])
    name, number = "harbor", str(rng.randrange(1_000_000, 9_999_999))
    docs[modules // 2] = insert(docs[modules // 2], needle(name, number), 0.5)
    schema = doc_schema("k4", docs, system=SYSTEM)
    prompt = ('<prompt schema="k4">' + "".join(f"<doc{j}/>" for j in range(modules)) +
              f" {escape(question(name))}</prompt>")
    lay = eng.layout(schema)
    plan = eng.plan(lay, prompt, sampling.max_new_tokens)
    store = eng.store()
    encoded = {label_: eng.encode(lay, eng.config.with_(storage_dtype=dtype, compression=Compression(r, "question")))
               .encoded for label_, dtype, r in AT_4K}
    runs: dict[str, list] = {label_: [] for label_, _, _ in AT_4K}
    for _ in range(reps):
        for label_, _, _ in AT_4K:
            ctx = ArmContext(eng.lm, plan, encoded[label_], store, sampling)
            runs[label_].append(run_arm(ctx, "cached").run)
    out = {"prompt_tokens": plan.prompt_tokens, "cached_tokens": plan.cached_tokens, "reps": reps,
           "new_tokens": sampling.max_new_tokens, "configs": {}}
    for label_, rs in runs.items():
        enc = encoded[label_]
        dec = [r.decode_ms_per_token for r in rs if r.decode_ms_per_token is not None]
        out["configs"][label_] = {
            "decode_ms_per_token": spread(dec), "ttft_ms": spread([r.ttft_ms for r in rs]),
            "copy_ms": spread([r.copy_ms for r in rs]), "retention_ms": spread([r.retention_ms for r in rs]),
            "buffer_bytes_after_prefill": rs[0].kv_buffer_used_bytes,
            "buffer_bytes_decoded_over": rs[0].kv_buffer_bytes_after_retention,
            "module_store_bytes": sum(store.entry_bytes(k) for p, k in enc.module_keys.items() if p),
            "kv_held_bytes": rs[0].kv_held_bytes, "found": number in rs[0].text.replace(",", ""),
            "decode_tokens": rs[0].decode_tokens}
    for key in list(store.keys()):
        store.evict(key)
    full = out["configs"]["fp32 full"]["decode_ms_per_token"]["median"]
    for c in out["configs"].values():
        c["decode_ratio_to_full"] = round(c["decode_ms_per_token"]["median"] / full, 3) if full else None
    return out


def verdicts(summary: dict, at_4k: dict | None) -> list[str]:
    out = []
    ref, base = summary["cached fp32"]["accuracy"], summary["baseline"]["accuracy"]
    for name, points, limit in (("int8", 5, 0.27), ("int4", 10, 0.16)):
        if name in summary:
            s = summary[name]
            ok = s["accuracy"] >= ref - points / 100 - 1e-9 and s["bytes_ratio"] <= limit
            out.append(f"{name}: {s['accuracy']:.0%} found vs {ref:.0%} fp32 cached (must be within {points} points) "
                       f"at {s['bytes_ratio']:.1%} of fp32 bytes (must be <= {limit:.0%}) -> "
                       f"{'holds' if ok else 'does NOT hold'}")
    for r in (0.75, 0.5, 0.3):
        q, p = f"question {r:.0%}", f"pyramid {r:.0%}"
        if q in summary:
            line = (f"question {r:.0%}: {summary[q]['accuracy']:.0%} found (baseline {base:.0%}); decoding over "
                    f"{summary[q]['buffer_ratio']:.0%} of the full buffer")
            if p in summary:
                line += f"; query-agnostic pyramid at the same retention: {summary[p]['accuracy']:.0%}"
            if r == 0.5:
                near = summary[q]["accuracy"] >= base - 0.10 - 1e-9
                line += f" -> within 10 points of the baseline: {'holds' if near else 'does NOT hold'}"
            out.append(line)
    if at_4k:
        c = at_4k["configs"]
        full, half = c["fp32 full"]["decode_ms_per_token"], c["question 50%"]["decode_ms_per_token"]
        out.append(f"at {at_4k['prompt_tokens']} tokens: decode {half['median']} ms/token with question 50 % vs "
                   f"{full['median']} ms/token with full retention (ratio {c['question 50%']['decode_ratio_to_full']}, "
                   f"{at_4k['reps']} interleaved repetitions) -> "
                   f"{'lower' if half['median'] < full['median'] else 'NOT lower'}")
    return out


def plot(summary: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"storage": "#2471a3", "agnostic": "#b7950b", "question": "#1e8449", "reference": "#555555"}

    def family(name: str) -> str:
        if name == "cached fp32":
            return "reference"
        if "question" in name:
            return "question"
        return "agnostic" if "%" in name else "storage"

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120, sharey=True)
    for ax, key, title in ((axes[0], "bytes_ratio", "stored module bytes (% of fp32)"),
                           (axes[1], "buffer_ratio", "KV decoding runs over (% of full)")):
        for name, s in summary.items():
            if name == "baseline" or s.get(key) is None:
                continue
            x, y = s[key] * 100, s["accuracy"] * 100
            lo, hi = s["ci95"][0] * 100, s["ci95"][1] * 100
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", color=colours[family(name)], capsize=2,
                        ms=5, alpha=0.9)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.axhline(summary["baseline"]["accuracy"] * 100, color="#c0392b", lw=1, ls="--")
        ax.set_xlabel(title)
        ax.set_xlim(0, 108)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("needle found (%), 95 % CI")
    axes[0].set_ylim(0, 105)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=f) for f, c in
               (("storage precision", colours["storage"]), ("query-agnostic retention", colours["agnostic"]),
                ("question retention", colours["question"]), ("fp32 cached", colours["reference"]))]
    handles.append(plt.Line2D([], [], color="#c0392b", ls="--", label="baseline (full prefill)"))
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("Module memory against needle accuracy — SmolLM2-135M, greedy", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--per-setting", type=int, default=24, help="prompts per number of modules")
    ap.add_argument("--new-tokens", type=int, default=28)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", nargs="+", default=None, help="labels of the configurations to run (default all)")
    ap.add_argument("--reps-4k", type=int, default=3, help="repetitions of the ~4K-token decode measurement")
    ap.add_argument("--rows", default=None, help="append each prompt's row to this JSON-lines file as it is done")
    ap.add_argument("--from-rows", default=None, help="summarise a rows file instead of running the needle set")
    ap.add_argument("--at-4k-json", default=None, help="read the ~4K-token measurement from this file if it exists, "
                    "else measure it and write it there")
    ap.add_argument("--only-4k", action="store_true", help="the ~4K-token measurement only (with --at-4k-json)")
    ap.add_argument("--start", type=int, default=0, help="skip the first prompts (resume a --rows file)")
    ap.add_argument("--quick", action="store_true", help="2 prompts of 2 small modules, 5 configurations, 3 new tokens")
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--needles", choices=("magic", "varied"), default="magic",
                    help="magic numbers (the set measured on SmolLM2) or varied facts (bench/needles.py)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    configs = [c for c in CONFIGS if args.configs is None or label(c) in args.configs]
    chunk_tokens, modules_4k = 250, 16
    if args.quick:
        args.modules, args.per_setting, chunk_tokens, modules_4k, args.reps_4k = [2], 2, 40, 4, 1
        args.new_tokens = 3  # decoding is most of a smoke run's time; two steps show every figure
        configs = QUICK
    eng = Engine(model=bench_model(args.model, args.quick).spec, persist=False)
    chunks = essay_chunks(eng.codec.encode, chunk_tokens)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    t0 = time.perf_counter()
    made_by: list[str] = []  # the commands that measured what a --from-rows / --at-4k-json run summarises
    if args.rows:
        with open(args.rows + ".command", "a") as f:  # a resumed file keeps every command that wrote to it
            f.write(_command() + "\n")
    if args.only_4k:
        at_4k = {"command": _command(), **measure_4k(eng, chunks, modules_4k, args.reps_4k, Sampling(32))}
        Path(args.at_4k_json).write_text(json.dumps(at_4k, indent=1))
        print(json.dumps(at_4k))
        return
    if args.from_rows:
        rows = [json.loads(line) for line in open(args.from_rows) if line.strip()]
        made_by += [c for c in Path(args.from_rows + ".command").read_text().split("\n") if c.strip()]
    else:
        rows = run_cases(eng, chunks, args, configs, sampling)
    names = [label(c) for c in configs if label(c) in rows[0]]
    summary = summarise(rows, names)
    if args.at_4k_json and Path(args.at_4k_json).exists():
        at_4k = json.loads(Path(args.at_4k_json).read_text())
        made_by.append(at_4k.get("command", args.at_4k_json))
    else:
        at_4k = measure_4k(eng, chunks, modules_4k, args.reps_4k, Sampling(max_new_tokens=3 if args.quick else 32))
    notes = verdicts(summary, at_4k)
    print_summary(summary, at_4k, notes)
    name = result_name("compression", args.model)
    if not args.quick:
        plot(summary, ROOT / "assets" / f"{name.replace('compression', 'memory')}.png")
    emit(name, {"benchmark": "compression", "model": eng.lm.name, "needles": args.needles, "prompts": len(rows),
                         "modules_per_prompt": sorted({r["modules"] for r in rows}), "new_tokens": args.new_tokens,
                         "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
                         "module_bytes_fp32": [r["module_bytes_fp32"] for r in rows], "summary": summary,
                         "at_4k": at_4k, "verdicts": notes, "measured_by": made_by, "rows": rows},
         write=not args.quick)


def run_cases(eng, chunks, args: argparse.Namespace, configs: list, sampling: Sampling) -> list[dict]:
    """Every prompt of the needle set from --start, each row appended to --rows as it is done."""
    rows = []
    cases = make_cases(chunks, args.modules, args.per_setting, [0.1, 0.5, 0.9], args.seed) \
        if args.needles == "magic" else [c for m in args.modules for c in varied_cases(chunks, m, args.per_setting,
                                                                                        args.seed + m)]
    # fidelity.py's prompts, taken alternately from each number of modules (a partial run covers both)
    cases = [c for group in zip(*[[c for c in cases if c["modules"] == m] for m in args.modules]) for c in group]
    for i, case in enumerate(cases):
        if i < args.start:
            continue
        rows.append(run_prompt(eng, case, i, configs, sampling))
        if args.rows:
            with open(args.rows, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        print(f"[{i + 1}/{len(cases)}] modules={case['modules']} " + " ".join(
            f"{k}={'Y' if v['found'] else 'n'}" for k, v in rows[-1].items() if isinstance(v, dict)), flush=True)
    return rows


def print_summary(summary: dict, at_4k: dict, notes: list[str]) -> None:
    print(table(["config", "stored", "decoded over", "TTFT ms", "decode ms/tok", "found", "95% CI", "agree vs cached",
                 "KL vs cached", "KL vs baseline"],
                [[k, _pct(s.get("bytes_ratio")), _pct(s.get("buffer_ratio")), s.get("ttft_ms", "-"),
                  s.get("decode_ms_per_token", "-"), f"{s['accuracy']:.0%}", f"{s['ci95'][0]:.0%}-{s['ci95'][1]:.0%}",
                  s.get("agree_ref", "-"), s.get("kl_ref", "-"), s.get("kl_base", "-")] for k, s in summary.items()]))
    print(table(["at ~4K tokens", "decode ms/tok (min-max)", "ratio", "copy ms", "buffer MiB decoded over",
                 "stored MiB"],
                [[k, f"{c['decode_ms_per_token']['median']} ({c['decode_ms_per_token']['min']}-"
                     f"{c['decode_ms_per_token']['max']})", c["decode_ratio_to_full"], c["copy_ms"]["median"],
                  f"{c['buffer_bytes_decoded_over'] / 2**20:.1f}", f"{c['module_store_bytes'] / 2**20:.1f}"]
                 for k, c in at_4k["configs"].items()]))
    for v in notes:
        print(v)


def _command() -> str:
    import shlex
    import sys

    return shlex.join(["python", "bench/compression.py", *sys.argv[1:]])


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


if __name__ == "__main__":
    main()
