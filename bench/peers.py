"""Peers side by side: llama.cpp on the same GGUF, and kvpress's presses, against the studio's arms.

Every other benchmark is a ratio of the studio against itself. This one runs what a user would run
instead, on the same model and the same prompts, in one run:

* **workload** — the 24 prompts of `bench/workload.py` (8 essay modules with confusable facts,
  prompts of 2–4 modules, a quarter of them in schema order). The studio's arms (baseline, prefix,
  cached, blend) run in this process; then llama.cpp (llama-cpp-python, in its own environment,
  `bench/peer_llama.py`) prefills the **same token ids**, once from an empty cache (`llama.cpp-full`)
  and once with its prefix reuse warmed as the prefix arm is (`llama.cpp-prefix`: the schema-order
  prompt, then every earlier prompt of the workload, kept as saved KV states; the state with the
  longest common prefix is restored for each prompt, as llama-server's prompt cache does).
  Needle accuracy per arm and peer, from each one's own answer (llama.cpp runs the GGUF's quantized
  weights; the studio runs them dequantized), with 95 % Wilson intervals.
  **Time to the N-th token** (N = `--new-tokens`, 32 by default) per prompt: TTFT + (N − 1) × that
  run's own decode ms/token — what a user waits for a whole short answer (an answer that stopped at
  its end-of-text earlier is counted at its measured rate). The studio's arms decode one at a time
  here (``decode="apart"``), like llama.cpp, on `--weights` (default: the studio's, studio/launch.py).
* **lengths** — the document-QA prompts of `bench/ttft.py` at each `--lengths`: the studio's baseline
  and cached TTFT and decode ms/token in each `--dtypes` (fp32, bf16), beside llama.cpp's full
  prefill and decode on the GGUF (its own quantized kernels: the 0.5B file mixes Q4_K, Q5_0, Q6_K and
  Q8_0 tensors), min/median/max of the repetitions.
* **kvpress** (`--kvpress`) — NVIDIA kvpress's SnapKV, PyramidKV, Expected Attention and KVzip
  presses at 50 % and 30 % kept (compression_ratio 0.5 / 0.7; query-agnostic as kvpress runs them:
  the context compressed, the question appended) against the studio's `question` retention and
  its `pyramid` control at the same ratios, on the varied needles of issue 17, same model, same
  token ids (`bench/peer_kvpress.py`, in its own environment: kvpress needs transformers < 5.3).

The peers' environments are made by `make peers` (.peers/llama, .peers/kvpress); it is optional and
never part of `make test`. A peer that is missing or fails is reported with the exact reason in the
JSON and the tables (never skipped silently).

    python bench/peers.py --model qwen2.5-coder-0.5b            # workload + lengths (~25 min on 2 cores)
    python bench/peers.py --model qwen2.5-coder-0.5b --kvpress --no-workload --no-lengths
    python bench/peers.py --quick                               # 3 small prompts, no files written

One model throughout, resolved once (bench/common.py ``bench_model``): the studio's arms, llama.cpp (that model's
GGUF) and kvpress (its converted folder) all run it, and the JSON names it ("model", "gguf"; each peer reports what
it loaded). Which model each mode runs: ``--help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import (QUICK_MODEL, ROOT, RESULTS, BenchModel, bench_model, emit, essay_chunks, machine, model_help,
                          result_name, spread, table)

from bench.compressed_runs import run_prompt as compress_prompt
from bench.needles import judge, make_workload, prompt_xml, varied_cases
from bench.peer_envs import PEER_PYTHON, peer_status, run_peer
from bench.workload_runs import run_prompt, summarise as summarise_arms
from bench.workloads import SYSTEM, case_prompt, doc_schema, wilson
from engine.cache.prefix import schema_order_prompt
from engine.arms.registry import Sampling
from engine.session import Engine
from engine.model import WEIGHTS
from studio.launch import STUDIO_WEIGHTS

PRESSES = ("SnapKVPress", "PyramidKVPress", "ExpectedAttentionPress", "KVzipPress")
KEPT = (0.5, 0.3)


# -- the peers' models -----------------------------------------------------------------------------------

def shape(config) -> dict:
    """A model as its config states it, in the terms each peer reports what it loaded (peer_llama.loaded)."""
    return {"architecture": config.model_type, "layers": config.num_hidden_layers, "hidden": config.hidden_size}


# -- workload -------------------------------------------------------------------------------------------

def summarise_peer(runs: list[dict], prompts: list[dict]) -> dict:
    ttft = [r["ttft_ms"] for r in runs]
    found, confused = zip(*(judge(r["text"], p) for r, p in zip(runs, prompts)))
    ordered = [r["ttft_ms"] for r, p in zip(runs, prompts) if p.get("schema_order")]
    other = [r["ttft_ms"] for r, p in zip(runs, prompts) if not p.get("schema_order")]
    dec = [r["decode_ms_per_token"] for r in runs if r.get("decode_ms_per_token")]
    return {"mean_ttft_ms": round(statistics.mean(ttft), 2), "ttft_ms": spread(ttft, every=False),
            "schema_order_mean_ttft_ms": round(statistics.mean(ordered), 2) if ordered else None,
            "other_mean_ttft_ms": round(statistics.mean(other), 2) if other else None,
            "decode_ms_per_token": spread(dec, every=False) if dec else None,
            "prefilled_tokens": sum(r["prefilled_tokens"] for r in runs),
            "reused_tokens": sum(r["reused_tokens"] for r in runs),
            "needle_found": sum(found), "n": len(runs), "needle_accuracy": round(sum(found) / len(runs), 4),
            "ci95": wilson(sum(found), len(runs)), "confused": sum(confused)}


def workload(eng: Engine, args, gguf: Path) -> dict:
    docs, prompts = make_workload(essay_chunks(eng.codec.encode, args.chunk_tokens), args.modules, args.prompts,
                                  args.seed)
    schema = doc_schema("workload", docs, system=SYSTEM)
    lay = eng.layout(schema)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    arms = list(eng.config.arms)
    rows, ids = [], []
    for i, p in enumerate(prompts):
        ids.append(list(eng.plan(lay, prompt_xml(p)).token_ids))
        rows.append(run_prompt(eng, schema, p, sampling))
        r = rows[-1]
        print(f"[studio {i + 1}/{len(prompts)}] {' '.join(r['imports'])} tokens={r['prompt_tokens']} "
              + " ".join(f"{a}={r[a]['ttft_ms']:.0f}ms/{'Y' if r[a]['found'] else 'n'}" for a in arms), flush=True)
    arms_summary = summarise_arms(rows, arms)
    for a in arms:
        dec = [r[a]["decode_ms_per_token"] for r in rows if r[a].get("decode_ms_per_token")]
        arms_summary[a]["decode_ms_per_token"] = spread(dec, every=False) if dec else None
        arms_summary[a]["ttft_ms"] = spread([r[a]["ttft_ms"] for r in rows], every=False)
    warm = list(schema_order_prompt(lay).token_ids)
    job = {"gguf": str(gguf), "threads": args.threads, "n_ctx": max(len(warm), *map(len, ids)) + args.new_tokens + 64,
           "new_tokens": args.new_tokens, "stop_ids": list(eng.lm.eos_ids), "modes": ["full", "prefix"],
           "warm": [warm], "prompts": [{"ids": x} for x in ids]}
    llama = run_peer("llama.cpp", "peer_llama.py", job)
    peers = {}
    if "error" in llama:
        peers = {"llama.cpp-full": {"error": llama["error"]}, "llama.cpp-prefix": {"error": llama["error"]}}
    else:
        for mode in ("full", "prefix"):
            peers[f"llama.cpp-{mode}"] = summarise_peer(llama[mode], prompts)
        for r, f, x in zip(rows, llama["full"], llama["prefix"]):
            r["llama.cpp-full"] = {k: f[k] for k in ("ttft_ms", "decode_ms_per_token", "text")}
            r["llama.cpp-prefix"] = {k: x[k] for k in ("ttft_ms", "decode_ms_per_token", "text", "reused_tokens",
                                                       "restore_ms")}
    nth = nth_summary(rows, arms + list(peers), args.new_tokens)
    return {"prompts": rows, "arms": arms_summary, "peers": peers,
            "ratios": workload_ratios(rows, arms_summary, peers, args.new_tokens),
            f"time_to_token_{args.new_tokens}_ms": nth,
            "llama.cpp": {k: v for k, v in llama.items() if k not in ("full", "prefix")},
            "schema_tokens": lay.length, "warm_tokens": len(warm)}


def to_nth(r: dict, n: int) -> float | None:
    """Milliseconds to the ``n``-th token: TTFT + (n - 1) decode steps at the run's own rate."""
    if r.get("decode_ms_per_token") is None:
        return None
    return r["ttft_ms"] + (n - 1) * r["decode_ms_per_token"]


