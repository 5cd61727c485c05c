"""The README's "Measured" section, generated from bench/results/*.json (never typed by hand).

    python bench/report.py                 # print the section
    python bench/report.py --write-readme  # replace it in README.md (between the markers)

A test checks that README.md holds exactly what this prints, so the numbers there are always
those of the result files, which the benchmark commands below wrote.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
START, END = "<!-- measured:start -->", "<!-- measured:end -->"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine_line(d: dict) -> str:
    m = d["machine"]
    gpu = "a CUDA GPU" if m.get("cuda") else "no GPU"
    return f"{m['date']}, {m['threads']} CPU threads ({m['cpu']}), {gpu}, torch {m['torch']}"


def section() -> str:
    out = [START, ""]
    ttft, scaling, memory = load("ttft"), load("scaling"), load("memory")
    fidelity, compression = load("fidelity"), load("compression")
    if ttft:
        out += [f"**Time to first token** — `python bench/ttft.py` ({machine_line(ttft)}; {ttft['model']}, "
                f"{ttft['dtype']}, {ttft['storage']} storage, `{ttft['mode']}` mode, median of {ttft['reps']} "
                f"after a warm-up; cached TTFT includes copying the modules' KV into the run's buffer):", "",
                "| prompt tokens | cached | uncached | baseline TTFT | cached TTFT | of which KV copy | speedup | "
                "decode ms/token baseline / cached |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ttft["results"]:
            out.append(f"| {r['prompt_tokens']} | {r['cached_tokens']} | {r['uncached_tokens']} | "
                       f"{r['baseline_ttft_ms'] / 1000:.2f} s | {r['cached_ttft_ms']:.0f} ms | "
                       f"{r['cached_copy_ms']:.1f} ms | **{r['speedup']:.1f}×** | "
                       f"{r['baseline_decode_ms_per_token']:.0f} / {r['cached_decode_ms_per_token']:.0f} |")
        out.append("")
    if scaling:
        f = scaling["fits"]
        out += [f"**Scaling** — `python bench/scaling.py` ({machine_line(scaling)}): baseline TTFT grows as "
                f"tokens^{f['baseline_ttft_power']['exponent']}, cached TTFT as "
                f"tokens^{f['cached_ttft_power']['exponent']}; cached TTFT against cached tokens is linear "
                f"({f['cached_ttft_vs_cached_tokens_linear']['slope_ms_per_token'] * 1000:.1f} µs per cached token, "
                f"R² {f['cached_ttft_vs_cached_tokens_linear']['r2']}). "
                + ("No GPU here, so the paper's GPU-storage cases were not run." if not scaling.get("gpu") else ""),
                "", "![TTFT against prompt length](assets/scaling.png)", ""]
    if memory:
        fam = {x["model"]: x for x in memory["families"]}
        picks = [m for m in ("Llama-2-7B", "Llama-2-13B", "Llama-2-70B", "Falcon-7B", "MPT-30B", "Llama-3.1-8B",
                             "SmolLM2-135M") if m in fam]
        out += [f"**Memory per cached token** — `python bench/memory.py` (from configs alone, fp16): " +
                ", ".join(f"{m} {fam[m]['fp16_mb_per_token']:.3g} MB" for m in picks) +
                f". The loaded model stores {memory['loaded']['kv_bytes_per_token']:,} bytes per token in "
                f"{memory['loaded']['dtype']}; measured store bytes equal the prediction for "
                f"{sum(s['match'] for s in memory['samples'])} of {len(memory['samples'])} sample schemas.", ""]
    if fidelity:
        s = fidelity["summary"]
        out += [f"**Fidelity** — `python bench/fidelity.py` ({machine_line(fidelity)}): {fidelity['prompts']} "
                "needle-in-a-haystack prompts over Paul Graham essay modules (4 and 8 modules of ~250 tokens), "
                "greedy; found = the needle's 7-digit number is in the answer.", "",
                "| path | needle found | 95 % CI | first token agrees with baseline | mean first-token KL | "
                "same text | ROUGE-L vs baseline |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        names = {"baseline": "baseline (full prefill)", "prefixed": "cached, `prefixed` (default)",
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
            for k, v in bym.items()) + ".", "", "![Needle accuracy by depth and modules](assets/fidelity.png)", ""]
    if compression:
        s = compression["summary"]
        out += [f"**Smaller modules** — `python bench/compression.py` ({machine_line(compression)}; "
                f"{compression['prompts']} needle prompts of {compression['modules_per_prompt']} modules):", "",
                "| stored as | module bytes | needle found | first token agrees with fp32 cached | KL vs fp32 cached | "
                "KL vs baseline |", "|---|---:|---:|---:|---:|---:|"]
        for k, v in s.items():
            if k == "baseline":
                out.append(f"| baseline (full prefill) | — | {v['accuracy']:.0%} | — | — | — |")
                continue
            out.append(f"| {k} | {v['bytes_ratio']:.0%} | {v['accuracy']:.0%} | "
                       f"{v.get('agree_ref', 1.0):.0%} | {v.get('kl_ref', 0.0):.4f} | {v['kl_base']:.4f} |")
        out += [""] + [f"- {v}" for v in compression["verdicts"]] + [""]
    out += other_models()
    if len(out) == 2:
        out += ["No benchmark results yet: run `make bench`.", ""]
    out.append(END)
    return "\n".join(out)


def other_models() -> list[str]:
    """TTFT and fidelity of models other than the default (bench/results/ttft-MODEL.json, fidelity-MODEL.json)."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("ttft-*.json")):
        ttft = json.loads(path.read_text())
        suffix = path.stem[len("ttft-"):]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args()
    text = section()
    if not args.write_readme:
        print(text)
        return
    readme = ROOT / "README.md"
    body = readme.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(body):
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    readme.write_text(pattern.sub(lambda _: text, body))
    print("README.md updated")


if __name__ == "__main__":
    main()
