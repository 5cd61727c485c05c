"""The benchmark pages, generated from bench/results/*.json (never typed by hand).

    python bench/report.py                 # print the Measured section (docs/benchmarks.md)
    python bench/report.py --headline      # print the README's headline block
    python bench/report.py --write-readme  # write both, between their markers (--write is the same)

docs/benchmarks.md holds the whole Measured section; README.md holds a short headline block drawn
from the same files. A test checks that both hold exactly what this prints, so the numbers there are
always those of the result files, which the benchmark commands named with them wrote.

The prose lives in bench/report_template.md, one named block per paragraph with placeholders; the
tables are specs (bench/tables.py, or the result file's own ``tables``). What is left here picks the
result files, the blocks and the rows, and computes the few values no result file holds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from functools import partial
from typing import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench import tables  # noqa: E402
from bench.common import RESULTS, ROOT  # noqa: E402
from bench.headline import headline as headline_block  # noqa: E402
from bench.labels import routed_default  # noqa: E402, F401  (the tests read the default's label here)
from bench.page import HEAD_END, HEAD_START, LEAD, first_n, gpu_runs, load, machine_line, say, table  # noqa: E402
from bench.report_gpu import gpu_section  # noqa: E402

README, PAGE = ROOT / "README.md", ROOT / "docs" / "benchmarks.md"
START, END = "<!-- measured:start -->", "<!-- measured:end -->"  # the section, in docs/benchmarks.md
BESIDE = "SmolLM2-135M-Instruct"  # the default model, measured beside it on the same varied sets
TTFT_CELL = "{prompt_tokens} tokens: {baseline_ttft_ms!k:.2f} s → {cached_ttft_ms:.0f} ms (**{speedup:.1f}×**)"
SHARES = "Questions that span modules: partial recompute"  # the routed arm recomputing a share of its modules


def beside(slug: str) -> list[str]:
    """The same varied needle sets on another model (bench/results/fidelity-SLUG.json), one line per set."""
    f = load(f"fidelity-{slug}")
    if not f:
        return []
    sets = [(f"{n} modules, one fact asked", s) for n, s in f["frontier"].items()] + \
        [(f"confusable, {f['confusable_modules']} modules", f.get("confusable") or {})]
    cells = [f"{label} ({first_n(s)} prompts): " + ", ".join(
        f"{'baseline' if a == 'baseline' else f'`{a}`'} {tables.fill('{accuracy:.0%} (' + tables.CI + ')', v)}"
        for a, v in s.items()) for label, s in sets if s]
    return [say("beside", f, sets="; ".join(cells))]


def parts(*named: tuple[str, Callable[[dict], list[str]]]) -> list[str]:
    """The page's parts in order: each (result file, what renders its document), left out where the file is missing."""
    return [line for name, render in named if (d := load(name)) for line in render(d)]


def section() -> str:
    lead = lead_section(LEAD) + parts((f"decode-{LEAD}", decode_section), ("prefill", prefill_section),
                                      ("browser-compare", browser_section))
    rest = parts(("ttft", ttft_section), ("scaling", scaling_section)) + gpu_section() + parts(
        ("peak-memory", peak_memory_section), ("workload", workload_section), ("memory", memory_section),
        ("fidelity", repair_section),
        ("compression", compression_section), ("families", families_section)) + other_models()
    body = lead + [say("default_model")] + rest if lead else rest
    return "\n".join([START, "", *(body or [say("no_results")]), END])


def scaling_section(d: dict) -> list[str]:
    rows, fit = d["results"], d["fits"]["cached_ttft_vs_cached_tokens_linear"]
    floor = say("floor_clause", a=rows[0], b=rows[-1]) if rows and all("floor_ms" in r for r in rows) else ""
    return [say("scaling", d, slope_us=fit["slope_ms_per_token"] * 1000, floor=floor,
                gpu=say("scaling_gpu" if gpu_runs() else "scaling_no_gpu"))]


def memory_section(d: dict) -> list[str]:
    fam = {x["model"]: x for x in d["families"]}
    picks = [m for m in ("Llama-2-7B", "Llama-2-13B", "Llama-2-70B", "Falcon-7B", "MPT-30B", "Llama-3.1-8B",
                         "SmolLM2-135M") if m in fam]
    return [say("memory", d, per_model=", ".join(f"{m} {fam[m]['fp16_mb_per_token']:.3g} MB" for m in picks),
                matched=sum(s["match"] for s in d["samples"]), samples=len(d["samples"]))]


def ttft_section(ttft: dict) -> list[str]:
    floor = all("floor_ms" in r for r in ttft["results"])
    rows = table("ttft" if floor else "ttft_no_floor", ttft, ttft["results"])
    return [say("ttft", ttft, table=rows)] + ([say("ttft_floor")] if floor else [])