def nth_summary(rows: list[dict], names: list[str], n: int) -> dict:
    """Per arm or peer: mean / min / median / max ms to the n-th token over the prompts."""
    out = {}
    for name in names:
        xs = [x for x in (to_nth(r[name], n) for r in rows if name in r) if x is not None]
        if xs:
            out[name] = {"mean_ms": round(statistics.mean(xs), 1), **spread(xs, digits=1, every=False)}
    return out


def workload_ratios(rows: list[dict], arms: dict, peers: dict, n: int = 32) -> dict:
    out = {}
    for arm in arms:
        for peer, s in peers.items():
            if "error" in s:
                continue
            key = f"{arm}_over_{peer.replace('.', '').replace('-', '_')}"
            out[key + "_mean"] = round(arms[arm]["mean_ttft_ms"] / s["mean_ttft_ms"], 3)
            per = [r[arm]["ttft_ms"] / r[peer]["ttft_ms"] for r in rows]
            out[key + "_per_prompt"] = spread(per, digits=3, every=False)
            for part, flag in (("schema_order", True), ("other", False)):
                a = [r[arm]["ttft_ms"] for r in rows if r["schema_order"] == flag]
                b = [r[peer]["ttft_ms"] for r in rows if r["schema_order"] == flag]
                if a:
                    out[f"{key}_{part}_mean"] = round(statistics.mean(a) / statistics.mean(b), 3)
            out[key + "_peer_faster_prompts"] = sum(r[peer]["ttft_ms"] < r[arm]["ttft_ms"] for r in rows)
            mine = [to_nth(r[arm], n) for r in rows]
            theirs = [to_nth(r[peer], n) for r in rows]
            if all(x is not None for x in mine + theirs):
                out[f"{key}_time_to_token_{n}_mean"] = round(statistics.mean(mine) / statistics.mean(theirs), 3)
    return out


