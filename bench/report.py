"""The benchmark pages, generated from bench/results/*.json (never typed by hand).

    python bench/report.py                 # print the Measured section (docs/benchmarks.md)
    python bench/report.py --headline      # print the README's headline block
    python bench/report.py --write-readme  # write both, between their markers (--write is the same)

docs/benchmarks.md holds the whole Measured section; README.md holds a short headline block drawn
from the same files. A test checks that both hold exactly what this prints, so the numbers there are
always those of the result files, which the benchmark commands named with them wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README, PAGE = ROOT / "README.md", ROOT / "docs" / "benchmarks.md"
START, END = "<!-- measured:start -->", "<!-- measured:end -->"  # the section, in docs/benchmarks.md
HEAD_START, HEAD_END = "<!-- headline:start -->", "<!-- headline:end -->"  # the headline, in README.md
ASSETS = "../assets"  # images as docs/benchmarks.md links them
ROUTED = "prefixed+route 0"  # the routed arm keeping every module whose pull reaches the threshold


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine_line(d: dict) -> str:
    m = d["machine"]
    gpu = (m.get("gpu") or "a CUDA GPU") if m.get("cuda") else "no GPU"
    load = f", load average {m['loadavg_1min']:g} when it ended" if m.get("loadavg_1min") is not None else ""
    return f"{m['date']}, {m['threads']} CPU threads ({m['cpu']}), {gpu}, torch {m['torch']}{load}"


LEAD = "qwen2.5-coder-0.5b"  # the model the Measured section leads with (issue 17): one that answers
BESIDE = "SmolLM2-135M-Instruct"  # the default model, measured beside it on the same varied sets


def beside(slug: str) -> list[str]:
    """The same varied needle sets on another model (bench/results/fidelity-SLUG.json), one line per set."""
    f = load(f"fidelity-{slug}")
    if not f:
        return []
    out = []
    for label, summary in [(f"{n} modules, one fact asked", s) for n, s in f["frontier"].items()] + \
            [(f"confusable, {f['confusable_modules']} modules", f.get("confusable") or {})]:
        if summary:
            n = next(iter(summary.values()))["n"]
            out.append(f"{label} ({n} prompts): " + ", ".join(
                f"{'baseline' if a == 'baseline' else f'`{a}`'} {v['accuracy']:.0%} "
                f"({v['ci95'][0]:.0%}–{v['ci95'][1]:.0%})" for a, v in summary.items()))
    return [f"*The same sets on {f['model']}* — `{f['command']}` ({machine_line(f)}): " + "; ".join(out) + ".", ""]


def section() -> str:
    out = [START, ""]
    out += lead_section(LEAD)
    out += decode_section(load(f"decode-{LEAD}"))
    out += prefill_section(load("prefill"))
    out += browser_section(load("browser-compare"))
    if len(out) > 2:
        out += ["## SmolLM2-135M-Instruct (the default model)", ""]
    ttft, scaling, memory = load("ttft"), load("scaling"), load("memory")
    fidelity, compression = load("fidelity"), load("compression")
    if ttft:
        out += ttft_section(ttft)
    if scaling:
        f = scaling["fits"]
        out += [f"**Scaling** — `python bench/scaling.py` ({machine_line(scaling)}): baseline TTFT grows as "
                f"tokens^{f['baseline_ttft_power']['exponent']}, cached TTFT as "
                f"tokens^{f['cached_ttft_power']['exponent']}; cached TTFT against cached tokens is linear "
                f"({f['cached_ttft_vs_cached_tokens_linear']['slope_ms_per_token'] * 1000:.1f} µs per cached token, "
                f"R² {f['cached_ttft_vs_cached_tokens_linear']['r2']}). "
                + _floor_clause(scaling["results"])
                + ("The paper's GPU settings are measured on a lent GPU below." if gpu_runs() else
                   "No GPU here, so the paper's GPU-storage cases were not run."),
                "", f"![TTFT against prompt length]({ASSETS}/scaling.png)", ""]
    out += gpu_section()
    out += peak_memory_section(load("peak-memory"))
    workload = load("workload")
    if workload:
        out += workload_section(workload)
    if memory:
        fam = {x["model"]: x for x in memory["families"]}
        picks = [m for m in ("Llama-2-7B", "Llama-2-13B", "Llama-2-70B", "Falcon-7B", "MPT-30B", "Llama-3.1-8B",
                             "SmolLM2-135M") if m in fam]
        out += [f"**Memory per cached token** — `python bench/memory.py` (from configs alone, fp16): " +
                ", ".join(f"{m} {fam[m]['fp16_mb_per_token']:.3g} MB" for m in picks) +
                f". The loaded model stores {memory['loaded']['kv_bytes_per_token']:,} bytes per token in "
                f"{memory['loaded']['dtype']}; measured store bytes equal the prediction for "
                f"{sum(s['match'] for s in memory['samples'])} of {len(memory['samples'])} sample schemas.", ""]
    if fidelity and "frontier" in fidelity:
        out += repair_section(fidelity)
    elif fidelity:
        s = fidelity["summary"]
        out += [f"**Fidelity** — `python bench/fidelity.py` ({machine_line(fidelity)}): {fidelity['prompts']} "
                "needle-in-a-haystack prompts over Paul Graham essay modules (4 and 8 modules of ~250 tokens), "
                "greedy; found = the needle's 7-digit number is in the answer.", "",
                "| path | needle found | 95 % CI | first token agrees with baseline | mean first-token KL | "
                "same text | ROUGE-L vs baseline |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        names = {"baseline": "baseline (full prefill)", "prefixed": "cached, `contextual` (default)",
                 "isolated": "cached, `isolated` (the paper's scheme)", "scaffold": "cached, scaffold over all modules"}
        for p, v in s.items():
            extra = ("| — | — | — | — |" if p == "baseline" else
                     f"| {v['first_token_agreement']:.0%} | {v['mean_first_token_kl']:.3f} | "
                     f"{v['same_text_rate']:.0%} | {v['mean_rouge_l']:.2f} |")
            out.append(f"| {names.get(p, p)} | **{v['accuracy']:.0%}** ({v['found']}/{v['n']}) | "
                       f"{v['ci95'][0]:.0%}–{v['ci95'][1]:.0%} " + extra)
        bym = fidelity["by_modules"]
        out += ["", "By number of modules: " + "; ".join(
            f"{k} modules: " + ", ".join(f"{p} {v[p]:.0%}" for p in ("baseline", "prefixed", "isolated", "scaffold"))
            for k, v in bym.items()) + ".", ""]
    if compression:
        out += compression_section(compression)
    families = load("families")
    if families:
        out += families_section(families)
    out += other_models()
    if len(out) == 2:
        out += ["No benchmark results yet: run `make bench`.", ""]
    out.append(END)
    return "\n".join(out)


def ttft_section(ttft: dict) -> list[str]:
    floor = all("floor_ms" in r for r in ttft["results"])
    out = [f"**Time to first token** — `python bench/ttft.py` ({machine_line(ttft)}; {ttft['model']}, "
           f"{ttft['dtype']}, {ttft['storage']} storage, `{ttft['mode']}` mode, median of {ttft['reps']} "
           f"after a warm-up; cached TTFT includes copying the modules' KV into the run's buffer):", ""]
    if not floor:
        out += ["| prompt tokens | cached | uncached | baseline TTFT | cached TTFT | of which KV copy | speedup | "
                "decode ms/token baseline / cached |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ttft["results"]:
            out.append(f"| {r['prompt_tokens']} | {r['cached_tokens']} | {r['uncached_tokens']} | "
                       f"{r['baseline_ttft_ms'] / 1000:.2f} s | {r['cached_ttft_ms']:.0f} ms | "
                       f"{r['cached_copy_ms']:.1f} ms | **{r['speedup']:.1f}×** | "
                       f"{r['baseline_decode_ms_per_token']:.0f} / {r['cached_decode_ms_per_token']:.0f} |")
        return out + [""]
    out += ["| prompt tokens | cached | uncached | baseline TTFT | cached TTFT | of which KV copy | speedup "
            "(range over reps) | floor: stock forward over a DynamicCache (min–max) | cached / floor | "
            "floor / no cache |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ttft["results"]:
        out.append(f"| {r['prompt_tokens']} | {r['cached_tokens']} | {r['uncached_tokens']} | "
                   f"{r['baseline_ttft_ms'] / 1000:.2f} s | {r['cached_ttft_ms']:.0f} ms | {r['cached_copy_ms']:.1f} ms | "
                   f"**{r['speedup']:.1f}×** ({r['speedup_min']:.1f}–{r['speedup_max']:.1f}×) | "
                   f"{r['floor_ms']:.0f} ms ({r['floor_ms_min']:.0f}–{r['floor_ms_max']:.0f}) | "
                   f"**{r['cached_over_floor']:.2f}** | {r['floor_over_nocache']:.2f} |")
    return out + ["", "The speedup is a range: it divides by the baseline, which depends on how fast the machine "
                  "prefills (machines of the same kind differ by 1.6× here), and by the load. The floor does "
                  "not: it is stock transformers doing the cached path's work (the same uncached tokens at the "
                  "same positions over an ordinary `DynamicCache` of the same cached KV), timed in the same "
                  "process. `cached / floor` ≤ 1 means the cached path is no slower than that; `floor / no cache` "
                  "is what attending over the cache adds to prefilling the uncached tokens alone.", ""]


def lead_section(slug: str) -> list[str]:
    """The lead model's results (fidelity with varied needles and blend, workload, precision, TTFT), if measured."""
    fid, work, prec, ttft = (load(f"{b}-{slug}") for b in ("fidelity", "workload", "precision", "ttft"))
    # compression-SLUG.json and first_compare.json are read further down
    if not (fid or work or prec or ttft):
        return []
    model = next(d for d in (fid, work, prec, ttft) if d)["model"]
    out = [f"## {model} (`--model {slug}`, `make qwen` or one click in the Model tab)", ""]
    if fid:
        out += lead_fidelity(fid, slug)
    exp = load(f"fidelity-blend-{slug}")
    if exp and exp.get("confusable"):
        n = next(iter(exp["confusable"].values()))["n"]
        made = " then ".join(f"`{c}`" for c in (exp.get("collected_by") or []) + [exp["command"]])
        out += [f"**Blend, further: a later check layer and larger R** — {made} ({machine_line(exp)}): the "
                f"same {n} confusable prompts of {exp['confusable_modules']} modules. `+check L`: the deviation (or the "
                "question's attention) is read at layer L, so the selection pass runs layers 0..L over the whole "
                "prompt; without it, layer 1 as in CacheBlend.", ""] + confusable_table(exp)
        out += [f"![Blend variants: accuracy against TTFT]({ASSETS}/frontier-blend-{slug}.png)", ""]
    routed = load(f"fidelity-routed-{slug}")
    if routed:
        out += routed_section(routed, load(f"routing-{slug}"), load(f"routed-greetings-{slug}"))
    for name in ("single", "two", "two-heldout"):
        more = load(f"fidelity-routed-{name}-{slug}")
        if more:
            out += routed_section(more, None, None, further=True)
    span = load(f"spanning-{slug}")
    if span:
        out += spanning_section(span)
    shares = load(f"spanning-shares-{slug}")  # issue 47: the routed arm's partial recompute
    if shares:
        out += spanning_section(shares, "Questions that span modules: partial recompute")
    served = load(f"serve-{slug}")
    if served:
        out += serve_section(served)
    reuse = load(f"vllm-reuse-{slug}")
    if reuse:
        out += vllm_reuse_section(reuse)
    cli = load(f"cli-decode-{slug}")
    if cli:
        d = cli["decode_ms_per_token"]
        out += [f"**What `pml-studio run --model {slug}` decodes at with no `--weights`** — `{cli['command']}` "
                f"({machine_line(cli)}): the CLI chose {', '.join(cli['weights'])} weights; {d['median']} ms/token median "
                f"({d['min']}–{d['max']}) over {len(cli['runs'])} runs of the samples.", ""]
    ape = load(f"fidelity-ape-{slug}")
    if ape and ape.get("confusable"):
        out += ape_section(ape)
    routed_work = load(f"workload-int8-{slug}")
    if routed_work and "routed" in routed_work["arms"]:
        out += workload_section(routed_work, f"workload-int8-{slug}")
    out += beside(BESIDE)
    if work:
        out += workload_section(work, f"workload-{slug}")
    small = load(f"workload-{BESIDE}")
    if small:
        out += workload_section(small, f"workload-{BESIDE}")
    out += peers_section(load(f"peers-{slug}"), load(f"peers-kvpress-{slug}"), f"peers-{slug}",
                         load(f"peers-lengths-{slug}"))
    comp = load(f"compression-{slug}")
    if comp:
        out += compression_section(comp, f"memory-{slug}")
    if prec:
        out += precision_section(prec)
    first = load("first_compare")
    if first:
        out += [f"**What a newcomer waits for** — `{first['command']}` ({machine_line(first)}): the studio's Compare "
                f"on the `{first['sample']}` sample (three arms, {first['new_tokens']} new tokens at most), in one "
                f"process after loading the converted model; later = {first['reps']} more Compares, median "
                "(min–max). The bar for the studio's default model: first Compare ≤ 30 s, later ≤ 10 s.", "",
                "| model | dtype | load | first Compare | later Compare | tokens per arm | modular answer = baseline | "
                "meets the bar |", "|---|---|---:|---:|---:|---:|---:|:-:|"]
        for r in first["results"]:
            lc = r["later_compare_s"]
            out.append(f"| {r['model']} | {r['dtype']} | {r['load_s']:.1f} s | {r['first_compare_s']:.1f} s | "
                       f"{lc['median']:.1f} s ({lc['min']:.1f}–{lc['max']:.1f}) | "
                       + " / ".join(str(a["new_tokens"]) for a in r["arms"].values())
                       + f" | {'yes' if r['modular_same_text'] else 'no'} | {'✓' if r['meets_default_bar'] else '✗'} |")
        out.append("")
    if ttft:
        lines = "; ".join(f"{r['prompt_tokens']} tokens: {r['baseline_ttft_ms'] / 1000:.2f} s → "
                          f"{r['cached_ttft_ms']:.0f} ms (**{r['speedup']:.1f}×**)" for r in ttft["results"])
        out += [f"**Time to first token** — `{ttft['command']}` ({machine_line(ttft)}; {ttft['dtype']}, median of "
                f"{ttft['reps']} after a warm-up, cached TTFT includes the KV copy): {lines}.", ""]
    return out