def lead_section(slug: str) -> list[str]:
    """The lead model's results (fidelity with varied needles and blend, workload, precision, TTFT), if measured."""
    fid, work, prec, ttft = (load(f"{b}-{slug}") for b in ("fidelity", "workload", "precision", "ttft"))
    if not (fid or work or prec or ttft):
        return []
    routed = partial(routed_section, routing=load(f"routing-{slug}"), greetings=load(f"routed-greetings-{slug}"))
    out = [say("lead", slug=slug, model=next(d for d in (fid, work, prec, ttft) if d)["model"])] + parts(
        (f"fidelity-{slug}", partial(lead_fidelity, slug=slug)),
        (f"fidelity-blend-{slug}", partial(blend_further, slug=slug)), (f"fidelity-routed-{slug}", routed),
        *[(f"fidelity-routed-{name}-{slug}", partial(routed_section, further=True))
          for name in ("single", "two", "two-heldout")],
        (f"spanning-{slug}", spanning_section), (f"spanning-shares-{slug}", partial(spanning_section, title=SHARES)),
        (f"serve-{slug}", serve_section), (f"load-{slug}", load_section), (f"load-parts-{slug}", load_parts_section),
        (f"vllm-reuse-{slug}", vllm_reuse_section), (f"replicas-{slug}", replicas_section),
        (f"cli-decode-{slug}", partial(cli_decode, slug=slug)), (f"fidelity-ape-{slug}", ape_section),
        (f"workload-int8-{slug}", lambda w: workload_section(w, f"workload-int8-{slug}") if "routed" in w["arms"]
         else []))
    out += beside(BESIDE) + parts((f"workload-{slug}", partial(workload_section, result=f"workload-{slug}")),
                                  (f"workload-{BESIDE}", partial(workload_section, result=f"workload-{BESIDE}")))
    out += peers_section(load(f"peers-{slug}"), load(f"peers-kvpress-{slug}"), f"peers-{slug}",
                         load(f"peers-lengths-{slug}"))
    out += parts((f"compression-{slug}", partial(compression_section, image=f"memory-{slug}")),
                 (f"precision-{slug}", precision_section), ("first_compare", first_compare_section))
    lines = "; ".join(tables.fill(TTFT_CELL, r) for r in (ttft or {}).get("results", []))
    return out + ([say("lead_ttft", ttft, lines=lines)] if ttft else [])


def blend_further(exp: dict, slug: str) -> list[str]:
    """A later fidelity run of blend settings on the confusable set (bench/results/fidelity-blend-SLUG.json)."""
    if not exp.get("confusable"):
        return []
    made = " then ".join(f"`{c}`" for c in (exp.get("collected_by") or []) + [exp["command"]])
    return [say("blend_further", exp, made=made, n=first_n(exp["confusable"]), slug=slug,
                table="\n".join(confusable_table(exp)))]


def cli_decode(cli: dict, slug: str) -> list[str]:
    return [say("cli_decode", cli, slug=slug, weights=", ".join(cli["weights"]), runs=len(cli["runs"]))]


def first_compare_section(first: dict) -> list[str]:
    rows = [{**r, "tokens": " / ".join(str(a["new_tokens"]) for a in r["arms"].values()),
             "same": "yes" if r["modular_same_text"] else "no", "meets": "✓" if r["meets_default_bar"] else "✗"}
            for r in first["results"]]
    return [say("first_compare", first, table=table("first_compare", first, rows))]


def routed_section(f: dict, routing: dict | None = None, greetings: dict | None = None,
                   further: bool = False) -> list[str]:
    """The routed arm (issue 27): its ceilings and accuracy per set, where the question's pull points, greetings.
    ``further``: a later run of other sets, introduced by its command only."""
    out = [say("routed_further" if further else "routed", f, weights=f.get("weights", "fp32"))]
    for size, summary in f["frontier"].items():
        if first_n(summary) > 1 or not further:
            out.append(say("routed_single", size=size, n=first_n(summary), table=arm_table(summary, f)))
    if f.get("confusable"):
        out += [say("routed_confusable", f)] + confusable_table(f)
    if f.get("two_fact"):
        out += [say("routed_two", f, n=first_n(f["two_fact"]))]
        out += confusable_table({"confusable": f["two_fact"], "confusable_rows": f["two_fact_rows"]})
    if routing:
        out.append(say("routed_where", routing, lines="; ".join(_pull_lines(routing))))
    if greetings:
        out.append(say("routed_greetings", greetings, same=", ".join(
            f"`{k}` {v}/{greetings['prompts']}" for k, v in greetings["same_text"].items())))
    return out


def _pull_lines(routing: dict) -> list[str]:
    """Per set, how many prompts rank the asked module(s) first in the scout's layers and in the best window."""
    lines = []
    for label, name in (("confusable", "confusable"), ("two_fact", "two-fact")):
        got = routing.get(label) or {}
        if got:
            layers = [routing["scout_layers_now"][0], routing["scout_layers_now"][-1]]
            now = [w for w in got["pull"]["windows"] if w["layers"] == layers]
            lines.append(say("routed_pull", name=name, now=now[0], pull=got["pull"]["best_window"],
                             mass=got["mass"]["best_window"]) if now else name)
    return lines