# -- lengths --------------------------------------------------------------------------------------------

def lengths(engines: dict[str, Engine], args, gguf: Path) -> dict:
    from bench.workloads import doc_qa
    from studio.docqa import ttft_point

    out: dict = {"points": []}
    ids = {}
    for dtype, eng in engines.items():
        chunks = essay_chunks(eng.codec.encode, 250)
        for n in args.lengths:
            case = doc_qa(eng, n, args.new_tokens, chunks)
            pt = ttft_point(eng, case, args.reps)
            ids[n] = list(case.plan.token_ids)
            out["points"].append({"dtype": dtype, **{k: pt[k] for k in (
                "target_tokens", "prompt_tokens", "cached_tokens", "baseline_ttft_ms", "cached_ttft_ms", "speedup",
                "baseline_decode_ms_per_token", "cached_decode_ms_per_token", "baseline_ttft_ms_all",
                "cached_ttft_ms_all")}})
            print(f"[studio {dtype}] {pt['prompt_tokens']} tokens: baseline {pt['baseline_ttft_ms']:.0f} ms, "
                  f"cached {pt['cached_ttft_ms']:.0f} ms, decode {pt['baseline_decode_ms_per_token']:.0f} ms/token",
                  flush=True)
    job = {"gguf": str(gguf), "threads": args.threads, "n_ctx": max(map(len, ids.values())) + args.new_tokens + 64,
           "new_tokens": args.new_tokens, "stop_ids": [], "modes": ["full"],
           "prompts": [{"ids": ids[n], "reps": args.reps} for n in args.lengths]}
    llama = run_peer("llama.cpp", "peer_llama.py", job)
    if "error" in llama:
        out["llama.cpp"] = {"error": llama["error"]}
        return out
    for i, n in enumerate(args.lengths):
        runs = [r for r in llama["full"] if r["prompt"] == i]
        ttft = [r["ttft_ms"] for r in runs]
        dec = [r["decode_ms_per_token"] for r in runs if r["decode_ms_per_token"]]
        out["points"].append({"dtype": "llama.cpp (GGUF)", "target_tokens": n, "prompt_tokens": len(ids[n]),
                              "baseline_ttft_ms": round(statistics.median(ttft), 2),
                              "baseline_ttft_ms_all": ttft, "baseline_decode_ms_per_token":
                                  round(statistics.median(dec), 2) if dec else None})
    out["llama.cpp"] = {k: v for k, v in llama.items() if k != "full"}
    return out


