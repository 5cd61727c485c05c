"""How much of a request's documents the API reports cached, on first-seen subsets of documents it has seen.

bench/serve.py's workload (8 essay modules of confusable facts; 24 prompts, each 2-4 of them in another subset,
one fact asked) goes through ``pml-studio api`` with the official ``openai`` client as a RAG app sends it: a
system message, one content part per document (transparent mode), the question; streamed, greedy. After a warm-up
with all 8 documents (their first sight: encoded), every prompt is a subset the server has not seen together.
For the baseline and each arm in ``--arms`` (the API's default, routed, unless told):

* ``cached_share``: ``cached_tokens`` less the chat template's text before the documents, over the documents'
  tokens: what the request did not compute (docs/api.md);
* ``in_answer_share``: the same less ``pml.routed_out_tokens``: the documents' tokens the answer read as stored;
* answers found (bench/needles.py's judge) against the baseline's, prompt by prompt.

TTFT is reported as measured, with the load average: it is not the point here. JSON last.

    python bench/cached_share.py                  # the default model; bench/results/cached-share-MODEL.json
    python bench/cached_share.py --prompts 4 --model SmolLM2-135M-Instruct --no-write
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, emit, essay_chunks, machine, model_help, result_name, spread, table
from bench.serving import Server, anonymous_tokens, free_port, run_config

from bench.needles import make_workload


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--arms", default="routed", help="arms besides the baseline (default: the API's default arm)")
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--no-write", action="store_true", help="print the JSON only")
    return ap.parse_args()


def serve_rows(model, arms: list[str], docs, prompts, new_tokens: int) -> dict[str, list[dict]]:
    """Each arm's rows through one served API (transparent mode)."""
    key, port = secrets.token_urlsafe(24), free_port()
    db = Path(tempfile.mkdtemp()) / "runs.db"
    server = Server([sys.executable, "-m", "studio.cli", "api", "--model", model.spec, "--port", str(port),
                     "--db", str(db)], port, key, env={"PML_STUDIO_TOKEN": key})
    try:
        server.wait()
        client = server.client()
        served = client.models.list().data[0].id
        return {arm: run_config(client, served, docs, prompts, new_tokens, lambda _i, _p, arm=arm: {"pml": {"arm": arm}},
                                arm) for arm in arms}
    finally:
        server.stop()


def shares(rows: list[dict], doc_tokens: list[int], anonymous: int) -> dict:
    cached = [max(0, r["cached_tokens"] - anonymous) / t for r, t in zip(rows, doc_tokens)]
    read = [max(0, r["cached_tokens"] - (r.get("routed_out_tokens") or 0) - anonymous) / t
            for r, t in zip(rows, doc_tokens)]
    return {"cached_share": spread(cached, 3, every=False), "in_answer_share": spread(read, 3, every=False),
            "under_70": sum(c < 0.7 for c in cached)}


def summary(rows_of: dict[str, list[dict]], doc_tokens: list[int], anonymous: int) -> dict:
    base = rows_of["baseline"]
    out = {}
    for arm, rows in rows_of.items():
        same = sum(r["found"] == b["found"] for r, b in zip(rows, base))
        out[arm] = {**shares(rows, doc_tokens, anonymous), "found": sum(r["found"] for r in rows), "of": len(rows),
                    "found_as_baseline": same, "ttft_ms": spread([r["ttft_ms"] for r in rows], 1, every=False)}
    return out


def main() -> None:
    args = parse()
    from engine.model.load import load_tokenizer

    bm = bench_model(args.model)
    _, tokenizer, codec = load_tokenizer(bm.spec)
    docs, prompts = make_workload(essay_chunks(codec.encode, 250), args.modules, args.prompts, args.seed)
    doc_tokens = [sum(len(codec.encode(docs[i])) for i in p["imports"]) for p in prompts]
    t0, arms = time.perf_counter(), ["baseline", *[a for a in args.arms.split(",") if a != "baseline"]]
    rows_of = serve_rows(bm, arms, docs, prompts, args.new_tokens)
    anonymous = anonymous_tokens(tokenizer)
    results = summary(rows_of, doc_tokens, anonymous)
    print(table(["arm", "cached/docs (min med max)", "in answer (med)", "under 70 %", "found", "as baseline"],
                [[a, "{min} {median} {max}".format(**r["cached_share"]), r["in_answer_share"]["median"], r["under_70"],
                  f"{r['found']}/{r['of']}", f"{r['found_as_baseline']}/{r['of']}"] for a, r in results.items()]),
          file=sys.stderr)
    emit(result_name("cached-share", bm.spec), {
        "benchmark": "cached-share", "model": bm.spec, "model_name": bm.name, "mode": "transparent",
        "new_tokens": args.new_tokens, "seed": args.seed, "modules": args.modules, "machine": machine(),
        "seconds": round(time.perf_counter() - t0, 1), "anonymous_tokens": anonymous, "document_tokens": doc_tokens,
        "results": results, "rows": rows_of,
        "workload": [{k: p[k] for k in ("imports", "asked", "kind", "answer")} for p in prompts]},
        write=not args.no_write)


if __name__ == "__main__":
    main()