def _chosen(f: dict) -> str:
    rejected = ", ".join(f"`{a}`" for a in f.get("rejected_by_confirm", []))
    if f["chosen_on_tune"]:
        return f"`{f['chosen_on_tune']}`" + (f" (rejected by the confirm splits: {rejected})" if rejected else "")
    return f"none left: the confirm splits rejected {rejected}, every setting the tune split keeps"


def spanning_section(f: dict, title: str = "Questions that span modules") -> list[str]:
    """Questions that span modules (issue 38): per split, set and phrasing, each arm's found (two facts) or recall
    (every module) and its mean TTFT over the baseline's."""
    out = [say("spanning", f, title=title)]
    if "chosen_on_tune" in f:  # issue 47: the routed arm's share settings, one chosen on the tune split
        out.append(say("spanning_shares", chosen=_chosen(f)))
    out += [say(f"spanning_{split}", split=split, seed=f["seeds"][split], arm=f["arms_run"][split][1])
            for split in ("confirm", "confirm2", "confirm3", "confirm4") if split in f["summary"]]
    rep = f["summary"].get("repeats")
    if rep:  # the identical-repeat line: routed (the API's default) against the prefix arm
        out.append(say("spanning_repeats", rep, paths=", ".join(f"{p} {n}" for p, n in sorted(rep["paths"].items()))))
    for split, groups in f["summary"].items():
        if split != "repeats":
            rows = [{**v, "kind": key.split("/")[0], "modules": key.split("/")[1], "phrasing": key.split("/")[2],
                     "arm": arm, "ratio": v.get("mean_ttft_vs_baseline", v.get("mean_ttft_vs_prefixed")),
                     "ref": "" if "mean_ttft_vs_baseline" in v else " (× modular)"}
                    for key, arms in groups.items() for arm, v in arms.items()]
            out.append(f"**{split}**\n\n{table('spanning', f, rows)}\n")
    return out


def serve_section(f: dict) -> list[str]:
    """The mixed workload through the OpenAI API (bench/serve.py): each configuration's client-side times and answers,
    llama.cpp's server beside, the API's overhead and the default arm it decided."""
    llama = f["configs"].get("llama.cpp server")
    rows = [{**v, "name": name, "vs_llama": v["mean_ttft_ms"] / llama["mean_ttft_ms"] if llama else None}
            for name, v in f["configs"].items()]
    out = [say("serve", f, vllm=say("serve_vllm", f) if f.get("vllm_server") else "", table=table("serve", f, rows))]
    served = [v["overhead_ms"]["median"] for v in f["configs"].values() if "overhead_ms" in v]
    if served:
        out.append(say("serve_overhead", low=min(served), high=max(served)))
    out += [say("serve_api_overhead", o, arm=arm) for arm, o in f.get("api_overhead", {}).items()]
    d = f.get("default_arm")
    if d:
        why = "; ".join(f"`{a}`: {'qualifies' if v['qualifies'] else ', '.join(v['why_not'])}"
                        for a, v in d["candidates"].items())
        out += ["", say("serve_default", d, why=why)]
    return out + [""]


def load_section(f: dict) -> list[str]:
    """Serving many at once (bench/load.py): each server's throughput, TTFT and answers at each level of clients."""
    rows = [{**level, "server": name, "clients": n} for name, srv in f["servers"].items()
            for n, level in srv["levels"].items()]
    first = {name: srv["warmup"]["first_request_ms"] for name, srv in f["servers"].items()}
    return [say("load", f, table=table("load", f, rows), levels_text=", ".join(map(str, f["levels"])),
                first=", ".join(f"{k} {v / 1000:.1f} s" for k, v in first.items()),
                image=f"{tables.fill('load-{model}', f)}.png", checks=_load_checks(f.get("checks") or {}))]


def load_parts_section(f: dict) -> list[str]:
    """What a loaded level's parts cost (bench/load_parts.py): a decode step by rows, fills fused, the bound."""
    steps, fills, b = f["decode_step_ms"], f["fused_fills"], f.get("bound")
    bound = "" if not b else (
        f"With fills one at a time a request costs its fill and its share of the 8-row steps; with {b['from']}'s fills "
        f"({b['one_client']['fill_ms']:.0f} ms a request at one client, {b['eight_clients']['fill_ms']:.0f} ms at 8) "
        f"and output tokens ({b['one_client']['tokens']:g} and {b['eight_clients']['tokens']:g}), the throughput at 8 "
        f"clients is at most **{b['throughput_8_over_1_at_most']:.2f}×** the one at 1 client, and at most "
        f"{b['at_most_if_8_rows_cost_1']:.2f}× were a step of 8 rows to cost what one row's does.")
    return [say("load_parts", f, steps=" / ".join(f"{s['median']:.1f}" for s in steps.values()),
                rows=", ".join(steps), fill=fills["fill_ms"]["median"], products=fills["products_ms"]["median"],
                saved=" / ".join(f"{v['saved_of_fills']:.0%}" for v in fills["fused"].values()),
                ks=", ".join(fills["fused"]), bound=bound)]