def routed_section(f: dict, routing: dict | None, greetings: dict | None, further: bool = False) -> list[str]:
    """The routed arm (issue 27): its ceilings and accuracy per set, where the question's pull points, greetings.
    ``further``: a later run of other sets, introduced by its command only."""
    if further:
        out = [f"**Question-routed reuse, further sets** — `{f['command']}` ({machine_line(f)}; {f['model']}, "
               f"{f.get('weights', 'fp32')} weights, greedy, up to {f['new_tokens']} new tokens, twice that for two "
               "facts).", ""]
    else:
        out = [f"**Question-routed reuse** — `{f['command']}` ({machine_line(f)}; {f['model']}, "
               f"{f.get('weights', 'fp32')} weights, greedy, up to {f['new_tokens']} new tokens, twice that for two "
               "facts). `+route K`: the routed arm keeping the K modules with the strongest pull (0: every module "
               "whose pull reaches 0.95, the default; engine/arms/routed.py); `+oracle`: only the asked module(s) "
               "visible, the ceiling of routing; `+oracle recompute`: the asked module(s) recomputed in context, the "
               "ceiling of recomputing them.", ""]
    for size, summary in f["frontier"].items():
        n = next(iter(summary.values()))["n"]
        if n > 1 or not further:
            out += [f"*Single facts, {size} modules ({n} prompts):*", ""] + _arm_rows(summary) + [""]
    if f.get("confusable"):
        out += [f"*Confusable facts, {f['confusable_modules']} modules ({f['confusable_prompts']} prompts):*", ""]
        out += confusable_table(f)
    if f.get("two_fact"):
        out += [f"*Two facts, one question naming two subjects whose facts sit in two of {f['confusable_modules']} "
                f"confusable modules ({next(iter(f['two_fact'].values()))['n']} prompts; found = both answers, each with its own subject):*", ""]
        out += confusable_table({"confusable": f["two_fact"], "confusable_rows": f["two_fact_rows"]})
    if routing:
        lines = []
        for label, name in (("confusable", "confusable"), ("two_fact", "two-fact")):
            got = routing.get(label) or {}
            if got:
                pull, mass = got["pull"]["best_window"], got["mass"]["best_window"]
                now = [w for w in got["pull"]["windows"] if w["layers"] == [routing["scout_layers_now"][0],
                                                                            routing["scout_layers_now"][-1]]]
                lines.append(f"{name}: by pull, layers {now[0]['layers'][0]}–{now[0]['layers'][1]} (the scout's) "
                             f"{now[0]['top']}/{now[0]['n']}, best window {pull['layers'][0]}–{pull['layers'][1]} "
                             f"{pull['top']}/{pull['n']}; by summed attention mass, best window "
                             f"{mass['layers'][0]}–{mass['layers'][1]} {mass['top']}/{mass['n']}" if now else name)
        out += [f"Where the question points — `{routing['command']}` ({machine_line(routing)}): how many prompts rank "
                "the asked module(s) first (both in the top 2 for two facts) — " + "; ".join(lines) + ".", ""]
    if greetings:
        out += [f"A question that needs no module — `{greetings['command']}`: {greetings['prompts']} greetings over 8 "
                "modules, the routed arm's answer the same text as the modular arm's: " + ", ".join(
                    f"`{k}` {v}/{greetings['prompts']}" for k, v in greetings["same_text"].items()) + ".", ""]
    return out


def _chosen(f: dict) -> str:
    rejected = ", ".join(f"`{a}`" for a in f.get("rejected_by_confirm", []))
    if f["chosen_on_tune"]:
        return f"`{f['chosen_on_tune']}`" + (f" (rejected by the confirm splits: {rejected})" if rejected else "")
    return f"none left: the confirm splits rejected {rejected}, every setting the tune split keeps"


# Why each confirm split was drawn, after its heading ({arm}: the routed arm it ran)
CONFIRM_NOTES = {
    "confirm": "only the baseline and `{arm}`, the routed arm at the engine's defaults of the time. Its share was kept "
               "after the held-out split had been read, so held-out no longer measures it without bias; this split was "
               "drawn and run once, after that choice.",
    "confirm2": "the same two arms on two-fact prompts only, drawn after confirm had been read and after the tune split, "
                "extended to 12 prompts per phrasing, had chosen the same share again. The two-fact line is judged on "
                "both confirm splits together (`confirm+confirm2`), as was decided before confirm2 ran.",
    "confirm3": "the baseline and `{arm}`, on two-fact prompts only. After confirm and confirm2 had rejected share 20, "
                "the default moved to the next-cheapest setting the tune split keeps in every phrasing and set, as was "
                "decided before confirm2 had finished; this split, drawn after that, is where it is judged.",
    "confirm4": "the baseline and `{arm}`, on two-fact prompts only. After confirm3 had rejected share 30, the tune "
                "split's `both` prompts were extended to 24 and shares 45 and 60 and share 30 with the clause focus "
                "measured on every tune prompt; the rule chose again, as was decided before those runs, and this split, "
                "drawn after, is where the choice is judged.",
}


def spanning_section(f: dict, title: str = "Questions that span modules") -> list[str]:
    """Questions that span modules (issue 38): per split, set and phrasing, each arm's found (two facts) or recall
    (every module) and its mean TTFT over the baseline's."""
    out = [f"### {title}", "",
           f"`{f['command']}` ({machine_line(f)}; {f['model']}, {f['weights']} weights). Two facts from two of 8 "
           "modules (found = both answers, each with its own subject) and every module's fact (recall = the share of "
           "the answers given), in three phrasings each; the routed arm's rules were chosen on the `tune` split "
           f"(seed {f['seeds']['tune']}) and are only reported on `heldout` (seed {f['seeds']['heldout']}). `only asked`: "
           "the full prefill of a prompt holding only the asked modules (the ceiling). TTFT × baseline: the arm's mean "
           "TTFT over the baseline's on the same prompts.", ""]
    if "chosen_on_tune" in f:  # issue 47: the routed arm's share settings, one chosen on the tune split
        out += [f"`+share R`: the routed arm recomputing R % of its kept modules' tokens (those the question attends to "
                "most, half of them spread over every kept module) plus each module's first 4 (`+sinks 0`: without "
                "them); `+share 100` is the routed arm before issue 47 (every kept token recomputed). Chosen on the tune "
                "split (the cheapest share keeping two facts within 5 points of the baseline's in each phrasing and "
                "recall within 10, among the settings run on every tune prompt and not rejected by a confirm split): "
                f"{_chosen(f)}. Held-out frontier, one point per setting:", "",
                "![accuracy against TTFT × baseline, held-out](../assets/spanning-frontier.png)", ""]
    for split, note in CONFIRM_NOTES.items():  # the splits drawn after held-out was read, each for one default
        if split in f["summary"]:
            out += [f"**{split}** (seed {f['seeds'][split]}): " + note.format(arm=f["arms_run"][split][1]), ""]
    rep = f["summary"].get("repeats")
    if rep:  # the identical-repeat line: routed (the API's default) against the prefix arm
        out += [f"**Identical repeats** ({rep['sends']} sends after the first, held-out two-fact and every-module "
                f"prompts, the prefix cache warmed in the prompts' own order): routed TTFT "
                f"{rep['routed_ms']['median']} ms (min {rep['routed_ms']['min']}, max {rep['routed_ms']['max']}) "
                f"against the prefix arm's {rep['prefix_ms']['median']} ms ({rep['prefix_ms']['min']}–"
                f"{rep['prefix_ms']['max']}); routed / prefix {rep['routed_vs_prefix']['median']} "
                f"({rep['routed_vs_prefix']['min']}–{rep['routed_vs_prefix']['max']}), not slower in "
                f"{rep['routed_not_slower']} of {rep['sends']}; paths " + ", ".join(
                    f"{p} {n}" for p, n in sorted(rep["paths"].items())) + "; share of the prompt read back "
                f"{rep['routed_reused_share']['min']:.1%}–{rep['routed_reused_share']['max']:.1%}.", ""]
    for split, groups in f["summary"].items():
        if split == "repeats":
            continue
        out += [f"**{split}**", "", "| set | modules | phrasing | arm | found | recall | TTFT × baseline |",
                "|---|---|---|---|---|---|---|"]
        for key, arms in groups.items():
            kind, modules, phrasing = key.split("/")
            for arm, v in arms.items():
                ratio = v.get("mean_ttft_vs_baseline", v.get("mean_ttft_vs_prefixed"))
                ref = "" if "mean_ttft_vs_baseline" in v else " (× modular)"
                recall = f"{v['recall']:.0%}" if "recall" in v else "–"
                out.append(f"| {kind} | {modules} | {phrasing} | `{arm}` | {_found(v, count=True)} | {recall} | "
                           f"{'–' if ratio is None else f'{ratio:.2f}{ref}'} |")
        out.append("")
    return out