# -- kvpress --------------------------------------------------------------------------------------------

def kvpress_section(eng: Engine, args, model: BenchModel) -> dict:
    configs = [("float32", r, m) for r in KEPT for m in ("question", "pyramid")]
    chunks = essay_chunks(eng.codec.encode, args.chunk_tokens)
    cases = varied_cases(chunks, args.kv_modules, args.kv_prompts, args.seed + args.kv_modules)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    rows, jobs = [], []
    for i, case in enumerate(cases):
        row = compress_prompt(eng, case, i, configs, sampling)
        schema, prompt = case_prompt(case, i)
        plan = eng.plan(eng.layout(schema), prompt)
        q_ids, _ = plan.uncached()
        all_ids = list(plan.token_ids)
        assert all_ids[len(all_ids) - len(q_ids):] == list(q_ids), "the question is not the prompt's tail"
        jobs.append({"context_ids": all_ids[: len(all_ids) - len(q_ids)], "question_ids": list(q_ids)})
        rows.append(row)
        print(f"[studio {i + 1}/{len(cases)}] {plan.prompt_tokens} tokens: "
              + " ".join(f"{k}={'Y' if v['found'] else 'n'}" for k, v in row.items() if isinstance(v, dict)), flush=True)
    job = {"model_dir": str(model.folder), "threads": args.threads, "new_tokens": args.new_tokens,
           "presses": list(PRESSES), "kept": list(KEPT), "cases": jobs}
    kv = run_peer("kvpress", "peer_kvpress.py", job)
    summary = {}
    names = ["baseline", "cached fp32"] + [f"{m} {r:.0%}" for r in KEPT for m in ("question", "pyramid")]
    for name in names:
        found = [r[name]["found"] for r in rows]
        s = {"needle_found": sum(found), "n": len(rows), "ci95": wilson(sum(found), len(rows)), "side": "studio"}
        if name not in ("baseline", "cached fp32"):
            s["buffer_ratio"] = round(statistics.mean(r[name]["buffer_ratio"] for r in rows), 3)
            s["store_ratio"] = round(statistics.mean(r[name]["store_ratio"] for r in rows), 3)
        summary[name] = s
    if "error" in kv:
        summary["kvpress"] = {"error": kv["error"]}
    else:
        for name in ["none"] + kv["names"]:
            runs = [c[name] for c in kv["cases"]]
            found = [judge(r["text"], case)[0] for r, case in zip(runs, cases)]
            summary[f"kvpress {name}"] = {
                "needle_found": sum(found), "n": len(runs), "ci95": wilson(sum(found), len(runs)), "side": "kvpress",
                "buffer_ratio": round(statistics.mean(r["context_bytes"] / c["none"]["context_bytes"]
                                                      for r, c in zip(runs, kv["cases"])), 3),
                "prefill_ms": spread([r["prefill_ms"] for r in runs], every=False)}
            for row, r, f in zip(rows, runs, found):
                row[f"kvpress {name}"] = {"found": f, "text": r["text"], "context_bytes": r["context_bytes"]}
    return {"prompts": rows, "summary": summary, "modules": args.kv_modules,
            "kvpress": {k: v for k, v in kv.items() if k not in ("cases",)}}