def _load_checks(checks: dict) -> str:
    said = {"studio_throughput_8_over_1": "The studio's throughput at 8 clients is {:.2f}× its own at 1",
            "studio_over_vllm_throughput_8": "{:.2f}× vLLM's at 8 clients",
            "studio_over_vllm_ttft_p95_8": "its TTFT p95 at 8 clients {:.2f}× vLLM's"}
    return "; ".join(said[k].format(v) for k, v in checks.items() if k in said)


def vllm_reuse_section(f: dict) -> list[str]:
    """What vLLM's prefix cache reuses of recurring, reordered and subset module sets (bench/vllm_reuse.py), against
    the studio's arms on the same prompts, and the vllm arm's agreement with the local baseline."""
    rows = [{**r, "set": name, "arm": arm} for name, arms in f["summary"].items() for arm, r in arms.items()]
    shared = say("vllm_shared", f) if f.get("shared_machine") else ""
    return [say("vllm_reuse", f, shared=shared, table=table("vllm_reuse", f, rows))]


def replicas_section(f: dict) -> list[str]:
    """One document workload through one vLLM replica, two behind vllm-router (round_robin; consistent_hash with
    the front's key) and two studio workers behind it (bench/replicas.py)."""
    one = f["configs"]["1 replica"]["summary"]["cached_share"]
    rows = [{**c["summary"], "name": name, "vs_one": c["summary"]["cached_share"] / one if one and "replica" in name
             else None, "spread": " / ".join(f"{n:,}" for n in c.get("replica_prompt_tokens", [])) or None}
            for name, c in f["configs"].items()]
    shared = say("vllm_shared", f) if f.get("shared_machine") else ""
    return [say("replicas", f, shared=shared, table=table("replicas", f, rows))]


def cell_of(v: dict) -> str:
    return tables.fill("{accuracy:.0%} ({found}/{n}, " + tables.CI + ")", v)


def ape_section(f: dict) -> list[str]:
    """APE at query time (issue 27): the confusable set's accuracy per temperature T and scale S."""
    c, grid = f.get("confusable"), {}
    if not c:
        return []
    for arm, v in c.items():
        m = re.fullmatch(r"prefixed\+ape (\d+) (\d+)", arm)
        if m:
            grid[(int(m.group(1)), int(m.group(2)))] = v
    if "prefixed" in c:
        grid[(100, 100)] = c["prefixed"]
    ts, ss = sorted({t for t, _ in grid}), sorted({s for _, s in grid})
    rows = [{"t": t / 100, "cells": {f"{s / 100:.1f}": f"{grid[(t, s)]['found']}/{grid[(t, s)]['n']}" + (
        " (off)" if (t, s) == (100, 100) else "") if (t, s) in grid else "—" for s in ss}} for t in ts]
    on = {k: v for k, v in grid.items() if k != (100, 100)}
    top = max(v["found"] for v in on.values())
    best = [k for k, v in on.items() if v["found"] == top]
    named = [("Best with APE on: " + " and ".join(f"T = {t / 100:.1f}, S = {s_ / 100:.1f}" for t, s_ in best) + ",",
              grid[best[0]]), ("; APE's own default (T = S = 0.9)", grid.get((90, 90))),
             ("; off (the modular arm)", grid.get((100, 100))), ("; the baseline", c.get("baseline"))]
    named += [(f"; `{a}`", v) for a, v in c.items() if "+route" in a]
    line = "".join(f"{label} {cell_of(v)}" for label, v in named if v)
    if (100, 100) in grid and top <= grid[(100, 100)]["found"]:
        line += say("ape_off")
    grid_table = table("ape", f, rows, [f"{s / 100:.1f}" for s in ss])
    return [say("ape", f, n=first_n(c), weights=f.get("weights", "fp32"), table=grid_table, line=line)]


def lead_fidelity(f: dict, slug: str) -> list[str]:
    out = [say("lead_fidelity", f, dtype=f.get("dtype", ""))]
    out += [say("lead_set", size=size, n=first_n(s), table=arm_table(s, f)) for size, s in f["frontier"].items()]
    if f.get("confusable"):
        out += [say("lead_confusable", f, n=first_n(f["confusable"]))] + confusable_table(f)
    for name, row in (f.get("samples") or {}).items():
        out.append(say("lead_sample", row, name=name, kls=", ".join(
            f"`{a}` {row[a]['kl']:.3f}{'' if row[a]['agree'] else ' (first token differs)'}"
            for a in f["sample_arms"])))
    return out + [say("lead_image", slug=slug)]


