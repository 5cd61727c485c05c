"""The README's headline block: a short bullet per measure, drawn from bench/results/*.json like the Measured section
of docs/benchmarks.md (bench/report.py, which writes both); the bullets' prose is in bench/report_template.md."""

from __future__ import annotations

import math

from bench import tables
from bench.labels import ROUTED, routed_default
from bench.page import HEAD_END, HEAD_START, LEAD, first_n, gpu_runs, load, say, shape_runs, span

HEADLINE_PLOT = f"frontier-{LEAD}"  # the lead model's needle accuracy against TTFT, per arm: the trade in one picture
RENAMED = {"prefixed": "contextual"}  # encoding modes renamed since these results were measured (same encoding)


def headline() -> str:
    """The README's headline block: a short bullet per measure (the tables are in docs/benchmarks.md), one plot."""
    ttft, lead_ttft = load("ttft"), load(f"ttft-{LEAD}")
    fid, exp, work = load(f"fidelity-{LEAD}"), load(f"fidelity-blend-{LEAD}"), load(f"workload-{LEAD}")
    comps = [c for c in (load("compression"), load(f"compression-{LEAD}")) if c]
    ref = next((d for d in (ttft, lead_ttft, fid, work, *comps) if d), None)
    if ref is None:
        return "\n".join([HEAD_START, "", say("no_results"), HEAD_END])
    out = [HEAD_START, "", say("head", m=ref["machine"], gpu="a GPU" if ref["machine"].get("cuda") else "no GPU")]
    out += _ttft_bullets(ttft, lead_ttft) + _gpu_bullet() + _facts_bullets(fid, exp)
    out += _spanning_bullet(load(f"spanning-shares-{LEAD}")) + _workload_bullet(work)
    out += _vllm_bullet(load(f"vllm-reuse-{LEAD}")) + _load_bullet(load(f"load-{LEAD}"))
    out += prefill_headline(load("prefill")) + _memory_bullet(comps)
    out += ["", say("head_plot", model=(fid or {}).get("model", LEAD), plot=HEADLINE_PLOT), HEAD_END]
    return "\n".join(out)


def _near(rows: list[dict], target: int) -> dict | None:
    """The row whose prompt length is closest to target (within 1.5× of it), else None."""
    best = min(rows, key=lambda r: abs(math.log(r["prompt_tokens"] / target)), default=None)
    return best if best and abs(math.log(best["prompt_tokens"] / target)) <= math.log(1.5) else None


def _speedup(r: dict) -> str:
    return tables.fill("{prompt_tokens:,} tokens {baseline_ttft_ms!k:.2f} s → {cached_ttft_ms:.0f} ms "
                       "(**{speedup:.1f}×**)", r)


def _arm_name(arm: str) -> str:
    """An arm of the fidelity results as the headline names it."""
    if "+blend " in arm:
        return f"blend {arm.split('+blend ', 1)[1].split()[0]} %"
    if "+repair" in arm:
        return f"link-token repair (`{arm}`)"
    if "+sink" in arm:
        return f"sink encoding (`{arm}`)"
    return "baseline" if arm == "baseline" else f"modular `{RENAMED.get(arm, arm)}`"


def _short(model: str) -> str:
    """A model's name as the headline's short bullets give it."""
    return model.removesuffix("-Instruct")


def _pct(v: dict) -> str:
    return f"{v['accuracy']:.0%}"


def _ttft_bullets(ttft: dict | None, lead_ttft: dict | None) -> list[str]:
    speed = [f"{_short(d['model'])} " + ", ".join(map(_speedup, rows)) for d in (ttft, lead_ttft) if d
             for rows in [[r for r in (_near(d["results"], t) for t in (1024, 4096)) if r]] if rows]
    return [say("head_ttft", speed="; ".join(speed))] if speed else []


def _gpu_bullet() -> list[str]:
    gpu, shaped = gpu_runs(), {d["storage"]: d for d in shape_runs()}
    if not gpu:
        return []
    rows = [r for d in gpu for r in d["results"]]
    line = say("head_gpu", gpu=gpu[0]["machine"].get("gpu", "GPU"), model=_short(gpu[0]["model"]),
               base=span([r["baseline_ttft_ms"] for r in rows]), sp=span([r["speedup"] for r in rows]))
    if "cuda" in shaped:
        r = _near(shaped["cuda"]["results"], 4096)
        other = shaped["cuda"]["machine"].get("gpu")
        where = f" on an {other}" if other and other != gpu[0]["machine"].get("gpu") else ""
        line += say("head_shape", r, where=where) if r else ""
        if "cpu" in shaped:
            line += say("head_shape_cpu", sp=span([x["speedup"] for x in shaped["cpu"]["results"]]))
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
            parts.append(say("head_blend", low=min(blends), high=max(blends), shares=(shares[0], shares[-1]), best=say(
                "head_blend_best", best=_pct(best[1]), name=_arm_name(best[0]).removeprefix("blend ")) if best else ""))
        routed = ((conf or {}).get("confusable") or {}).get(ROUTED)
        if routed:
            parts.append(f"routed (int8 weights) {_pct(routed)}")
        out.append(say("head_confusable", fid, model=_short(fid["model"]), n=first_n(c), parts=", ".join(parts)))
    t = (two or {}).get("two_fact") or {}
    if ROUTED in t:
        out.append(say("head_two", two, n=t["baseline"]["n"], routed=_pct(t[ROUTED]), baseline=_pct(t["baseline"]),
                       modular=_pct(t["prefixed"])))
    return out