# -- output ---------------------------------------------------------------------------------------------

def print_workload(w: dict) -> None:
    rows = []
    nth_key = next((k for k in w if k.startswith("time_to_token_")), None)
    nth = w.get(nth_key) or {}
    for name, s in list(w["arms"].items()) + list(w["peers"].items()):
        if "error" in s:
            rows.append([name, "-", "-", "-", "-", "-", "-", s["error"]])
            continue
        t = s["ttft_ms"]
        dec = s.get("decode_ms_per_token") or {}
        rows.append([name, s["mean_ttft_ms"], f"{t['min']:.0f}/{t['median']:.0f}/{t['max']:.0f}",
                     s["schema_order_mean_ttft_ms"], s["other_mean_ttft_ms"], dec.get("median", "-"),
                     (nth.get(name) or {}).get("mean_ms", "-"),
                     f"{s['needle_found']}/{s['n']} ({s['ci95'][0]:.0%}-{s['ci95'][1]:.0%})"])
    print(table(["arm / peer", "mean TTFT ms", "min/median/max", "schema order", "other", "decode ms/tok",
                 f"mean ms to token {nth_key.rsplit('_', 2)[-2] if nth_key else 'N'}", "needle found (95% CI)"], rows))


def print_lengths(ln: dict) -> None:
    print(table(["engine", "tokens", "TTFT ms (median)", "cached TTFT ms", "decode ms/token"],
                [[p["dtype"], p["prompt_tokens"], p["baseline_ttft_ms"], p.get("cached_ttft_ms", "-"),
                  p["baseline_decode_ms_per_token"]] for p in ln["points"]]))
    if "error" in ln.get("llama.cpp", {}):
        print("llama.cpp:", ln["llama.cpp"]["error"])


def print_kvpress(kv: dict) -> None:
    print(table(["method", "needle found", "95% CI", "KV decoded over (vs full)"],
                [[k, f"{s['needle_found']}/{s['n']}" if "n" in s else s.get("error"),
                  f"{s['ci95'][0]:.0%}-{s['ci95'][1]:.0%}" if "ci95" in s else "-",
                  s.get("buffer_ratio", "-")] for k, s in kv["summary"].items()]))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    w = result["workload"]
    names = [n for n, s in list(w["arms"].items()) + list(w["peers"].items()) if "error" not in s]
    summ = {**w["arms"], **w["peers"]}
    colours = {"baseline": "#c0392b", "prefix": "#b7950b", "cached": "#2471a3", "blend": "#be185d",
               "llama.cpp-full": "#6b7280", "llama.cpp-prefix": "#111827"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for n in names:
        s = summ[n]
        a1.barh(n, s["mean_ttft_ms"] / 1000, color=colours.get(n, "#888"))
        a1.errorbar(s["mean_ttft_ms"] / 1000, n, xerr=[[s["mean_ttft_ms"] / 1000 - s["ttft_ms"]["min"] / 1000],
                                                       [s["ttft_ms"]["max"] / 1000 - s["mean_ttft_ms"] / 1000]],
                    color="k", capsize=3, lw=1)
        lo, hi = s["ci95"]
        acc = s["needle_found"] / s["n"]
        a2.errorbar(s["mean_ttft_ms"] / 1000, acc * 100, yerr=[[(acc - lo) * 100], [(hi - acc) * 100]], fmt="o",
                    color=colours.get(n, "#888"), capsize=3, label=n)
    a1.set_xlabel("mean TTFT (s), bar: min-max")
    a1.invert_yaxis()
    a2.set_xscale("log")
    lo, hi = a2.get_xlim()
    a2.set_xticks([t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20) if lo <= t <= hi])
    a2.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    a2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a2.set_xlabel("mean TTFT (s, log)")
    a2.set_ylabel("needle found (%), 95% Wilson")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.suptitle(f"Workload ({w['arms'][next(iter(w['arms']))]['n']} prompts): studio arms vs llama.cpp, "
                 f"{result['model']}, 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help() + "; llama.cpp runs its GGUF, kvpress its folder")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per answer (the time to the last one is "
                    "reported)")
    ap.add_argument("--weights", default=STUDIO_WEIGHTS, choices=WEIGHTS,
                    help=f"the studio's weights (default {STUDIO_WEIGHTS}, the studio's default; llama.cpp runs the "
                    "GGUF's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (torch uses its own default: the cores)")
    ap.add_argument("--blend", type=float, default=0.15, help="the blend arm's R (0 leaves the arm out)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--no-workload", action="store_true")
    ap.add_argument("--no-lengths", action="store_true")
    ap.add_argument("--kvpress", action="store_true", help="also the kvpress section (long: ~15 min on the 0.5B)")
    ap.add_argument("--kv-prompts", type=int, default=6)
    ap.add_argument("--kv-modules", type=int, default=4)
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_MODEL} unless --model, 3 small prompts, one short length, no files")
    ap.add_argument("--check", action="store_true", help="say whether each peer's environment works, and exit")
    ap.add_argument("--replot", action="store_true", help="redraw the plot from bench/results/peers[-MODEL].json")
    args = ap.parse_args()
    args.chunk_tokens = 250
    if args.quick:
        args.prompts, args.new_tokens, args.chunk_tokens = 3, 8, 60
        args.lengths, args.reps, args.dtypes, args.kv_prompts, args.kv_modules = [128], 1, ["float32"], 1, 2
    return args