def decode_section(d: dict) -> list[str]:
    """Decode speed and fidelity per weight precision (bench/decode.py)."""
    rows = [{**r, "kl_mean": sum(r["first_token_kl"]["all"]) / len(r["first_token_kl"]["all"])}
            if r.get("first_token_kl") else {**r, "same_text": None} for r in d["results"]]
    return [say("decode", d, table=table("decode", d, rows))] + needles_per_precision()


def prefill_section(d: dict) -> list[str]:
    """Full prefill against the GEMM floors and llama.cpp (bench/prefill.py)."""
    v, kernels, ll = d["verdicts"], list(d["studio"]), d["llama_cpp"]
    used = tables.KERNEL_FLOOR.get(d["studio"][v["new"]]["kernel"])
    rows = [{"tokens": int(n), "studio": {k: d["studio"][k]["by_length"][n] for k in kernels},
             "llama_cpp": ll["by_length"][n] if "by_length" in ll else None,
             "floors": {x: d["floors"].get(x, {}).get(n, {}).get("s") or None for x in tables.FLOORS},
             "linear_s": d["studio"][kernels[0]]["by_length"][n].get("linear_s") or None,
             "over_floor": v["by_length"][n].get(f"prefill_over_{used}_floor") or None,
             "nonlinear_s": v["by_length"][n].get("nonlinear_s"),
             "attention_s": d.get("attention_floors", {}).get("float32", {}).get(n, {}).get("s"),
             "over_fastest": v["by_length"][n].get("prefill_over_fastest_floor"),
             "fastest": tables.FLOORS.get(fastest := v["by_length"][n].get("fastest_floor"), fastest)}
            for n in map(str, d["lengths"])]
    enc, others = d["encoding"], "".join(f"; `{k}` {x['mean_kl']:.2g}" for k, x in d["kl"].items() if k != v["new"])
    one = v["old"] == v["new"]  # one kernel timed: nothing to set it against
    return [say("prefill", d, m=d["machine"], units="yes" if d["machine"]["bf16_units"] else "no",
                llama=ll["error"] if "error" in ll else f"{ll['version']}, {ll['threads']} threads",
                table=table("prefill", d, rows, kernels), enc_new=enc[v["new"]], dec_new=d["decode"][v["new"]],
                enc_vs="" if one else f", {enc[v['old']]['median']:.2f} s with `{v['old']}` ({v['encoding_speedup']}×)",
                dec_vs="" if one else f" against {d['decode'][v['old']]['median']:.1f} ({v['decode_ratio']}×)",
                v=v, others=others)] + profile_part(d)


def profile_part(d: dict) -> list[str]:
    """Where one full prefill's time goes (torch.profiler, self time by group), where the run profiled one."""
    pr = d.get("profile")
    if not pr:
        return []
    total = sum(pr["groups"].values()) or 1
    rows = [{"group": g, "s": s, "share": s / total} for g, s in sorted(pr["groups"].items(), key=lambda x: -x[1])]
    ops = ", ".join(f"`{o['op']}` {o['self_s']:.2f} s" for o in pr["top_ops"][:6])
    return [say("prefill_profile", d, pr=pr, ops=ops, table=table("prefill_profile", d, rows))]


def needles_per_precision() -> list[str]:
    """The baseline's needle accuracy per weight precision (bench/fidelity.py --weights W, baseline only)."""
    runs = [(w, load(f"fidelity-{LEAD}" + ("" if w == "fp32" else f"-{w}")))
            for w in ("fp32", "bf16", "int8", "int4", "gguf")]
    runs = [(w, f) for w, f in runs if f and f.get("confusable", {}).get("baseline")]
    if len(runs) < 2:
        return []
    rows = [{"weights": w, "single": f["summary"]["baseline"], "confusable": f["confusable"]["baseline"],
             "command": f["command"]} for w, f in runs]
    return [say("needles_per_precision", table=table("needles_per_precision", None, rows))]


def browser_section(d: dict) -> list[str]:
    """What a user waits for in chromium, and the studio's decode against `pml-studio run`'s
    (bench/browser_compare.py)."""
    tokens = d.get("ratio_new_tokens", d["new_tokens"])
    how = say("browser_pairs", d, tokens=tokens) if d.get("pairs") else say("browser_after")
    return [say("browser", d, arms=", ".join(d["arms"]), how=how,
                table=table("browser", d, {**d, "tokens": tokens}))]


def peak_memory_section(d: dict) -> list[str]:
    """What reading a run's peak memory costs its TTFT (bench/peak_memory.py)."""
    cells = [f"{arm} at {r['prompt_tokens']:,} tokens: thread "
             f"{methods['thread 5 ms (before)']['ratio_to_none']['median']:.3f}×, VmHWM "
             f"{methods['hwm (now)']['ratio_to_none']['median']:.3f}×"
             for r in d["results"] for arm, methods in r["arms"].items()]
    return [say("peak_memory", d, cells="; ".join(cells), cost=(d["thread_cost_median_max"] - 1) * 100)]