def serve_section(f: dict) -> list[str]:
    """The mixed workload through the OpenAI API (bench/serve.py): each configuration's client-side times and answers,
    llama.cpp's server beside, the API's overhead and the default arm it decided."""
    llama = f["configs"].get("llama.cpp server")
    out = ["### Through the OpenAI API, against llama.cpp's server", "",
           f"`{f['command']}` ({machine_line(f)}; {f['model']}, {f['weights']} weights). The mixed workload's "
           f"{f['prompts_sent']} prompts ({f['modules']} confusable essay modules, 2–4 per prompt, any order) sent by the "
           "official `openai` client as a RAG app sends them (a system message, one content part per document, the "
           f"question), streamed, greedy, {f['new_tokens']} new tokens at most; each configuration warmed once with all "
           "documents in order. Times are the client's: to the first streamed token and to the last; `transparent`: the "
           "messages as they are; `explicit`: the same documents as a PML schema named in `pml`. llama.cpp: "
           "`llama_cpp.server` (llama-cpp-python) on the same GGUF and threads, prompt cache on (`--cache`)."
           + (f" vLLM: its OpenAI server ({f['vllm_server']['version']}, {f['vllm_server']['dtype']}) on the same "
              "model's converted folder, every core, prefix caching on." if f.get("vllm_server") else ""), "",
           "| configuration | TTFT min / median / max | mean TTFT | × llama.cpp | last token (median) | decode ms/token "
           "| found | cached / document tokens |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, v in f["configs"].items():
        t = v["ttft_ms"]
        vs = f"{v['mean_ttft_ms'] / llama['mean_ttft_ms']:.2f}" if llama else "–"
        share = v.get("cached_share_of_documents", {}).get("median")
        out.append(f"| {name} | {_ms(t['min'])} / {_ms(t['median'])} / {_ms(t['max'])} | {_ms(v['mean_ttft_ms'])} | "
                   f"{vs} | {_ms(v['last_token_ms']['median'])} | {v['decode_ms_per_token']['median']} | "
                   f"{v['found']}/{v['of']} | {'–' if share is None else f'{share:.2f}'} |")
    out.append("")
    served = [v["overhead_ms"]["median"] for v in f["configs"].values() if "overhead_ms" in v]
    if served:
        out.append(f"The client's TTFT less the server's own (`pml.ttft_ms`): median {min(served):.0f}–{max(served):.0f} ms "
                   "per configuration (HTTP, the request's compilation to PML, the event stream).")
    for arm, o in f.get("api_overhead", {}).items():
        out.append(f"API overhead, `{arm}`: the API's median TTFT {_ms(o['api_ttft_ms']['median'])} against "
                   f"{_ms(o['run_ttft_ms']['median'])} for the same explicit prompts run in-process by `Engine.compare` "
                   f"(what `pml-studio run` runs): {o['median_overhead_ms']:.0f} ms per request "
                   f"({o['median_overhead_share']:+.1%}).")
    d = f.get("default_arm")
    if d:
        why = "; ".join(f"`{a}`: {'qualifies' if v['qualifies'] else ', '.join(v['why_not'])}"
                        for a, v in d["candidates"].items())
        out += ["", f"Default arm decided by this run: **`{d['arm']}`** — {d['rule']} ({why})."]
    return out + [""]


def vllm_reuse_section(f: dict) -> list[str]:
    """What vLLM's prefix cache reuses of recurring, reordered and subset module sets (bench/vllm_reuse.py), against
    the studio's arms on the same prompts, and the vllm arm's agreement with the local baseline."""
    a, v = f["vllm_agreement"], f["vllm"]
    shared = f" Run beside other work on the shared machine ({f['shared_machine']}): compare ratios, not absolute times." \
        if f.get("shared_machine") else ""
    out = ["### What vLLM's prefix cache reuses of a schema's modules", "",
           f"`{f['command']}` ({machine_line(f)}; {f['model']}: the studio's arms fp32, {v['version']} in "
           f"{v['dtype']}, prefix caching on). {f['modules']} essay modules of {f['module_tokens']} tokens with "
           f"confusable facts, {f['per_set']} prompts a set, one fact asked each, greedy, {f['new_tokens']} new tokens; "
           "every cache warmed once with all modules in schema order. *recurring*: every module in schema order; "
           "*reordered*: every module in another order — the PML prompt (and the PML front) places them in schema "
           "order, `vllm, app's order` is vLLM sent the app's order; *subset*: some modules in schema order, not a "
           "run from the first. TTFT: the studio's arms in-process, vLLM at the client over HTTP on the same "
           f"machine.{shared}", "",
           "| set | arm | mean TTFT | min / median / max | found | prompt reused (median) |",
           "|---|---|---:|---|---:|---:|"]
    for name, arms in f["summary"].items():
        for arm, r in arms.items():
            t = r["ttft_ms"]
            out.append(f"| {name} | {arm} | {_ms(r['mean_ttft_ms'])} | {_ms(t['min'])} / {_ms(t['median'])} / "
                       f"{_ms(t['max'])} | {r['found']}/{r['of']} | {r['reused_share']['median']:.0%} |")
    out += ["", f"The vllm arm against the local baseline, {a['prompts']} prompts (local fp32, vLLM {v['dtype']}): "
                f"the same greedy tokens in {a['same_text']}, the same first token in {a['first_token_agree']}.", ""]
    return out


def cell_of(v: dict) -> str:
    return f"{v['accuracy']:.0%} ({v['found']}/{v['n']}, {v['ci95'][0]:.0%}–{v['ci95'][1]:.0%})"


def ape_section(f: dict) -> list[str]:
    """APE at query time (issue 27): the confusable set's accuracy per temperature T and scale S."""
    c, grid = f["confusable"], {}
    for arm, v in c.items():
        m = re.fullmatch(r"prefixed\+ape (\d+) (\d+)", arm)
        if m:
            grid[(int(m.group(1)), int(m.group(2)))] = v
    if "prefixed" in c:
        grid[(100, 100)] = c["prefixed"]
    ts, ss = sorted({t for t, _ in grid}), sorted({s for _, s in grid})
    rows = ["| T \\ S | " + " | ".join(f"S = {s / 100:.1f}" for s in ss) + " |", "|---|" + "---:|" * len(ss)]
    for t in ts:
        rows.append(f"| T = {t / 100:.1f} | " + " | ".join(
            f"{grid[(t, s)]['found']}/{grid[(t, s)]['n']}" + (" (off)" if (t, s) == (100, 100) else "")
            if (t, s) in grid else "—" for s in ss) + " |")
    base = c.get("baseline")
    on = {k: v for k, v in grid.items() if k != (100, 100)}
    top = max(v["found"] for v in on.values())
    best = [k for k, v in on.items() if v["found"] == top]

    def cell(k):
        return cell_of(grid[k])

    out = [f"**APE at query time** — `{f['command']}` ({machine_line(f)}; {f['model']}, {f.get('weights', 'fp32')} "
           f"weights, greedy, up to {f['new_tokens']} new tokens): the confusable set's {next(iter(c.values()))['n']} "
           "prompts of 8 modules; each cell is the modular arm with APE's temperature T inside the modules and "
           "scale S on their attention mass (`--ape T,S`; engine/model/attend.py), answers found:", "", *rows, ""]
    line = ("Best with APE on: " + " and ".join(f"T = {t / 100:.1f}, S = {s_ / 100:.1f}" for t, s_ in best)
            + f", {cell(best[0])}")
    if (90, 90) in grid:
        line += f"; APE's own default (T = S = 0.9) {cell((90, 90))}"
    if (100, 100) in grid:
        line += f"; off (the modular arm) {cell((100, 100))}"
    if base:
        line += f"; the baseline {cell_of(base)}"
    routed = {a: v for a, v in c.items() if "+route" in a}
    line += "".join(f"; `{a}` {cell_of(v)}" for a, v in routed.items())
    if (100, 100) in grid and top <= grid[(100, 100)]["found"]:
        line += (". No setting finds more answers than the modular arm without APE, so APE is off by default "
                 "(`ape_t` = `ape_s` = 1)")
    return out + [line + ".", ""]


def lead_fidelity(f: dict, slug: str) -> list[str]:
    out = [f"**Fidelity, varied needles** — `{f['command']}` ({machine_line(f)}; {f['model']}, {f.get('dtype', '')}, "
           f"greedy, up to {f['new_tokens']} new tokens; TTFT of each answer's own run). Essay modules of ~250 tokens "
           "with invented facts whose answers are names, places, colours, dishes or two-word phrases "
           "(bench/needles.py); found = the asked fact's answer is in the reply (whole words, case ignored), "
           "confused = another module's answer is and the asked one is not.", ""]
    for size, summary in f["frontier"].items():
        n = next(iter(summary.values()))["n"]
        out += [f"*{size} modules, one fact asked, two facts of other templates elsewhere ({n} prompts):*", ""]
        out += _arm_rows(summary) + [""]
    if f.get("confusable"):
        n = next(iter(f["confusable"].values()))["n"]
        out += [f"*Confusable facts: {f['confusable_modules']} modules, each holding a fact of the same template about "
                f"another subject (a harbour master's parrot in each of eight towns, …); the question names one "
                f"({n} prompts). `blend R` recomputes R % of the cached tokens, chosen by the largest value deviation "
                "at layer 1 unless a rule is named (`link`: the tokens after each module boundary; `question`: the "
                "tokens the question attends to most; `random`: the control):*", ""]
        out += confusable_table(f)
    samples = f.get("samples") or {}
    for name, row in samples.items():
        out += [f"Sample `{name}` ({row['prompt_tokens']} tokens), first-token KL against the baseline: " + ", ".join(
            f"`{a}` {row[a]['kl']:.3f}{'' if row[a]['agree'] else ' (first token differs)'}"
            for a in f["sample_arms"]) + ".", ""]
    out += [f"![Needle accuracy against TTFT, per arm and blend R]({ASSETS}/frontier-{slug}.png)", ""]
    return out


def decode_section(d: dict | None) -> list[str]:
    """Decode speed and fidelity per weight precision (bench/decode.py)."""
    if not d:
        return []
    rows = ["| weights | linear weights | decode ms/token, median (min–max) | modular TTFT, median | "
            "first-token KL vs fp32, mean | same greedy text as fp32 |", "|---|---:|---:|---:|---:|---:|"]
    for r in d["results"]:
        dec, kl = r["decode_ms_per_token"], r.get("first_token_kl")
        rows.append(f"| `{r['weights']}` | {r['weight_bytes'] / 2**20:,.0f} MiB | {dec['median']:.1f} "
                    f"({dec['min']:.1f}–{dec['max']:.1f}) | {r['ttft_ms']['median']:.0f} ms | "
                    + (f"{sum(kl['all']) / len(kl['all']):.4f} | {r['same_text']}/{r['prompts']} |" if kl else "— | — |"))
    return [f"**Decode per weight precision** — `{d['command']}` ({machine_line(d)}; {d['model']}, the modular arm "
            f"on every sample's example prompt, {d['new_tokens']} greedy tokens; `--weights`, "
            "engine/model/weights.py: int8 per output channel, int4 in groups of 32, gguf the GGUF file's own "
            "blocks (Q5_0, Q4_K, Q8_0, Q6_K: fp32's values), all through the engine's kernels, [weights and "
            "kernels](models.md#weights-and-kernels)):", "", *rows, ""] + needles_per_precision()


def prefill_headline(d: dict | None) -> list[str]:
    """One line: the full prefill at the longest length, new kernel against today's path, llama.cpp and the floor."""
    if not d:
        return []
    v, n = d["verdicts"], str(max(d["lengths"]))
    new, old = d["studio"][v["new"]]["by_length"][n], d["studio"][v["old"]]["by_length"][n]
    ll = d["llama_cpp"].get("by_length", {}).get(n)
    floor = d["floors"]["float32" if v["new"] == "gemm-fp32" else "bfloat16"].get(n, {}).get("s")
    return [f"- **Full prefill** ({d['model']}, {int(n):,} tokens, {d['machine']['threads']} threads, "
            f"`bench/prefill.py`): {new['median']:.1f} s with the `{v['new']}` prefill kernel, {old['median']:.1f} s "
            f"on the packed blocks" + (f", {ll['median']:.1f} s for llama.cpp" if ll else "")
            + (f"; its linears alone as bare GEMMs {floor:.1f} s" if floor else "")
            + _busy(d["machine"].get("loadavg_1min")) + "."]


def _busy(load) -> str:
    """A warning for figures taken while other work shared the 2 cores (they are then several times too slow)."""
    return f" (measured at load average {load:.1f}, on a busy machine: ratios only)" if load and load > 3 else ""


def prefill_section(d: dict | None) -> list[str]:
    """Full prefill against the GEMM floors and llama.cpp (bench/prefill.py)."""
    if not d:
        return []
    m, v, kernels = d["machine"], d["verdicts"], list(d["studio"])
    ll = d["llama_cpp"]
    head = ["tokens", *[f"studio `{k}`" for k in kernels], "llama.cpp (flash attn)", "bf16 GEMM floor",
            "fp32 GEMM floor", "int8 GEMM floor", "linears in the prefill", "prefill / floor used"]
    used = {"gemm-bf16": "bfloat16", "gemm-fp32": "float32", "gemm-int8": "int8"}.get(d["studio"][v["new"]]["kernel"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in map(str, d["lengths"]):
        st = [d["studio"][k]["by_length"][n] for k in kernels]
        floor = [d["floors"].get(x, {}).get(n, {}).get("s") for x in ("bfloat16", "float32", "int8")]
        cells = [f"{int(n):,}", *[f"{s['median']:.2f} s ({s['min']:.2f}–{s['max']:.2f})" for s in st],
                 f"{ll['by_length'][n]['median']:.2f} s" if "by_length" in ll else "—",
                 *[f"{f:.2f} s" if f else "—" for f in floor],
                 f"{st[0]['linear_s']:.2f} s" if st[0].get("linear_s") else "—",
                 f"{v['by_length'][n].get(f'prefill_over_{used}_floor') or '—'}×"]
        rows.append("| " + " | ".join(cells) + " |")
    enc = d["encoding"]
    return [f"**Full prefill against the GEMM floor and llama.cpp** — `{d['command']}` ({machine_line(d)}; "
            f"CPU capability {m['cpu_capability']}, bf16 matrix units: {'yes' if m['bf16_units'] else 'no'}; "
            f"{d['model']} on its {d['weights']} weights; median of {d['repeats']} (min–max); the floors are the "
            "24 layers' linears as bare `F.linear` at the model's shapes in the same run; `--prefill-kernel`, "
            f"engine/model/prefill.py). Auto chose `{d['auto']['kernel']}`: {d['auto']['why']}. llama.cpp: "
            + (ll["error"] if "error" in ll else f"{ll['version']}, {ll['threads']} threads") + ".", "", *rows, "",
            f"Module encoding of an {enc[v['new']]['documents']}-document schema ({enc[v['new']]['tokens']:,} "
            f"tokens): {enc[v['new']]['median']:.2f} s with `{v['new']}`, {enc[v['old']]['median']:.2f} s with "
            f"`{v['old']}` ({v['encoding_speedup']}×). Decode ms/token after a 512-token prefill: "
            f"{d['decode'][v['new']]['median']:.1f} against {d['decode'][v['old']]['median']:.1f} "
            f"({v['decode_ratio']}×). Mean first-token KL of `{v['new']}` against an fp32 prefill: "
            f"{v['mean_first_token_kl']:.2g}" + "".join(f"; `{k}` {x['mean_kl']:.2g}" for k, x in d["kl"].items()
                                                    if k != v["new"]) + ".", ""]


def needles_per_precision() -> list[str]:
    """The baseline's needle accuracy per weight precision (bench/fidelity.py --weights W, baseline only)."""
    runs = [(w, load(f"fidelity-{LEAD}" + ("" if w == "fp32" else f"-{w}")))
            for w in ("fp32", "bf16", "int8", "int4", "gguf")]
    runs = [(w, f) for w, f in runs if f and f.get("confusable", {}).get("baseline")]
    if len(runs) < 2:
        return []
    rows = ["| weights | single facts found (95 % CI) | confusable facts found (95 % CI) | command |", "|---|---:|---:|---|"]
    for w, f in runs:
        a, c = f["summary"]["baseline"], f["confusable"]["baseline"]
        rows.append(f"| `{w}` | {a['found']}/{a['n']} ({a['ci95'][0]:.0%}–{a['ci95'][1]:.0%}) | {c['found']}/{c['n']} "
                    f"({c['ci95'][0]:.0%}–{c['ci95'][1]:.0%}) | `{f['command']}` |")
    return ["**Needle accuracy per weight precision** — the baseline arm (whole prompt prefilled) on the same "
            "prompts of bench/fidelity.py (8 modules of ~250 tokens, greedy; each row from its own command and date: "
            "the int8 and int4 rows ran on torch's kernels, before the engine's):", "", *rows, ""]


def browser_section(d: dict | None) -> list[str]:
    """What a user waits for in chromium, and the studio's decode against `pml-studio run`'s (bench/browser_compare.py)."""
    if not d:
        return []
    later, st, cli = d["later_compare_s"] or {}, d["studio_decode_ms_per_token"], d["cli_decode_ms_per_token"]
    paired, steal = d.get("studio_over_cli_paired"), d.get("steal_pct") or {}
    tokens = d.get("ratio_new_tokens", d["new_tokens"])
    how = (f"then {d['pairs']} Compares of {tokens} new tokens, each paired with a `pml-studio run --json` of the "
           "same arms and tokens beside it (alternating order: Compare, CLI, CLI, Compare, ...), the studio and its "
           "page open and idle during the CLI's runs" if d.get("pairs") else
           "a `pml-studio run --json` of the same arms after each later Compare, the studio and its page open and "
           "idle")
    return [f"**In the browser** — `{d['command']}` ({machine_line(d)}; {d['model']}, {d['weights']} weights, arms "
            f"{', '.join(d['arms'])} decoded {d['decode']}, the `{d['sample']}` sample, {d['new_tokens']} new tokens, "
            f"chromium driven by Playwright on the same 2 cores; {how}; the page reads a running Compare's texts "
            "as one streamed response, studio/live.py):", "",
            "| what | measured |", "|---|---:|",
            f"| `python app.py` started → HTTP 200 | {d['serve_s']:.1f} s |",
            f"| first Compare (click → run logged and shown; model loaded in the background, modules encoded) | "
            f"{d['first_compare_s']:.1f} s |",
            f"| later Compares, min / median / max | {later.get('min', 0):.2f} / {later.get('median', 0):.2f} / "
            f"{later.get('max', 0):.2f} s |",
            f"| decode ms per step at {tokens} tokens, studio (median, min–max) | {st['median']:.1f} "
            f"({st['min']:.1f}–{st['max']:.1f}) |",
            f"| decode ms per step at {tokens} tokens, `pml-studio run` (median, min–max) | {cli['median']:.1f} "
            f"({cli['min']:.1f}–{cli['max']:.1f}) |",
            f"| studio / run (medians) | {d['studio_over_cli']:.2f}× |"] + (
        [f"| studio / run, pair by pair (min / median / max) | {paired['min']:.2f} / {paired['median']:.2f} / "
         f"{paired['max']:.2f} |"] if paired else []) + (
        [f"| CPU time the host took (steal), min / median / max | {steal['min']} / {steal['median']} / "
         f"{steal['max']} % |"] if steal.get("median") is not None else []) + [""]


def peak_memory_section(d: dict | None) -> list[str]:
    """What reading a run's peak memory costs its TTFT (bench/peak_memory.py)."""
    if not d:
        return []
    cells = []
    for r in d["results"]:
        for arm, methods in r["arms"].items():
            cells.append(f"{arm} at {r['prompt_tokens']:,} tokens: thread "
                         f"{methods['thread 5 ms (before)']['ratio_to_none']['median']:.3f}×, VmHWM "
                         f"{methods['hwm (now)']['ratio_to_none']['median']:.3f}×")
    return [f"**Reading the peak memory inside the timed block** — `{d['command']}` ({machine_line(d)}; "
            f"{d['reps']} rounds, each running every method in turn): TTFT with the peak read, over TTFT with "
            "nothing read, median of the rounds — " + "; ".join(cells) + ". The 5 ms sampling thread costs "
            f"at most {(d['thread_cost_median_max'] - 1) * 100:.1f} % here, within this machine's noise; the "
            "engine reads the kernel's own high-water mark (VmHWM, reset through /proc/self/clear_refs) instead, "
            "so nothing runs beside the timed block, as in the floor it is compared with.", ""]


def gpu_runs() -> list[dict]:
    return [d for d in (load("gpu-ttft-cuda"), load("gpu-ttft-cpu")) if d]


SHAPE = "llama-2-7b"  # bench/ttft.py --random-shape: the paper's model size, random weights


def shape_runs() -> list[dict]:
    """bench/ttft.py --random-shape llama-2-7b on a lent GPU, modules in GPU and in CPU memory."""
    return [d for d in (load(f"gpu-ttft-cuda-{SHAPE}-random"), load(f"gpu-ttft-cpu-{SHAPE}-random")) if d]


def gpu_table(runs: list[dict], commands: bool = True) -> list[str]:
    """One row per length and storage: the paper's two GPU settings side by side (each row's command with
    ``commands``; else the text names them)."""
    out = ["| prompt tokens | modules in | baseline TTFT | cached TTFT | of which copy | speedup (min–max) | "
           "floor (stock transformers) | question tokens alone, no cache | decode ms/token |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for d in runs:
        for r in d["results"]:
            where = f"{d['storage'].upper()} memory (`{d['command']}`)" if commands else \
                f"{'GPU' if d['storage'] == 'cuda' else d['storage'].upper()} memory"
            out.append(f"| {r['prompt_tokens']:,} | {where} | "
                       f"{r['baseline_ttft_ms']:.1f} ms | {r['cached_ttft_ms']:.1f} ms | {r['cached_copy_ms']:.1f} ms | "
                       f"{r['speedup']:.2f}× ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) | {r['floor_ms']:.1f} ms | "
                       f"{r['nocache_ms']:.1f} ms | {r['baseline_decode_ms_per_token']:.0f} |")
    return out


def gpu_section() -> list[str]:
    """bench/ttft.py on a lent GPU: the paper's two GPU settings (Fig. 4), modules in GPU and in CPU memory."""
    runs = gpu_runs()
    if not runs:
        return []
    m = runs[0]["machine"]
    out = [f"**On a GPU** ({m.get('gpu', 'a CUDA GPU')}, torch {m['torch']}, {m['date']}; lent to one session, "
           "not the reference machine): the paper's two GPU settings, `bench/ttft.py` with the model on the GPU and "
           f"the modules' KV kept in GPU memory or in CPU memory ({runs[0]['model']}, {runs[0]['dtype']}, median of "
           f"{runs[0]['reps']} after a warm-up, TTFT includes the copy):", ""] + gpu_table(runs)
    rows = [r for d in runs for r in d["results"]]
    flat, alone = [r["baseline_ttft_ms"] for r in rows], [r["nocache_ms"] for r in rows]
    copies = [r["cached_copy_ms"] for d in runs if d["storage"] == "cpu" for r in d["results"]]
    out += ["", f"On this GPU the full prefill of {runs[0]['model']} takes {min(flat):.0f}–{max(flat):.0f} ms at every "
            f"length up to {max(r['prompt_tokens'] for r in rows):,} tokens, and a stock forward of the "
            f"{max(r['uncached_tokens'] for r in rows)} question tokens alone {min(alone):.0f}–{max(alone):.0f} ms: "
            "the cost is per layer and per call, not per token, so there is nothing for the modular cache to save, "
            "and its own work (assembling the buffer"
            + (f"; copying from CPU memory, {min(copies):.0f}–{max(copies):.0f} ms" if copies else "")
            + ") makes it slower than a full prefill. Prompt Cache's GPU gains come from prefills that are "
            "compute-bound (7B+ models, long prompts); this model is too small to show them"
            + ("; Llama-2-7B's shape is measured below." if shape_runs() else
               ", and no such model is at hand here (models come from PyPI packages; the largest is 0.5B).")]
    log = RESULTS / "gpu-tests.log"
    if log.exists():
        lines = log.read_text().strip().splitlines()
        out.append(f"The engine's real-model tests ran there with the model and module store on CUDA (fp32): "
                   f"`{lines[0].lstrip('$ ')}` — {lines[-1].strip()}.")
    return out + [""] + shape_section(shape_runs())


def shape_section(runs: list[dict]) -> list[str]:
    """The paper's GPU settings at Llama-2-7B's shape with random weights (bench/ttft.py --random-shape)."""
    if not runs:
        return []
    d0, m = runs[0], runs[0]["machine"]
    sh = d0["shape"]
    rows = [r for d in runs for r in d["results"]]
    room = sh["max_position_embeddings"] - d0["new_tokens"] - 16  # where bench/ttft.py cuts the lengths
    words = d0["command"].split()
    tok_arg = words[words.index("--model") + 1] if "--model" in words[:-1] else None
    cut = [r for r in rows if r["target_tokens"] == room]
    out = [f"**Llama-2-7B's shape on a GPU, random weights** ({m.get('gpu', 'a CUDA GPU')}, torch {m['torch']}, "
           f"{m['date']}; lent to one session, not the reference machine). No 7B model's weights are at hand here, "
           "but TTFT does not depend on the weights' values, only on the shapes of the work, so "
           f"`bench/ttft.py --random-shape {sh['name']}` builds a {sh['architecture']} of Llama-2-7B's shape from its "
           f"config ({sh['num_hidden_layers']} layers, hidden {sh['hidden_size']:,}, MLP {sh['intermediate_size']:,}, "
           f"{sh['num_attention_heads']} attention and {sh['num_key_value_heads']} KV heads, context "
           f"{sh['max_position_embeddings']:,}; {d0['params'] / 1e9:.2f} B parameters) with **random weights** "
           f"(seed 0), in {d0['dtype']} directly on the GPU. The weights are random, so the answers are noise and "
           f"only the timings mean anything. The text is tokenized by {d0['tokenizer']}'s tokenizer, and the "
           f"vocabulary is that tokenizer's {sh['vocab_size']:,} tokens instead of Llama-2's 32,000: that changes "
           "only the embedding and output matrices, not the attention or MLP work of any layer."
           + (f" The longest prompt is cut to {max(r['prompt_tokens'] for r in cut):,} tokens, leaving room for "
              f"the {d0['new_tokens']} new tokens in the {sh['max_position_embeddings']:,}-token context." if cut
              else "")
           + " Commands: " + " and ".join(f"`{d['command']}`" for d in runs)
           + (f" (`--model` names only the tokenizer: `{tok_arg}` was a folder holding the default model's "
              "tokenizer and config files, the lent GPU having none of the model packages)" if tok_arg else "")
           + f"; median of {d0['reps']} after a warm-up, TTFT includes the copy:", ""]
    out += gpu_table(runs, commands=False) + paths_section(runs)
    on_gpu = [r for d in runs if d["storage"] == "cuda" for r in d["results"]]
    on_cpu = [r for d in runs if d["storage"] == "cpu" for r in d["results"]]
    said = []
    if on_gpu:
        said.append(f"With the modules in GPU memory the full prefill takes "
                    f"{on_gpu[0]['baseline_ttft_ms']:.0f} ms at {on_gpu[0]['prompt_tokens']:,} tokens and "
                    f"{on_gpu[-1]['baseline_ttft_ms']:.0f} ms at {on_gpu[-1]['prompt_tokens']:,}, while the cached "
                    f"TTFT stays at {min(r['cached_ttft_ms'] for r in on_gpu):.0f}–"
                    f"{max(r['cached_ttft_ms'] for r in on_gpu):.0f} ms, "
                    f"{min(r['cached_over_floor'] for r in on_gpu):.2f}–{max(r['cached_over_floor'] for r in on_gpu):.2f}× "
                    "the floor (a stock forward of the same question tokens over the same KV): speedup "
                    + ", ".join(f"{r['speedup']:.2f}× at {r['prompt_tokens']:,}" for r in on_gpu) + " tokens.")
        alone = [r for r in on_gpu if r["baseline_ttft_ms"] <= 1.1 * r["nocache_ms"]]
        if alone:
            at = ", ".join(f"{r['prompt_tokens']:,}" for r in alone)
            ms = ", ".join(f"{r['baseline_ttft_ms']:.1f} against {r['nocache_ms']:.1f} ms" for r in alone)
            said.append(f"At {at} tokens a full prefill costs no more than a forward of the "
                        f"{alone[0]['uncached_tokens']} question tokens alone ({ms}): there the forward's cost is per "
                        "call, not per token, and there is nothing to save.")
    profile = load(f"gpu-profile-{SHAPE}-random")
    if on_cpu and profile:
        said.append(f"With the modules in CPU memory the speedup is "
                    + ", ".join(f"{r['speedup']:.2f}× at {r['prompt_tokens']:,}" for r in on_cpu)
                    + " tokens; the profile below says where that time goes.")
    elif on_cpu:
        rate = [r["store_bytes"] / r["cached_copy_ms"] / 1e6 for r in on_cpu if r["cached_copy_ms"]]
        over = all(r["cached_copy_ms"] > r["baseline_ttft_ms"] for r in on_cpu)
        said.append(f"With the modules in CPU memory the copy of their KV to the GPU takes "
                    f"{min(r['cached_copy_ms'] for r in on_cpu):.0f}–{max(r['cached_copy_ms'] for r in on_cpu):.0f} ms "
                    f"({min(rate):.0f}–{max(rate):.0f} GB/s for {on_cpu[0]['store_bytes'] / 1e9:.2f}–"
                    f"{on_cpu[-1]['store_bytes'] / 1e9:.2f} GB)"
                    + (", longer than the full prefill it replaces" if over else "")
                    + f": speedup {min(r['speedup'] for r in on_cpu):.2f}–{max(r['speedup'] for r in on_cpu):.2f}×.")
    out = out + ["", " ".join(said), ""] if said else out + [""]
    return out + profile_section(profile)


def profile_section(d: dict | None) -> list[str]:
    """bench/gpu_profile.py: the CPU-memory setting's copy and forward, each way of combining them."""
    if not d:
        return []
    m = d["machine"]
    ways = ["shipped", "layerwise-eager", "copy-then-graph", "resident", "resident-eager"]
    out = [f"**Where the CPU-memory setting's time goes** (`python bench/gpu_profile.py`, {m.get('gpu')}, "
           f"{m['date']}; median (min–max) of {d['reps']}). One pinned copy of the prompt's module KV, the run's own "
           "copies alone (one 2-D DMA transfer per stored range, engine/kv/dma.py, against torch's `copy_`, which "
           "stages strided slots through a temporary and a kernel), and the cached TTFT for each way of combining "
           "copy and forward: shipped (copies launched whole, then the question's CUDA graph), layer-wise copies "
           "beside an eager forward, copies at fill time then the graph, and the KV already in GPU memory, with "
           "and without the graph:", "",
           "| prompt tokens | GB copied | one copy | DMA copies (host time) | torch copies (host time) | "
           + " | ".join(ways) + " |", "|---:|---:|---:|---:|---:|" + "---:|" * len(ways)]
    for r in d["results"]:
        c, w = r["copies"], r["ways_ms"]
        if "error" in c or "error" in w:
            continue
        out.append(f"| {r['prompt_tokens']:,} | {c['bytes'] / 1e9:.2f} | {c['one_copy_ms']['median']:.1f} ms, "
                   f"{c['one_copy_gb_s']:.0f} GB/s | {c['run_copies_2d_dma_ms']['median']:.1f} ms, "
                   f"{c['run_copies_2d_dma_gb_s']:.0f} GB/s ({c['run_copies_2d_dma_enqueue_ms']:.1f} ms) | "
                   f"{c['run_copies_ms']['median']:.1f} ms ({c['run_copies_enqueue_ms']:.1f} ms) | "
                   + " | ".join(f"{w[k]['median']:.1f} ({w[k]['min']:.1f}–{w[k]['max']:.1f})" for k in ways) + " |")
    return out + [""]


def paths_section(runs: list[dict]) -> list[str]:
    """The GPU paths (pinned storage, layer-wise copies, CUDA graphs: bench/gpu.sh) against the eager pass measured
    in the same process (``--eager-too``); nothing for runs made before them."""
    runs = [d for d in runs if d.get("results_eager")]
    if not runs:
        return []
    out = ["", "The table above ran with the GPU paths on (" + "; ".join(
        f"{'GPU' if d['storage'] == 'cuda' else 'CPU'} memory: pinned storage {d['gpu_paths']['pinned_storage']}, "
        f"layer-wise copies {d['gpu_paths']['layerwise_copies']}, CUDA graphs {d['gpu_paths']['cuda_graphs']}"
        for d in runs) + "; docs/module-memory.md). The same prompts in the same process with all three off "
        "(pageable storage, the copy before the forward, eager forwards), then with them on:", "",
        "| prompt tokens | modules in | baseline TTFT, off → on | cached TTFT, off → on | of which copy, off → on | "
        "speedup, off → on | decode ms/token, off → on |", "|---:|---|---:|---:|---:|---:|---:|"]
    for d in runs:
        eager = {r["target_tokens"]: r for r in d["results_eager"]}
        for r in d["results"]:
            e = eager.get(r["target_tokens"])
            if e is None:
                continue
            out.append(f"| {r['prompt_tokens']:,} | {'GPU' if d['storage'] == 'cuda' else 'CPU'} memory | "
                       f"{e['baseline_ttft_ms']:.1f} → {r['baseline_ttft_ms']:.1f} ms | "
                       f"{e['cached_ttft_ms']:.1f} → {r['cached_ttft_ms']:.1f} ms | "
                       f"{e['cached_copy_ms']:.1f} → {r['cached_copy_ms']:.1f} ms | {e['speedup']:.2f}× → "
                       f"{r['speedup']:.2f}× | {e['baseline_decode_ms_per_token']:.1f} → "
                       f"{r['baseline_decode_ms_per_token']:.1f} |")
    read = [d["weight_read_ms"] for d in runs if d.get("weight_read_ms")]
    if read:
        out += ["", f"Reading every weight once ({runs[0]['weight_bytes'] / 1e9:.1f} GB) took "
                f"{min(read):.1f}–{max(read):.1f} ms in the same processes: the floor of a decode step. With "
                "layer-wise copies the copy runs inside the prefill, so `of which copy` counts only what is left "
                "before it (assembling the copy list)."]
    log = RESULTS / "gpu-paths-tests.log"
    if log.exists():
        lines = log.read_text().strip().splitlines()
        out.append(f"The GPU paths' tests (the eager path's greedy tokens with each path on): "
                   f"`{lines[0].lstrip('$ ')}` — {lines[-1].strip()}.")
    return out


def confusable_table(f: dict) -> list[str]:
    """The confusable set's arms: accuracy, confusions, agreement, TTFT and its ratio to `prefixed` on each prompt."""
    c, rows, out = f["confusable"], f["confusable_rows"], []
    out += ["| arm | found | 95 % CI | confused | first token agrees | mean first-token KL | TTFT median "
            "(min–max) | TTFT × prefixed, median (min–max) | recomputed tokens |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, v in c.items():
        t = v["ttft_ms"]
        ratio = "—"
        if "prefixed" in c:
            xs = sorted(r[arm]["ttft_ms"] / r["prefixed"]["ttft_ms"] for r in rows)
            ratio = f"{statistics.median(xs):.2f}× ({xs[0]:.2f}–{xs[-1]:.2f})"
        out.append(f"| {_arm(arm)} | **{v['accuracy']:.0%}** ({v['found']}/{v['n']}) | "
                   f"{v['ci95'][0]:.0%}–{v['ci95'][1]:.0%} | {v['confused']} | "
                   + ("— | — |" if arm == "baseline" else
                      f"{v['first_token_agreement']:.0%} | {v['mean_first_token_kl']:.3f} |")
                   + f" {t['median']:.0f} ms ({t['min']:.0f}–{t['max']:.0f}) | {ratio} | "
                   f"{v['recomputed_tokens']:.0f} |")
    out.append("")
    blends = {a: v for a, v in c.items() if "+blend " in a}
    if blends and "baseline" in c:
        base = c["baseline"]["accuracy"]
        close = [a for a, v in blends.items() if base - v["accuracy"] <= 0.05]
        out += ["Blend against the baseline's " + f"{base:.0%}: " + ", ".join(
            f"`{a.split('+', 1)[1]}` {(v['accuracy'] - base) * 100:+.0f} points" for a, v in blends.items())
            + (f". Within 5 points of the baseline: {', '.join(f'`{a}`' for a in close)}." if close else
               ". None is within 5 points of the baseline."), ""]
    return out


def precision_section(p: dict) -> list[str]:
    """bench/precision.py: fp32 against bf16 compute, TTFT / decode / KL / accuracy, and the default."""
    out = [f"**Compute precision, fp32 against bf16** — `{p['command']}` ({machine_line(p)}; {p['model']}, module KV "
           f"stored in the precision the run computes in; {p['reps']} alternating rounds after a warm-up, median "
           "(min–max)):", "", "| prompt tokens | dtype | baseline TTFT | cached TTFT | decode ms/token |",
           "|---:|---|---:|---:|---:|"]
    for r in p["ttft"]:
        for dt in ("fp32", "bf16"):
            d = r[dt]
            out.append(f"| {r['prompt_tokens']:,} | {dt} | " + " | ".join(
                f"{d[k]['median']:.0f} ms ({d[k]['min']:.0f}–{d[k]['max']:.0f})"
                for k in ("baseline_ttft_ms", "cached_ttft_ms", "decode_ms_per_token")) + " |")
    out += ["", "| needles | arm | found | 95 % CI | first-token KL vs fp32 (mean / max) | KL vs its own baseline |",
            "|---|---|---:|---:|---:|---:|"]
    for label, summary in p["needles"].items():
        for arm, v in summary.items():
            out.append(f"| {label}, {p['needle_modules']} modules | {arm} | {v['accuracy']:.0%} ({v['found']}/"
                       f"{v['prompts']}) | {v['ci95'][0]:.0%}–{v['ci95'][1]:.0%} | {v['kl_vs_fp32']['mean']:.1e} / "
                       f"{v['kl_vs_fp32']['max']:.1e} | {v['kl_vs_own_baseline']['mean']:.3f} |")
    out += ["", "The CPU default stays fp32 (engine/config.py `default_dtype`, quoted by `pml-studio info` and the "
            "Model tab): bf16 is faster at the same accuracy, but its kernels round differently per shape, so runs "
            "that are exact in fp32 (a scaffold, one module at the start, blend at 100 %) would show a KL of their "
            "own. `--dtype bfloat16` (CLI, bench scripts, `python app.py`) is the speed setting.", ""]
    return out


def workload_section(w: dict, result: str = "workload") -> list[str]:
    arms, ratios, rows = w["arms"], w["ratios"], w["prompts"]
    n_order = sum(r["schema_order"] for r in rows)
    warm = w.get("warmup")
    warm_text = (f"warmed once with the prompt importing all {len(warm['modules'])} modules in schema order "
                 f"({warm['tokens']} tokens), then holding every earlier prompt of the workload" if warm else
                 "not warmed: holding only the earlier prompts of the workload")
    names = {"baseline": "baseline (full prefill)", "prefix": "prefix cache (exact, longest token prefix)",
             "cached": "modular cache (`" + w["mode"] + "`)"}
    if w.get("blend"):
        names["blend"] = f"blend {w['blend']:.0%} (`{w.get('blend_rule', 'deviation')}`)"
    varied = "answer" in rows[0]
    needles = ("each holding one fact of each of the same three templates about its own subject (bench/needles.py): "
               "the facts of a prompt's modules are confusable" if varied else "a needle in each")
    asks = ("one fact about one imported module's subject; found = its answer is in the reply" if varied else
            "one imported module's needle")
    out = [f"**Mixed workload: modular against prefix caching** — `{w['command']}` ({machine_line(w)}; {w['model']}): "
           f"one schema of {w['modules']} essay modules (~{round(sum(w['module_tokens']) / len(w['module_tokens']))} "
           f"tokens each, {needles}), {len(rows)} prompts of 2–4 modules chosen at random, {n_order} of them "
           f"in schema order from the first module; each asks for {asks}; greedy. The prefix "
           f"cache lives as long as the engine, as on a server: {warm_text}. TTFT includes the copy of stored KV.", "",
           "| arm | mean TTFT | p50 | p90 | prompts in schema order | other prompts | tokens prefilled | "
           "needle found | 95 % CI | cache bytes |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    runs = [(names.get(arm, arm), s) for arm, s in arms.items()]
    variants = [v for v in map(lambda p: json.loads(p.read_text()), sorted(RESULTS.glob("workload-*.json")))
                if "cached" in v["arms"] and v is not w and v["model"] == w["model"]
                and (v["seed"], v["modules"], len(v["prompts"])) == (w["seed"], w["modules"], len(rows))
                and v["command"] != w["command"] and ("answer" in v["prompts"][0]) == ("answer" in rows[0])]
    runs += [(f"modular cache (`{v['variant']}`)", v["arms"]["cached"]) for v in variants]
    for name, s in runs:
        out.append(f"| {name} | **{s['mean_ttft_ms']:.0f} ms** | {s['p50_ttft_ms']:.0f} ms | "
                   f"{s['p90_ttft_ms']:.0f} ms | {_ms(s['schema_order_mean_ttft_ms'])} | {_ms(s['other_mean_ttft_ms'])} | "
                   f"{s['prefilled_tokens']:,} | {s['needle_found']}/{s['n']} | {s['ci95'][0]:.0%}–{s['ci95'][1]:.0%} | "
                   f"{s['cache_bytes'] / 2**20:.1f} MiB |")
    facts = []
    if ratios.get("cached_over_prefix_mean") is not None:
        facts.append(f"modular / prefix mean TTFT {ratios['cached_over_prefix_mean']:.2f} (prompts out of schema "
                     f"order {ratios['cached_over_prefix_other']:.2f}, in schema order "
                     f"{ratios['cached_over_prefix_schema_order']:.2f})")
    if ratios.get("prefix_over_baseline_schema_order") is not None:
        facts.append(f"prefix / baseline {ratios['prefix_over_baseline_schema_order']:.2f} on prompts in schema order "
                     f"and {ratios['prefix_over_baseline_other']:.2f} on the others")
    for arm in (a for a in arms if a.startswith("blend")):
        b = arms[arm]
        facts.append(f"{arm}: mean TTFT {b['mean_ttft_ms'] / arms['prefix']['mean_ttft_ms']:.2f}× prefix and "
                     f"{b['mean_ttft_ms'] / arms['cached']['mean_ttft_ms']:.2f}× modular, "
                     f"{b['needle_found'] - arms['baseline']['needle_found']:+d} answers against the baseline"
                     if {"prefix", "cached", "baseline"} <= set(arms) else arm)
    if "prefix" in arms:
        p = arms["prefix"]
        facts.append(f"prefix reuse broke before the end of the imported modules in {p['reuse_broke']} of {p['n']} "
                     "prompts (at the first module out of schema order, unless an earlier prompt had the same start)")
        if p.get("same_answers_as_baseline") is not None:
            facts.append(f"the prefix arm gave the baseline's answer in {p['same_answers_as_baseline']} of {p['n']}")
    if variants:
        facts.append("the variant rows are the same prompts' modular arm, run with " +
                     ", ".join(f"`{v['command']}`" for v in variants))
    out += ["", "Ratios: " + "; ".join(facts) + ". Per prompt (where prefix reuse stopped, each arm's TTFT and answer) "
            f"in `bench/results/{result}.json`.", "", f"![TTFT per prompt, per arm]({ASSETS}/{result}.png)", ""]
    return out


PEER_NAMES = {"baseline": "studio baseline (full prefill)", "prefix": "studio prefix cache (exact)",
              "cached": "studio modular cache", "llama.cpp-full": "llama.cpp, full prefill",
              "llama.cpp-prefix": "llama.cpp, prefix reuse (saved states)"}


ENGINE_NAMES = {"float32": "studio fp32", "bfloat16": "studio bf16"}


def peers_section(p: dict | None, kv: dict | None, image: str, older: dict | None = None) -> list[str]:
    """bench/peers.py: llama.cpp on the same GGUF and token ids, kvpress's presses, beside the studio's arms.
    ``older``: the lengths section of an earlier run, shown (with its own command) when the latest has none."""
    out = [] if p is not None else [
        "**Peers** — not measured yet: `make peers`, then `python bench/peers.py --model qwen2.5-coder-0.5b`.", ""]
    p = p or {}
    if "workload" in p:
        w = p["workload"]
        n = len(w["prompts"])
        n_order = sum(r["schema_order"] for r in w["prompts"])
        lc = w.get("llama.cpp", {})
        out += [f"**Peers: llama.cpp on the same GGUF** — `{p['command']}` ({machine_line(p)}; {p['model']}; "
                f"llama-cpp-python {lc.get('llama_cpp_python', '?')} built here, {lc.get('threads', '?')} threads, "
                f"`{p['gguf']}` run with its own quantized kernels; the studio runs "
                + (f"the same file's own blocks (`--weights gguf`, the engine's kernels)" if p.get("weights") == "gguf"
                   else f"the same file dequantized, on `{p.get('weights', 'fp32')}` weights")
                + f"). The workload above, {n} prompts ({n_order} in schema order), re-run in this one command: "
                "llama.cpp prefills the studio baseline's token ids (the schema rendered with the model's chat "
                "template). `llama.cpp, prefix reuse`: warmed with the schema-order prompt, then every earlier "
                "prompt kept as a saved KV state (`llama_state_get_data`); each prompt restores the state with the "
                "longest common prefix (`llama_state_set_data`) and prefills the rest, as llama-server's prompt "
                "cache does (llama-cpp-python's `LlamaRAMCache` would also copy a 311 MB logits array per state). "
                "Each answer judged on its own; greedy; TTFT includes restoring or copying KV.", "",
                "| arm / peer | mean TTFT | min / median / max | schema-order prompts | other prompts | "
                f"decode ms/token (median) | time to token {p.get('new_tokens', 32)}: mean (min / median / max) | "
                "needle found | 95 % CI |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        nth = next((v for k, v in w.items() if k.startswith("time_to_token_")), {})
        blend = p["workload"]["arms"].get("blend")
        for name, s in list(w["arms"].items()) + list(w["peers"].items()):
            label = PEER_NAMES.get(name, name) if name != "blend" else "studio blend (`deviation`)"
            if "error" in s:
                out.append(f"| {label} | could not run: {s['error']} | | | | | | | |")
                continue
            t, dec, to_n = s["ttft_ms"], s.get("decode_ms_per_token") or {}, nth.get(name)
            out.append(f"| {label} | **{s['mean_ttft_ms']:.0f} ms** | {t['min']:.0f} / {t['median']:.0f} / "
                       f"{t['max']:.0f} ms | {_ms(s['schema_order_mean_ttft_ms'])} | {_ms(s['other_mean_ttft_ms'])} | "
                       f"{dec.get('median', 0):.0f} | "
                       + (f"**{to_n['mean_ms']:.0f} ms** ({to_n['min']:.0f} / {to_n['median']:.0f} / "
                          f"{to_n['max']:.0f})" if to_n else "—")
                       + f" | {s['needle_found']}/{s['n']} | "
                       f"{s['ci95'][0]:.0%}–{s['ci95'][1]:.0%} |")
        r = p["ratios"]
        if "cached_over_llamacpp_prefix_mean" in r:
            pp = r["cached_over_llamacpp_prefix_per_prompt"]
            to_n = next((k for k in r if k.startswith("cached_over_llamacpp_prefix_time_to_token_")), None)
            facts = [f"modular / llama.cpp with prefix reuse, mean TTFT **{r['cached_over_llamacpp_prefix_mean']:.2f}**"
                     f" (per prompt {pp['min']:.2f}–{pp['max']:.2f}, median {pp['median']:.2f}); modular / llama.cpp "
                     f"full prefill **{r['cached_over_llamacpp_full_mean']:.2f}**",
                     f"studio prefix / llama.cpp prefix {r['prefix_over_llamacpp_prefix_mean']:.2f}, studio baseline "
                     f"/ llama.cpp full {r['baseline_over_llamacpp_full_mean']:.2f}"]
            if to_n:
                facts.append(f"modular / llama.cpp with prefix reuse, mean time to token "
                             f"{to_n.split('_')[-2]} (TTFT and decode) **{r[to_n]:.2f}**")
            wins = r["cached_over_llamacpp_prefix_peer_faster_prompts"]
            facts.append(f"llama.cpp with prefix reuse beat the modular arm on {wins} of {n} prompts"
                         + (f" (on the schema-order prompts modular / llama.cpp is "
                            f"{r['cached_over_llamacpp_prefix_schema_order_mean']:.2f}, on the others "
                            f"{r['cached_over_llamacpp_prefix_other_mean']:.2f})" if wins else ""))
            if blend:
                facts.append(f"blend / llama.cpp prefix {r['blend_over_llamacpp_prefix_mean']:.2f}")
            out += ["", "Ratios: " + "; ".join(facts) + ".", ""]
        out += [f"![studio arms against llama.cpp]({ASSETS}/{image}.png)", ""]
    source = p if "lengths" in p else older
    if source and "lengths" in source:
        ln = source["lengths"]
        pts = ln["points"]
        engines = list(dict.fromkeys(x["dtype"] for x in pts))
        targets = sorted({x["target_tokens"] for x in pts})
        said = "same command" if source is p else f"`{source['command']}`, {machine_line(source)}"
        out += [f"**Full prefill and decode by engine** ({said}; the document-QA prompts of `bench/ttft.py`, "
                f"same token ids; TTFT median (min–max) of {len(pts[0]['baseline_ttft_ms_all'])} "
                "repetitions after a warm-up, decode ms/token median; the studio's cached TTFT beside):", "",
                "| prompt tokens | " + " | ".join(f"{ENGINE_NAMES.get(e, e)} TTFT" for e in engines)
                + " | studio cached TTFT (fp32) | "
                + " | ".join(f"{ENGINE_NAMES.get(e, e)} decode ms/token" for e in engines) + " |",
                "|---:|" + "---:|" * (2 * len(engines) + 1)]
        for t in targets:
            row = {x["dtype"]: x for x in pts if x["target_tokens"] == t}
            first = next(iter(row.values()))
            cached = row.get("float32", {}).get("cached_ttft_ms")
            out.append(f"| {first['prompt_tokens']:,} | " + " | ".join(
                _spread_ms(row[e]["baseline_ttft_ms"], row[e]["baseline_ttft_ms_all"]) if e in row else "—"
                for e in engines)
                + f" | {_spread_ms(cached, row['float32']['cached_ttft_ms_all']) if cached else '—'} | " + " | ".join(
                f"{row[e]['baseline_decode_ms_per_token']:.0f}" if e in row and row[e].get(
                    "baseline_decode_ms_per_token") else "—" for e in engines) + " |")
        if "error" in ln.get("llama.cpp", {}):
            out.append(f"\nllama.cpp could not run: {ln['llama.cpp']['error']}")
        out.append("")
    if kv is not None and "kvpress" in kv:
        out += kvpress_table(kv)
    return out


KV_NAMES = {"baseline": "studio baseline (full prefill)", "cached fp32": "studio modular, full modules",
            "question": "studio `question` retention", "pyramid": "studio `pyramid` (query-agnostic control)",
            "kvpress none": "kvpress, no press (its own path)"}


def kvpress_table(f: dict) -> list[str]:
    sec = f["kvpress"]
    k = sec["kvpress"]
    info = (f"kvpress {k['kvpress']}, transformers {k['transformers']} in its own environment" if "kvpress" in k
            else f"kvpress could not run: {k.get('error')}")
    out = [f"**kvpress's presses against question retention** — `{f['command']}` ({machine_line(f)}; {f['model']}, "
           f"{info}): the varied needles of issue 17, {len(sec['prompts'])} prompts of {sec['modules']} modules, "
           "the studio's token ids on both sides, greedy. kvpress compresses the context before the question is "
           "seen (query-agnostic, as its pipeline runs); the studio's `question` retention thins the run's buffer "
           "after the question was prefilled (full modules stored); `pyramid` is its query-agnostic control. "
           "KV decoded over: for kvpress, the context KV its press left over its unpressed run's (KVzip masks "
           "entries instead of evicting them: masked ones counted as removed); for the studio, the buffer after "
           "retention over the full buffer (its question tokens included).", "",
           "Time: for kvpress, the context's prefill under the press (what compression costs it; KVzip replays "
           "the context); for the studio, the run's TTFT with the modules reused (the retention happens after it).", "",
           "| method | kept | needle found | 95 % CI | KV decoded over | time, median (min–max) |",
           "|---|---:|---:|---:|---:|---:|"]
    for name, s in sec["summary"].items():
        if "error" in s:
            out.append(f"| kvpress | — | could not run: {s['error']} | | |")
            continue
        method, kept = (name.rsplit(" ", 1) if name.endswith("%") else (name, "100%"))
        times = [r[name]["ttft_ms"] for r in sec["prompts"] if "ttft_ms" in r.get(name, {})]
        if "ttft_ms" not in s and times:  # the studio's rows carry their runs' TTFT
            s = {**s, "ttft_ms": {"median": statistics.median(times), "min": min(times), "max": max(times)}}
        out.append(f"| {KV_NAMES.get(method, method)} | {kept} | {s['needle_found']}/{s['n']} | "
                   f"{s['ci95'][0]:.0%}–{s['ci95'][1]:.0%} | "
                   + (f"{s['buffer_ratio']:.0%}" if "buffer_ratio" in s else "100%") + " | "
                   + (_spread_ms(t["median"], [t["min"], t["max"]]) if (t := s.get("prefill_ms") or s.get("ttft_ms"))
                      else "—") + " |")
    return out + [""]


def _floor_clause(rows: list[dict]) -> str:
    if not rows or not all("floor_ms" in r for r in rows):
        return ""
    a, b = rows[0], rows[-1]
    return (f"Against the floor (stock transformers over a DynamicCache of the same KV), cached / floor is "
            f"{a['cached_over_floor']:.2f} at {a['prompt_tokens']} tokens and {b['cached_over_floor']:.2f} at "
            f"{b['prompt_tokens']}; floor / no cache {a['floor_over_nocache']:.2f} and {b['floor_over_nocache']:.2f}. ")


def _spread_ms(median: float, xs: list[float]) -> str:
    return f"{median:.0f} ms ({min(xs):.0f}–{max(xs):.0f})"


def _ms(x) -> str:
    return "—" if x is None else f"{x:.0f} ms"


RENAMED = {"prefixed": "contextual"}  # encoding modes renamed since these results were measured (same encoding)
ARM_NOTES = {"baseline": "baseline (full prefill)", "prefixed": "`contextual` (default encoding; `prefixed` then)",
             "isolated": "`isolated` (the paper's scheme)", "scaffold": "scaffold over all modules"}


def _arm(name: str) -> str:
    return ARM_NOTES.get(name, f"`{name}`")


def _arm_rows(summary: dict) -> list[str]:
    rows = ["| arm | needle found | 95 % CI | first token agrees | mean first-token KL | TTFT median (min–max) | "
            "TTFT × isolated, median (min–max) | recomputed tokens |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, v in summary.items():
        t = v["ttft_ms"]
        ratio = v.get("ttft_vs_isolated")
        rows.append(f"| {_arm(arm)} | **{v['accuracy']:.0%}** ({v['found']}/{v['n']}) | "
                    f"{v['ci95'][0]:.0%}–{v['ci95'][1]:.0%} | "
                    + ("— | — |" if arm == "baseline" else
                       f"{v['first_token_agreement']:.0%} | {v['mean_first_token_kl']:.3f} |")
                    + f" {t['median']:.0f} ms ({t['min']:.0f}–{t['max']:.0f}) | "
                    + (f"{ratio['median']:.2f}× ({ratio['min']:.2f}–{ratio['max']:.2f})" if ratio else
                       "1×" if arm == "isolated" else "—")
                    + f" | {v['recomputed_tokens']:.0f} |")
    return rows


def repair_section(f: dict) -> list[str]:
    """Fidelity with the repair and sink arms (issue 12): frontier tables, confusable needles, samples."""
    how = f"`{f['command']}`"
    if f.get("collected_by"):
        how = "rows collected by " + "; ".join(f"`{c}`" for c in f["collected_by"]) + f", summarised by {how}"
    out = [f"**Fidelity and repair** — {how} ({machine_line(f)}; {f['model']}, greedy, "
           f"{f['new_tokens']} new tokens; TTFTs move with machine load, so the ratio "
           f"to `isolated` is measured side by side on each prompt, median of {f['ttft_reps']} one-token runs per "
           "arm). Needle-in-a-haystack prompts over Paul Graham essay modules of ~250 tokens; found = the needle's "
           "7-digit number is in the answer. Arms: `MODE+sink N` encodes each isolated module after the prompt's "
           "first N tokens (the chat template's opening); `+repair K` recomputes K tokens at every link (each "
           "module that did not see what precedes it, and after each argument); `+first kept` leaves the first "
           "module's stored KV in place.", ""]
    for size, summary in f["frontier"].items():
        n = next(iter(summary.values()))["n"]
        out += [f"*{size} modules, one needle ({n} prompts):*", ""] + _arm_rows(summary) + [""]
    c = f.get("confusable")
    if c:
        n = next(iter(c.values()))["n"]
        out += [f"*Confusable needles: {f['confusable_modules']} modules, each with a needle of the same template for "
                f"another project; the question asks for one ({n} prompts; confused = another module's number "
                "answered):*", ""] + _arm_rows(c)
        out += ["", "Confused answers: " + ", ".join(f"{a} {v['confused']}" for a, v in c.items()) + ".", ""]
    samples = f.get("samples") or {}
    if samples:
        arms = f["sample_arms"]
        out += ["*Every sample schema's prompt: first-token KL against the baseline (✗ = the first token differs; "
                "8 new tokens):*", "", "| sample | " + " | ".join(f"`{a}`" for a in arms) + " |",
                "|---|" + "---:|" * len(arms)]
        for name, row in samples.items():
            out.append(f"| {name} | " + " | ".join(f"{row[a]['kl']:.3f}{'' if row[a]['agree'] else ' ✗'}"
                                                   for a in arms) + " |")
        out.append("")
    probe = f.get("ttft_probe")
    if probe:
        out += [f"*TTFT probe: one needle prompt of {probe['prompt_tokens']} tokens (8 modules, "
                f"{probe['uncached_tokens']} uncached), {probe['reps']} rounds of one-token runs with the arms "
                "interleaved after a warm-up round; the ratio to `isolated` is taken within each round:*", "",
                "| arm | recomputed tokens | TTFT median | TTFT min | × isolated, median (min–max) |",
                "|---|---:|---:|---:|---:|"]
        for arm, v in probe["arms"].items():
            out.append(f"| {_arm(arm)} | {v['recomputed_tokens']} | {v['median_ms']:.0f} ms | {v['min_ms']:.0f} ms | "
                       f"{v['ratio_median']:.2f}× ({v['ratio_min']:.2f}–{v['ratio_max']:.2f}) |")
        out.append("")
    out += [f"![Needle accuracy against TTFT, per arm]({ASSETS}/frontier.png)", ""]
    return out


def compression_section(c: dict, image: str = "memory") -> list[str]:
    s = c["summary"]
    mods = c["modules_per_prompt"]
    mods = " and ".join(map(str, mods)) if isinstance(mods, list) else str(mods)
    out = [f"**Smaller module memory** — `{c.get('command', 'python bench/compression.py')}` ({machine_line(c)}; "
           f"{c.get('model', '')}, {c['prompts']} {'varied-needle' if c.get('needles') == 'varied' else 'needle'} prompts of {mods} modules, greedy; bytes relative to the fp32 cached run, scales "
           "of int8 / int4 included; `question` stores whole modules and thins the run's cache after the question "
           "was prefilled, the other retentions drop tokens when the modules are stored):", "",
           "| configuration | stored module bytes | KV decoded over | needle found | 95 % CI | first token agrees with "
           "fp32 cached | KL vs fp32 cached | KL vs baseline |", "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(x):
        return "—" if x is None else f"{x:.0%}"

    for k, v in s.items():
        if k == "baseline":
            out.append(f"| baseline (full prefill) | — | — | {v['accuracy']:.0%} ({v['found']}/{v['n']}) | "
                       f"{v['ci95'][0]:.0%}–{v['ci95'][1]:.0%} | — | — | — |")
            continue
        out.append(f"| {k} | {pct(v.get('bytes_ratio'))} | {pct(v.get('buffer_ratio'))} | **{v['accuracy']:.0%}** "
                   f"({v['found']}/{v['n']}) | {v['ci95'][0]:.0%}–{v['ci95'][1]:.0%} | {v.get('agree_ref', 1.0):.0%} | "
                   f"{v.get('kl_ref', 0.0):.4f} | {v['kl_base']:.4f} |")
    at = c.get("at_4k")
    if at:
        out += ["", f"Decoding at {at['prompt_tokens']} tokens ({at['cached_tokens']} cached; {at['reps']} interleaved "
                f"repetitions of {at['new_tokens']} new tokens, median (min–max); timings move with machine "
                "load, so compare the ratios):", "",
                "| configuration | decode ms/token | vs full | KV decoded over | stored module KV | KV copy into the "
                "buffer (in TTFT) |", "|---|---:|---:|---:|---:|---:|"]
        for k, v in at["configs"].items():
            d = v["decode_ms_per_token"]
            out.append(f"| {k} | {d['median']:.0f} ({d['min']:.0f}–{d['max']:.0f}) | "
                       f"{v['decode_ratio_to_full']:.2f}× | {v['buffer_bytes_decoded_over'] / 2**20:.0f} MiB | "
                       f"{v['module_store_bytes'] / 2**20:.0f} MiB | {v['copy_ms']['median']:.0f} ms |")
    out += [""] + [f"- {v}" for v in c["verdicts"]] + [""]
    if at:
        out += [f"![Needle accuracy against module bytes]({ASSETS}/{image}.png)", ""]
    return out


def families_section(f: dict) -> list[str]:
    """The family table of bench/families.py: each check of tests/engine/test_families.py, per family."""
    mark = {"passed": "✓", "failed": "✗ (wrong result)", "error": "✗ (did not run)"}
    out = [f"**Model families** — `{f['command']}` ({machine_line(f)}): tiny random models built from each "
           "architecture's config (no download); baseline = stock means first logits within 1e-4 of `model(ids)` and "
           "the same greedy ids as `generate()`; the exactness checks compare the cached path with a one-pass prefill "
           "at the same position ids (sliding windows and ALiBi read at position ids).", "",
           "| family | runs | " + " | ".join(f["checks"]) + " |", "|---|:-:|" + ":-:|" * len(f["checks"])]
    for r in f["families"]:
        out.append(f"| {r['family']} | {'✓' if r['runs'] else '✗'} | "
                   + " | ".join(mark.get(r[c], r[c]) for c in f["checks"]) + " |")
    return out + [""]


def other_models() -> list[str]:
    """TTFT and fidelity of models other than the default (bench/results/ttft-MODEL.json, fidelity-MODEL.json)."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("ttft-*.json")):
        ttft = json.loads(path.read_text())
        suffix = path.stem[len("ttft-"):]
        if suffix == LEAD:  # it leads the section
            continue
        fid = load(f"fidelity-{suffix}")
        lines = "; ".join(f"{r['prompt_tokens']} tokens: {r['baseline_ttft_ms'] / 1000:.2f} s → "
                          f"{r['cached_ttft_ms']:.0f} ms (**{r['speedup']:.1f}×**)" for r in ttft["results"])
        out += [f"**{ttft['model']}** — `{ttft['command']}` ({machine_line(ttft)}; {ttft['dtype']}, median of "
                f"{ttft['reps']} after a warm-up, cached TTFT includes the KV copy): {lines}."]
        if fid:
            s = fid["summary"]
            tags = "with role tags" if fid.get("role_tags", True) else "without role tags (no chat template)"
            out[-1] += (f" Needle fidelity — `{fid['command']}`: {fid['prompts']} prompts, schemas {tags}; needle found "
                        + ", ".join(f"{p} {v['accuracy']:.0%} ({v['found']}/{v['n']})" for p, v in s.items())
                        + "; first token agrees with the baseline: "
                        + ", ".join(f"{p} {v['first_token_agreement']:.0%}" for p, v in s.items() if p != "baseline")
                        + ".")
        out.append("")
    return out


HEADLINE_PLOT = f"frontier-{LEAD}"  # the lead model's needle accuracy against TTFT, per arm: the trade in one picture


def _near(rows: list[dict], target: int) -> dict | None:
    """The row whose prompt length is closest to target (within 1.5× of it), else None."""
    best = min(rows, key=lambda r: abs(math.log(r["prompt_tokens"] / target)), default=None)
    return best if best and abs(math.log(best["prompt_tokens"] / target)) <= math.log(1.5) else None


def _speedup(r: dict) -> str:
    return (f"{r['prompt_tokens']:,} tokens {r['baseline_ttft_ms'] / 1000:.2f} s → {r['cached_ttft_ms']:.0f} ms "
            f"(**{r['speedup']:.1f}×**)")


def _found(v: dict, count: bool = False) -> str:
    """Accuracy with its 95 % Wilson interval (the result files' ci95), optionally the count."""
    k = f"{v['found']}/{v['n']}, " if count else ""
    return f"{v['accuracy']:.0%} ({k}{v['ci95'][0]:.0%}–{v['ci95'][1]:.0%})"


def _arm_name(arm: str) -> str:
    """An arm of the fidelity results as the headline names it."""
    if "+blend " in arm:
        return f"blend {arm.split('+blend ', 1)[1].split()[0]} %"
    if "+repair" in arm:
        return f"link-token repair (`{arm}`)"
    if "+sink" in arm:
        return f"sink encoding (`{arm}`)"
    return "baseline" if arm == "baseline" else f"modular `{RENAMED.get(arm, arm)}`"


def _blend_rule(arm: str) -> str:
    rest = arm.split("+blend ", 1)[1].split("+")[0].split()
    return rest[1] if len(rest) > 1 else "deviation"


def _short(model: str) -> str:
    """A model's name as the headline's short bullets give it."""
    return model.removesuffix("-Instruct")


def _pct(v: dict) -> str:
    return f"{v['accuracy']:.0%}"


def _ttft_bullets(ttft: dict | None, lead_ttft: dict | None) -> list[str]:
    speed = [f"{_short(d['model'])} " + ", ".join(map(_speedup, rows)) for d in (ttft, lead_ttft) if d
             for rows in [[r for r in (_near(d["results"], t) for t in (1024, 4096)) if r]] if rows]
    return [("- **Time to first token**, modular cache against a full prefill (KV copy included): "
             + "; ".join(speed) + ".")] if speed else []


def _gpu_bullet() -> list[str]:
    gpu, shaped = gpu_runs(), {d["storage"]: d for d in shape_runs()}
    if not gpu:
        return []
    rows = [r for d in gpu for r in d["results"]]
    base, sp = [r["baseline_ttft_ms"] for r in rows], [r["speedup"] for r in rows]
    line = (f"- **On a lent {gpu[0]['machine'].get('gpu', 'GPU')}**: {_short(gpu[0]['model'])}'s full prefill takes "
            f"{min(base):.0f}–{max(base):.0f} ms, so the modular arm has nothing to save ({min(sp):.2f}–{max(sp):.2f}×)")
    if "cuda" in shaped:
        r = _near(shaped["cuda"]["results"], 4096)
        other = shaped["cuda"]["machine"].get("gpu")
        where = f" on an {other}" if other and other != gpu[0]["machine"].get("gpu") else ""
        line += (f"; at Llama-2-7B's shape (random weights){where} {r['prompt_tokens']:,} tokens "
                 f"{r['baseline_ttft_ms']:.0f} ms"
                 f" → {r['cached_ttft_ms']:.0f} ms (**{r['speedup']:.1f}×**) from GPU memory" if r else "")
        if "cpu" in shaped:
            cpu = [x["speedup"] for x in shaped["cpu"]["results"]]
            line += f", {min(cpu):.2f}–{max(cpu):.2f}× from CPU memory"
    return [line + "."]


def _facts_bullets(fid: dict | None, exp: dict | None) -> list[str]:
    """Confusable facts and two facts in one question: the share of answers found per arm."""
    conf, two = load(f"fidelity-routed-{LEAD}"), load(f"fidelity-routed-two-{LEAD}")
    out = []
    if fid and fid.get("confusable"):
        c = fid["confusable"]
        parts = [f"baseline {_pct(c['baseline'])}", f"modular {_pct(c['prefixed'])}"]
        blends = [v["accuracy"] for a, v in c.items() if "+blend " in a]
        shares = sorted({int(a.split("+blend ", 1)[1].split()[0]) for a in c if "+blend " in a})
        best = max(((a, v) for a, v in ((exp or {}).get("confusable") or {}).items() if "+blend " in a),
                   key=lambda av: av[1]["accuracy"], default=None)
        if blends:
            parts.append(f"blend {min(blends):.0%}–{max(blends):.0%} recomputing {shares[0]}–{shares[-1]} % of the "
                         "cached tokens" + (f" ({_pct(best[1])} recomputing {_arm_name(best[0]).removeprefix('blend ')})"
                                            if best else ""))
        routed = ((conf or {}).get("confusable") or {}).get(ROUTED)
        if routed:
            parts.append(f"routed (int8 weights) {_pct(routed)}")
        out.append(f"- **Confusable facts** ({_short(fid['model'])}, {next(iter(c.values()))['n']} prompts × "
                   f"{fid['confusable_modules']} modules of one template, answer found): " + ", ".join(parts) + ".")
    t = (two or {}).get("two_fact") or {}
    if ROUTED in t:
        n = t["baseline"]["n"]
        out.append(f"- **Two facts in one question** ({n} prompts × {two['confusable_modules']} modules): routed {_pct(t[ROUTED])}, "
                   f"baseline {_pct(t['baseline'])}, modular {_pct(t['prefixed'])}.")
    return out


def routed_default() -> str:
    """The engine's default routed arm as the arm labels write it (bench/fidelity.py parse_arm), less '+tree': the
    focus is named where it is not 'on', the labels' own default."""
    from engine.arms.routed import DEFAULT_FOCUS, DEFAULT_SHARE

    focus = "" if DEFAULT_FOCUS == "on" else f"+focus {DEFAULT_FOCUS}"
    return f"{ROUTED}+share {round(DEFAULT_SHARE * 100)}{focus}"


def _spanning_bullet(span: dict | None) -> list[str]:
    """Questions that span modules: the routed arm at its defaults against the baseline, two facts on the confirm
    rows that ran it (pooled over the splits that did), else held-out; every module on the newest confirm rows that
    hold them, their arm named where it is not the default's (a tree setting on two facts is its share's run: the
    tree path needs every module kept, see spanning.py)."""
    summary = (span or {}).get("summary", {})
    arm = routed_default()
    confirms = [k for k in summary if k.startswith("confirm")]
    ran = [k for k in confirms if f"{arm}+tree" in summary[k].get("two/8/every phrasing", {})]
    split = max(ran, key=len) if ran else "heldout"
    used = arm if split == "heldout" else f"{arm}+tree"  # the confirm splits run the default with its tree everywhere
    two = (summary.get(split) or {}).get("two/8/every phrasing") or {}
    if used not in two or (split == "heldout" and two[used].get("every_kept")):
        return []
    alls = [k for k in confirms if "+" not in k and "all/4/every phrasing" in summary[k]] or ["heldout"]
    every_split = next((k for k in alls if k in ran), alls[-1])
    every = [summary.get(every_split, {}).get(f"all/{n}/every phrasing") or {} for n in (4, 8)]
    their = next((a for a in every[0] if a.startswith(arm.split("+share")[0]) and a.endswith("+tree")), None)
    if their is None or not all(their in e for e in every):
        return []
    recall = "; ".join(f"every module of {n}: recall {e[their]['recall']:.0%} (baseline "
                       f"{e['baseline']['recall']:.0%}, {e[their]['n']} prompts) at "
                       f"{e[their]['mean_ttft_vs_baseline']:.2f}×" for n, e in zip((4, 8), every))
    if their != f"{arm}+tree":
        paths = sorted({p for e in every for p in e[their].get("paths", {})})
        recall += (f" ({_split_name(every_split)}, `{their.replace(ROUTED, 'routed')}`: its prompts took "
                   f"the {' and '.join(paths)} paths, which neither the share nor the focus changes)")
    phrasings = ", ".join(f"{k.split('/')[2]} {v[used]['found']}/{v[used]['n']} ({v['baseline']['found']})"
                          for k, v in summary[split].items() if k.startswith("two/8/") and "every" not in k
                          and used in v)
    return [f"- **Questions that span modules** ({_short(span['model'])}, {_split_name(split)}, routed at its "
            f"defaults): two facts {two[used]['found']}/{two[used]['n']} (baseline {two['baseline']['found']}/"
            f"{two['baseline']['n']}; by phrasing {phrasings}) at {two[used]['mean_ttft_vs_baseline']:.2f}× the "
            f"baseline's mean TTFT; {recall}."]


def _split_name(split: str) -> str:
    """'heldout' -> 'held-out split', 'confirm+confirm2' -> 'confirm and confirm2 splits'."""
    parts = ["held-out" if p == "heldout" else p for p in split.split("+")]
    return f"{' and '.join(parts)} split{'s' if len(parts) > 1 else ''}"


def _workload_bullet(work: dict | None) -> list[str]:
    if not work or not {"baseline", "prefix", "cached"} <= set(work["arms"]):
        return []
    a, routed = work["arms"], load(f"workload-int8-{LEAD}")
    names = {"baseline": "baseline", "prefix": "prefix cache", "cached": "modular"}
    line = (f"- **Mixed workload** ({_short(work['model'])}, {len(work['prompts'])} prompts of 2–4 of "
            f"{work['modules']} modules; found, mean TTFT): " + ", ".join(
                f"{label} {a[k]['needle_found']}/{a[k]['n']} at {a[k]['mean_ttft_ms'] / 1000:.2f} s"
                for k, label in names.items()))
    if routed and "routed" in routed["arms"]:
        r = routed["arms"]
        line += (f"; with int8 weights routed {r['routed']['needle_found']}/{r['routed']['n']} at "
                 f"{r['routed']['mean_ttft_ms'] / 1000:.2f} s, baseline {r['baseline']['mean_ttft_ms'] / 1000:.2f} s")
    return [line + "."]


def _vllm_bullet(f: dict | None) -> list[str]:
    if not f:
        return []
    s, a = f["summary"], f["vllm_agreement"]
    cells = "; ".join(f"{name}: vLLM {arms['vllm']['mean_ttft_ms'] / arms['baseline']['mean_ttft_ms']:.2f}, prefix "
                      f"{arms['prefix']['mean_ttft_ms'] / arms['baseline']['mean_ttft_ms']:.2f}, modular "
                      f"{arms['cached']['mean_ttft_ms'] / arms['baseline']['mean_ttft_ms']:.2f}"
                      for name, arms in s.items())
    return [f"- **vLLM beside the studio** ({f['model']}, vLLM's CPU build): mean TTFT over the baseline's — {cells}; "
            f"vLLM's greedy answer is the local baseline's in {a['same_text']}/{a['prompts']} prompts "
            "([scale-out](docs/scale-out.md), [the table](docs/benchmarks.md))."]


def _memory_bullet(comps: list[dict]) -> list[str]:
    per_model, same = [], True
    for comp in comps:
        s = comp["summary"]
        ref = next((k for k in s if k.startswith("cached")), None)
        quant = [k for k in ("int8", "int4") if k in s]
        if ref and quant:
            same &= all(s[k]["found"] == s[ref]["found"] for k in quant)
            per_model.append(f"{_short(comp['model'])} fp32 {s[ref]['found']}/{s[ref]['n']}, "
                             + ", ".join(f"{k} {s[k]['found']}/{s[k]['n']}" for k in quant))
    if not per_model:
        return []
    s = comps[0]["summary"]
    kinds = [k for k in ("int8", "int4") if k in s]
    shares = " and ".join(f"{s[k]['bytes_ratio']:.0%}" for k in kinds)
    return [f"- **Module memory**: {' and '.join(kinds)} storage take {shares} of fp32's bytes, "
            + ("answers found as often" if same else "answers found") + " (" + "; ".join(per_model) + ")."]


def headline() -> str:
    """The README's headline block: a short bullet per measure (the tables are in docs/benchmarks.md), one plot."""
    out = [HEAD_START, ""]
    ttft, lead_ttft = load("ttft"), load(f"ttft-{LEAD}")
    fid, exp, work = load(f"fidelity-{LEAD}"), load(f"fidelity-blend-{LEAD}"), load(f"workload-{LEAD}")
    comps = [c for c in (load("compression"), load(f"compression-{LEAD}")) if c]
    ref = next((d for d in (ttft, lead_ttft, fid, work, *comps) if d), None)
    if ref is None:
        return "\n".join(out + ["No benchmark results yet: run `make bench`.", "", HEAD_END])
    m = ref["machine"]
    out += [f"On the reference machine ({m['threads']} CPU threads, {'a GPU' if m.get('cuda') else 'no GPU'}) unless a "
            "GPU is named; greedy decoding; written by `python bench/report.py --write-readme` from `bench/results/`. "
            "Every table, with its command, machine and 95 % intervals, is in [docs/benchmarks.md](docs/benchmarks.md).",
            ""]
    out += _ttft_bullets(ttft, lead_ttft) + _gpu_bullet() + _facts_bullets(fid, exp)
    out += _spanning_bullet(load(f"spanning-shares-{LEAD}")) + _workload_bullet(work)
    out += _vllm_bullet(load(f"vllm-reuse-{LEAD}"))
    out += prefill_headline(load("prefill")) + _memory_bullet(comps)
    model = (fid or {}).get("model", LEAD)
    out += ["", f"![Needle accuracy against TTFT per arm, {model}: one fact asked, and confusable facts]"
                f"(assets/{HEADLINE_PLOT}.png)", "", HEAD_END]
    return "\n".join(out)


def write(path: Path, start: str, end: str, text: str) -> None:
    body = path.read_text()
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(body):
        raise SystemExit(f"{path.relative_to(ROOT)} has no {start} ... {end} markers")
    path.write_text(pattern.sub(lambda _: text, body))
    print(f"{path.relative_to(ROOT)} updated")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-readme", "--write", dest="write", action="store_true",
                    help="write the headline into README.md and the section into docs/benchmarks.md")
    ap.add_argument("--headline", action="store_true", help="print the README's headline block")
    args = ap.parse_args()
    if not args.write:
        print(headline() if args.headline else section())
        return
    write(README, HEAD_START, HEAD_END, headline())
    write(PAGE, START, END, section())


if __name__ == "__main__":
    main()