def check_peers() -> None:
    """Say whether each peer's environment works (--check), and exit 1 if one does not."""
    bad = 0
    for peer in PEER_PYTHON:
        py, info = peer_status(peer)
        bad += py is None
        print(f"{peer}: {'ready, ' + info if py else info}")
    sys.exit(1 if bad else 0)


def main() -> None:
    args = parse_args()
    if args.replot:
        name = result_name("peers", args.model)
        plot(json.loads((RESULTS / f"{name}.json").read_text()), ROOT / "assets" / f"{name}.png")
        return
    if args.check:
        check_peers()
    arms = ("baseline", "prefix", "cached") + (("blend",) if args.blend > 0 else ())
    model = bench_model(args.model, args.quick)
    gguf = model.gguf_file()
    eng = Engine(model=model.spec, persist=False, arms=arms, blend=args.blend or 0.15, dtype="float32",
                 weights=args.weights, decode="apart")
    t0 = time.perf_counter()
    result: dict = {"benchmark": "peers", "model": eng.lm.name, "weights": eng.lm.weights, "gguf": gguf.name,
                    "model_shape": shape(eng.lm.model.config), "new_tokens": args.new_tokens,
                    "machine": machine(), "greedy": True, "peer_status": {p: peer_status(p)[1] for p in PEER_PYTHON}}
    if not args.no_workload:
        w = workload(eng, args, gguf)
        result["workload"] = w
        # the form: {"arms": {...}, "peers": {...}} at the top level, the workload's
        result["arms"], result["peers"], result["ratios"] = w["arms"], w["peers"], w["ratios"]
        print_workload(w)
    if not args.no_lengths:
        engines = {"float32": eng}
        for d in args.dtypes:
            if d != "float32":
                engines[d] = Engine(model=model.spec, persist=False, dtype=d)
        result["lengths"] = lengths(engines, args, gguf)
        print_lengths(result["lengths"])
    if args.kvpress:
        # the same loaded model; compression settings do not combine with the blend arm's
        result["kvpress"] = kvpress_section(Engine.from_loaded(eng.lm, persist=False), args, model)
        print_kvpress(result["kvpress"])
    result["seconds"] = round(time.perf_counter() - t0, 1)
    parts = ["peers"] + (["kvpress"] if args.kvpress and args.no_workload else [])
    name = result_name("-".join(parts), args.model)
    if not args.quick and "workload" in result:
        plot(result, ROOT / "assets" / f"{name}.png")
    emit(name, result, write=not args.quick)
    if not args.quick:
        print(f"wrote {RESULTS / (name + '.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