def confusable_table(f: dict) -> list[str]:
    """The confusable set's arms: accuracy, confusions, agreement, TTFT and its ratio to `prefixed` on each prompt."""
    c, prompts, rows = f["confusable"], f["confusable_rows"], []
    for arm, v in c.items():
        xs = sorted(r[arm]["ttft_ms"] / r["prefixed"]["ttft_ms"] for r in prompts) if "prefixed" in c else None
        ratio = {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]} if xs else None
        rows.append({**v, "label": _arm(arm), "vs_prefixed": ratio})
    out = [table("confusable", f, rows), ""]
    blends = {a: v for a, v in c.items() if "+blend " in a}
    if blends and "baseline" in c:
        base = c["baseline"]["accuracy"]
        close = [a for a, v in blends.items() if base - v["accuracy"] <= 0.05]
        points = ", ".join(f"`{a.split('+', 1)[1]}` {(v['accuracy'] - base) * 100:+.0f} points"
                           for a, v in blends.items())
        out.append(say("blend_close" if close else "blend_none", base=base, points=points,
                       close=", ".join(f"`{a}`" for a in close)))
    return out


def precision_section(p: dict) -> list[str]:
    """bench/precision.py: fp32 against bf16 compute, TTFT / decode / KL / accuracy, and the default."""
    ttft = [{**r, "dtype": dt, "d": r[dt]} for r in p["ttft"] for dt in ("fp32", "bf16")]
    needles = [{**v, "label": label, "modules": p["needle_modules"], "arm": arm}
               for label, summary in p["needles"].items() for arm, v in summary.items()]
    return [say("precision", p, ttft=table("precision_ttft", p, ttft), needles=table("precision_needles", p, needles))]


def workload_section(w: dict, result: str = "workload") -> list[str]:
    arms, ratios, rows = w["arms"], w["ratios"], w["prompts"]
    names = {"baseline": "baseline (full prefill)", "prefix": "prefix cache (exact, longest token prefix)",
             "cached": "modular cache (`" + w["mode"] + "`)"}
    if w.get("blend"):
        names["blend"] = f"blend {w['blend']:.0%} (`{w.get('blend_rule', 'deviation')}`)"
    varied = "answer" in rows[0]
    warm = say("workload_warm", w["warmup"], count=len(w["warmup"]["modules"])) if w.get("warmup") else \
        say("workload_cold")
    runs = [{**s, "name": names.get(arm, arm)} for arm, s in arms.items()]
    variants = [v for v in map(lambda p: json.loads(p.read_text()), sorted(RESULTS.glob("workload-*.json")))
                if "cached" in v["arms"] and v is not w and v["model"] == w["model"]
                and (v["seed"], v["modules"], len(v["prompts"])) == (w["seed"], w["modules"], len(rows))
                and v["command"] != w["command"] and ("answer" in v["prompts"][0]) == ("answer" in rows[0])]
    runs += [{**v["arms"]["cached"], "name": f"modular cache (`{v['variant']}`)"} for v in variants]
    return [say("workload", w, tokens=round(sum(w["module_tokens"]) / len(w["module_tokens"])),
                needles=say("workload_varied" if varied else "workload_needle"), prompts=len(rows),
                in_order=sum(r["schema_order"] for r in rows), asks=say("workload_asks" if varied else "workload_ask"),
                warm=warm, table=table("workload", w, runs), facts="; ".join(_workload_facts(arms, ratios, variants)),
                result=result)]


def _workload_facts(arms: dict, ratios: dict, variants: list[dict]) -> list[str]:
    facts = []
    if ratios.get("cached_over_prefix_mean") is not None:
        facts.append(say("workload_vs_prefix", ratios))
    if ratios.get("prefix_over_baseline_schema_order") is not None:
        facts.append(say("workload_prefix_vs_baseline", ratios))
    for arm in (a for a in arms if a.startswith("blend")):
        b = arms[arm]
        facts.append(say("workload_blend", arm=arm, over_prefix=b["mean_ttft_ms"] / arms["prefix"]["mean_ttft_ms"],
                         over_cached=b["mean_ttft_ms"] / arms["cached"]["mean_ttft_ms"],
                         more=b["needle_found"] - arms["baseline"]["needle_found"])
                     if {"prefix", "cached", "baseline"} <= set(arms) else arm)
    if "prefix" in arms:
        facts.append(say("workload_reuse_broke", arms["prefix"]))
        if arms["prefix"].get("same_answers_as_baseline") is not None:
            facts.append(say("workload_prefix_same", arms["prefix"]))
    if variants:
        facts.append(say("workload_variants", commands=", ".join(f"`{v['command']}`" for v in variants)))
    return facts