def prefill_headline(d: dict | None) -> list[str]:
    """One line: the full prefill at the longest length, new kernel against today's path, llama.cpp and the floor."""
    if not d:
        return []
    v, n = d["verdicts"], str(max(d["lengths"]))
    new, old = d["studio"][v["new"]]["by_length"][n], d["studio"][v["old"]]["by_length"][n]
    ll = d["llama_cpp"].get("by_length", {}).get(n)
    used = tables.KERNEL_FLOOR.get(v["new"], "float32")
    fastest = v["by_length"][n].get("fastest_floor", used)  # older results name no fastest floor
    floors = [(k, d["floors"].get(k, {}).get(n, {}).get("s")) for k in dict.fromkeys([used, fastest])]
    said = ", ".join(f"{tables.FLOORS.get(k, k)}{CHANGES if k == 'int8' else ''} {s:.1f} s" for k, s in floors if s)
    return [say("prefill_headline", d, tokens=int(n), new=new, kernel=v["new"],
                old=f", {old['median']:.1f} s on the packed blocks" if v["old"] != v["new"] else "",
                llama=f", {ll['median']:.1f} s for llama.cpp" if ll else "",
                floor=f"; its linears alone as bare GEMMs: {said}" if said else "",
                busy=_busy(d["machine"].get("loadavg_1min")))]


CHANGES = " (fbgemm, which changes the answers)"  # the int8 floor is no precision the studio answers in


def _busy(load) -> str:
    """A warning for figures taken while other work shared the 2 cores (they are then several times too slow)."""
    return f" (measured at load average {load:.1f}, on a busy machine: ratios only)" if load and load > 3 else ""


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
    recall = "; ".join(say("head_recall", n=n, arm=e[their], baseline=e["baseline"]) for n, e in zip((4, 8), every))
    if their != f"{arm}+tree":
        paths = sorted({p for e in every for p in e[their].get("paths", {})})
        recall += say("head_recall_paths", split=_split_name(every_split), arm=their.replace(ROUTED, "routed"),
                      paths=" and ".join(paths))
    phrasings = ", ".join(f"{k.split('/')[2]} {v[used]['found']}/{v[used]['n']} ({v['baseline']['found']})"
                          for k, v in summary[split].items() if k.startswith("two/8/") and "every" not in k
                          and used in v)
    return [say("head_spanning", model=_short(span["model"]), split=_split_name(split), arm=two[used],
                baseline=two["baseline"], phrasings=phrasings, recall=recall)]


def _split_name(split: str) -> str:
    """'heldout' -> 'held-out split', 'confirm+confirm2' -> 'confirm and confirm2 splits'."""
    parts = ["held-out" if p == "heldout" else p for p in split.split("+")]
    return f"{' and '.join(parts)} split{'s' if len(parts) > 1 else ''}"


def _workload_bullet(work: dict | None) -> list[str]:
    if not work or not {"baseline", "prefix", "cached"} <= set(work["arms"]):
        return []
    a, routed = work["arms"], load(f"workload-int8-{LEAD}")
    names = {"baseline": "baseline", "prefix": "prefix cache", "cached": "modular"}
    arms = ", ".join(f"{label} {a[k]['needle_found']}/{a[k]['n']} at {a[k]['mean_ttft_ms'] / 1000:.2f} s"
                     for k, label in names.items())
    line = say("head_workload", work, model=_short(work["model"]), prompts=len(work["prompts"]), arms=arms)
    if routed and "routed" in routed["arms"]:
        line += say("head_workload_routed", routed["arms"])
    return [line + "."]


def _vllm_bullet(f: dict | None) -> list[str]:
    if not f:
        return []
    cells = "; ".join(say("head_vllm_set", name=name, **{a: arms[a]["mean_ttft_ms"] / arms["baseline"]["mean_ttft_ms"]
                                                         for a in ("vllm", "prefix", "cached")})
                      for name, arms in f["summary"].items())
    return [say("head_vllm", f, cells=cells, a=f["vllm_agreement"])]


def _load_bullet(d: dict | None) -> list[str]:
    servers = (d or {}).get("servers", {})
    names = {"studio": "studio (default arm)", "vllm": "vllm", "llama": "llama.cpp llama-server"}
    if any(name not in servers or not {"1", "8"} <= set(servers[name]["levels"]) for name in names.values()):
        return []
    at = {k: servers[name]["levels"] for k, name in names.items()}
    studio = at["studio"].values()
    return [say("head_load", d, model=_short(d["model"]), studio1=at["studio"]["1"]["output_tokens_per_s"],
                studio8=at["studio"]["8"]["output_tokens_per_s"], sttft=at["studio"]["8"]["ttft_ms"]["p95"],
                vllm1=at["vllm"]["1"]["output_tokens_per_s"], vllm8=at["vllm"]["8"]["output_tokens_per_s"],
                vttft=at["vllm"]["8"]["ttft_ms"]["p95"], llama1=at["llama"]["1"]["output_tokens_per_s"],
                llama8=at["llama"]["8"]["output_tokens_per_s"], same=sum(v["same_as_alone"] for v in studio),
                of=sum(v["requests"] for v in studio))]


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
    return [say("head_memory", kinds=" and ".join(kinds), shares=shares,
                found="answers found as often" if same else "answers found", per_model="; ".join(per_model))]