def peers_section(p: dict | None, kv: dict | None, image: str, older: dict | None = None) -> list[str]:
    """bench/peers.py: llama.cpp on the same GGUF and token ids, kvpress's presses, beside the studio's arms.
    ``older``: the lengths section of an earlier run, shown (with its own command) when the latest has none."""
    out = [] if p is not None else [say("peers_missing")]
    p = p or {}
    if "workload" in p:
        out += peers_workload(p, image)
    source = p if "lengths" in p else older
    if source and "lengths" in source:
        said = "same command" if source is p else f"`{source['command']}`, {machine_line(source)}"
        out += peers_lengths(source, said)
    return out + (kvpress_table(kv) if kv is not None and "kvpress" in kv else [])


def peers_workload(p: dict, image: str) -> list[str]:
    w = p["workload"]
    lc, nth = w.get("llama.cpp", {}), next((v for k, v in w.items() if k.startswith("time_to_token_")), {})
    studio = say("peers_gguf") if p.get("weights") == "gguf" else \
        say("peers_dequantized", weights=p.get("weights", "fp32"))
    rows = [say("peers_error", label=tables.PEER_NAMES.get(name, name), error=s["error"]) if "error" in s else
            {**s, "label": tables.PEER_NAMES.get(name, name), "to_n": nth.get(name),
             "decode_median": (s.get("decode_ms_per_token") or {}).get("median", 0)}
            for name, s in list(w["arms"].items()) + list(w["peers"].items())]
    out = [say("peers", p, lc_version=lc.get("llama_cpp_python", "?"), lc_threads=lc.get("threads", "?"), studio=studio,
               prompts=len(w["prompts"]), in_order=sum(r["schema_order"] for r in w["prompts"]),
               table=table("peers", p, rows, new_tokens=p.get("new_tokens", 32)))]
    r = p["ratios"]
    if "cached_over_llamacpp_prefix_mean" in r:
        to_n = next((k for k in r if k.startswith("cached_over_llamacpp_prefix_time_to_token_")), None)
        wins = r["cached_over_llamacpp_prefix_peer_faster_prompts"]
        facts = [say("peers_ratio", r, pp=r["cached_over_llamacpp_prefix_per_prompt"]), say("peers_ratio_peers", r)]
        facts += [say("peers_ratio_to_n", n=to_n.split("_")[-2], ratio=r[to_n])] if to_n else []
        where = say("peers_wins_where", r) if wins else ""
        facts.append(say("peers_wins", r, wins=wins, n=len(w["prompts"]), where=where))
        facts += [say("peers_blend", r)] if w["arms"].get("blend") else []
        out += ["", "Ratios: " + "; ".join(facts) + ".", ""]
    return out + [say("peers_image", image=image)]


def peers_lengths(source: dict, said: str) -> list[str]:
    ln = source["lengths"]
    pts = ln["points"]
    engines = list(dict.fromkeys(x["dtype"] for x in pts))
    rows = []
    for t in sorted({x["target_tokens"] for x in pts}):
        row = {x["dtype"]: x for x in pts if x["target_tokens"] == t}
        cached = row.get("float32", {}).get("cached_ttft_ms")
        rows.append({"prompt_tokens": next(iter(row.values()))["prompt_tokens"],
                     "ttft": {tables.ENGINE_NAMES.get(e, e): _spread_ms(x["baseline_ttft_ms"],
                                                                        x["baseline_ttft_ms_all"])
                              for e, x in row.items()},
                     "cached": _spread_ms(cached, row["float32"]["cached_ttft_ms_all"]) if cached else None,
                     "decode": {tables.ENGINE_NAMES.get(e, e): x.get("baseline_decode_ms_per_token") or None
                                for e, x in row.items()}})
    names = [tables.ENGINE_NAMES.get(e, e) for e in engines]
    out = [say("peers_lengths", said=said, reps=len(pts[0]["baseline_ttft_ms_all"]),
               table=table("peers_lengths", source, rows, names))]
    if "error" in ln.get("llama.cpp", {}):
        out.append(say("peers_lengths_error", error=ln["llama.cpp"]["error"]))
    return out + [""]


def kvpress_table(f: dict) -> list[str]:
    sec = f["kvpress"]
    k = sec["kvpress"]
    info = say("kvpress_ran", k) if "kvpress" in k else say("kvpress_failed", error=k.get("error"))
    rows = []
    for name, s in sec["summary"].items():
        if "error" in s:
            rows.append(say("kvpress_error", error=s["error"]))
            continue
        method, kept = (name.rsplit(" ", 1) if name.endswith("%") else (name, "100%"))
        times = [r[name]["ttft_ms"] for r in sec["prompts"] if "ttft_ms" in r.get(name, {})]
        if "ttft_ms" not in s and times:  # the studio's rows carry their runs' TTFT
            s = {**s, "ttft_ms": {"median": statistics.median(times), "min": min(times), "max": max(times)}}
        rows.append({**s, "method": tables.KV_NAMES.get(method, method), "kept": kept,
                     "time": s.get("prefill_ms") or s.get("ttft_ms") or None})
    return [say("kvpress", f, info=info, prompts=len(sec["prompts"]), modules=sec["modules"],
                table=table("kvpress", f, rows))]


def _spread_ms(median: float, xs: list[float]) -> str:
    return f"{median:.0f} ms ({min(xs):.0f}–{max(xs):.0f})"


def _arm(name: str) -> str:
    return tables.ARM_NOTES.get(name, f"`{name}`")


def arm_table(summary: dict, f: dict | None = None) -> str:
    return table("arms", f, [{**v, "label": _arm(arm), "no_ratio": "1×" if arm == "isolated" else "—"}
                             for arm, v in summary.items()])


def repair_section(f: dict) -> list[str]:
    """Fidelity with the repair and sink arms (issue 12): frontier tables, confusable needles, samples."""
    how = f"`{f['command']}`"
    if f.get("collected_by"):
        how = "rows collected by " + "; ".join(f"`{c}`" for c in f["collected_by"]) + f", summarised by {how}"
    out = [say("repair", f, how=how)]
    out += [say("repair_set", size=size, n=first_n(s), table=arm_table(s, f)) for size, s in f["frontier"].items()]
    c = f.get("confusable")
    if c:
        out.append(say("repair_confusable", f, n=first_n(c), table=arm_table(c, f),
                       confused=", ".join(f"{a} {v['confused']}" for a, v in c.items())))
    if f.get("samples"):
        rows = [{"name": name, "arms": {a: {"kl": row[a]["kl"], "mark": "" if row[a]["agree"] else " ✗"}
                                        for a in f["sample_arms"]}} for name, row in f["samples"].items()]
        out.append(say("repair_samples", table=table("samples", f, rows, f["sample_arms"])))
    probe = f.get("ttft_probe")
    if probe:
        rows = [{**v, "label": _arm(arm)} for arm, v in probe["arms"].items()]
        out.append(say("repair_probe", probe, table=table("probe", f, rows)))
    return out + [say("repair_image")]


def compression_section(c: dict, image: str = "memory") -> list[str]:
    mods = c["modules_per_prompt"]
    rows = [{**v, "name": "baseline (full prefill)", "bold": "", "kl_base": None} if k == "baseline" else
            {"agree_ref": 1.0, "kl_ref": 0.0, **v, "name": k, "bold": "**"} for k, v in c["summary"].items()]
    at = c.get("at_4k")
    out = [say("compression", c, command=c.get("command", "python bench/compression.py"), model=c.get("model", ""),
               kind="varied-needle" if c.get("needles") == "varied" else "needle", table=table("compression", c, rows),
               mods=" and ".join(map(str, mods)) if isinstance(mods, list) else str(mods))]
    if at:
        at_rows = [{**v, "name": k} for k, v in at["configs"].items()]
        out += ["", say("compression_at_4k", at, table=table("compression_at_4k", c, at_rows))]
    out += ["", *(f"- {v}" for v in c["verdicts"]), ""]
    return out + ([say("compression_image", image=image)] if at else [])


def families_section(f: dict) -> list[str]:
    """The family table of bench/families.py: each check of tests/engine/test_families.py, per family."""
    mark = {"passed": "✓", "failed": "✗ (wrong result)", "error": "✗ (did not run)"}
    rows = [{"family": r["family"], "runs": "✓" if r["runs"] else "✗",
             "marks": {c: mark.get(r[c], r[c]) for c in f["checks"]}} for r in f["families"]]
    return [say("families", f, table=table("families", f, rows, f["checks"]))]


def other_models() -> list[str]:
    """TTFT and fidelity of models other than the default (bench/results/ttft-MODEL.json, fidelity-MODEL.json)."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("ttft-*.json")):
        ttft, suffix = json.loads(path.read_text()), path.stem[len("ttft-"):]
        if suffix == LEAD:  # it leads the section
            continue
        fid = load(f"fidelity-{suffix}")
        line = say("other_model", ttft, lines="; ".join(tables.fill(TTFT_CELL, r) for r in ttft["results"]))
        if fid:
            s = fid["summary"]
            line += say("other_fidelity", fid, tags=say("tags" if fid.get("role_tags", True) else "no_tags"),
                        found=", ".join(f"{p} {v['accuracy']:.0%} ({v['found']}/{v['n']})" for p, v in s.items()),
                        agree=", ".join(f"{p} {v['first_token_agreement']:.0%}" for p, v in s.items()
                                        if p != "baseline"))
        out += [line, ""]
    return out


def write(path: Path, start: str, end: str, text: str) -> None:
    body = path.read_text()
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(body):
        raise SystemExit(f"{path.relative_to(ROOT)} has no {start} ... {end} markers")
    path.write_text(pattern.sub(lambda _: text, body))
    print(f"{path.relative_to(ROOT)} updated")


def headline() -> str:
    """The README's headline block (bench/headline.py)."""
    return headline_block()


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
