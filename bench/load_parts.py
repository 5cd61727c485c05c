"""Where a loaded level's engine time goes, on the model the studio serves by default (its default weights):

* a decode step (engine/run/forward.py ``step``, the scheduler's batched step) at 1, 2, 4, 8 and 16 rows, each row
  over a leased context of its own (``--context`` tokens): what one more sequence in the batch costs;
* a fill's forward (``prefill``) of M tokens (``--fill-tokens``), and what filling k requests in one forward could
  save of k such fills: every layer's products on k·M rows against k times on M (attention stays each request's);

and the bound they put on a loaded level while fills run one at a time: each request costs its fill (F_c ms at c
clients) plus its share of the batched steps (T_c tokens, s_b ms a step of b rows), so the throughput at 8 clients
over the one at 1 is at most (F_1 + T_1·s_1) / (F_8 + T_8·s_8 / 8), and (F_1 + T_1·s_1) / (F_8 + T_8·s_1 / 8) were
8 rows to cost what one does. F and T: bench/load.py's result (each level's mean ``engine_ttft_ms`` and output tokens
per request), named in the JSON, or ``--fill-ms`` and ``--tokens`` for both levels. JSON last.

    python bench/load_parts.py            # ~1.5 min on 2 cores; bench/results/load-parts-MODEL.json
    python bench/load_parts.py --quick    # SmolLM2, fewer repetitions, no file written
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import RESULTS, bench_model, emit, machine, model_help, result_name, spread, table

from engine.run import forward
from engine.run.layers import decoder_layers
from engine.run.forward import Row
from engine.session import Engine

ROWS = (1, 2, 4, 8, 16)
FUSED = (1, 2, 4, 8)  # fills in one forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--context", type=int, default=400, help="tokens each decoding row already holds")
    ap.add_argument("--fill-tokens", type=int, default=0, help="tokens a fill prefills (default: bench/load.py's "
                    "median at one client, else 128; 32 with --quick)")
    ap.add_argument("--fill-ms", type=float, default=0.0, help="a fill's time, at 1 and 8 clients (default: "
                    "bench/load.py's, each level's)")
    ap.add_argument("--tokens", type=float, default=0.0, help="output tokens a request, at 1 and 8 clients (default: "
                    "bench/load.py's, each level's)")
    ap.add_argument("--load-result", type=Path, default=None,
                    help="bench/load.py's result to read (default: bench/results/load-MODEL.json)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="SmolLM2 unless --model, 3 repetitions, no file written")
    args = ap.parse_args()
    if bool(args.fill_ms) != bool(args.tokens):
        raise SystemExit("--fill-ms and --tokens: give both (one fill and one request's tokens at every level) or "
                         "neither (bench/load.py's, at one client and at 8)")
    bm = bench_model(args.model, args.quick)
    reps = 3 if args.quick else args.reps
    loaded = load_level(args.load_result or RESULTS / f"{result_name('load', bm.spec)}.json")
    fill_tokens = args.fill_tokens or (loaded or {}).get("prefilled_tokens") or (32 if args.quick else 128)
    engine = Engine(model=bm.spec, persist=False)
    lm, pool = engine.lm, engine.pool
    torch.manual_seed(0)
    with torch.inference_mode():
        steps = decode_steps(lm, pool, args.context, reps)
        fills = fused_fills(lm, pool, args.context, int(fill_tokens), reps)
    s1, s8 = steps["1"]["median"], steps["8"]["median"]
    at = {n: {"fill_ms": args.fill_ms, "tokens": args.tokens} for n in ("1", "8")} if args.fill_ms else loaded
    bound = None
    if at:
        one, eight = at["1"], at["8"]
        top = one["fill_ms"] + one["tokens"] * s1
        bound = {"one_client": one, "eight_clients": eight, "from": "arguments" if args.fill_ms else loaded["source"],
                 "throughput_8_over_1_at_most": round(top / (eight["fill_ms"] + eight["tokens"] * s8 / 8), 2),
                 # the same, were a step of 8 rows to cost what one row's does: what no decode kernel passes
                 "at_most_if_8_rows_cost_1": round(top / (eight["fill_ms"] + eight["tokens"] * s1 / 8), 2)}
    print(table(["rows", "decode step ms (min / median / max)", "ms a row"],
                [[n, f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f}", f"{s['median'] / int(n):.1f}"]
                 for n, s in steps.items()]))
    print(f"a fill's forward of {int(fill_tokens)} tokens: {fills['fill_ms']['median']:.0f} ms, its products "
          f"{fills['products_ms']['median']:.0f} ms")
    print(table(["fills in one forward", "their products in one forward, ms", "apart, ms", "saved of the fills"],
                [[k, f"{f['products_ms']['median']:.0f}", f"{f['apart_ms']:.0f}", f"{f['saved_of_fills']:.0%}"]
                 for k, f in fills["fused"].items()]))
    if bound:
        print(f"8 clients over 1, fills one at a time: at most {bound['throughput_8_over_1_at_most']:.2f}x "
              f"(fills {one['fill_ms']:.0f} / {eight['fill_ms']:.0f} ms and {one['tokens']:g} / {eight['tokens']:g} "
              f"tokens a request at 1 / 8 clients, s_1 {s1:.1f} ms, s_8 {s8:.1f} ms); "
              f"{bound['at_most_if_8_rows_cost_1']:.2f}x were 8 rows to cost what one does")
    emit(result_name("load-parts", bm.spec), {
        "benchmark": "load_parts", "model": bm.spec, "model_name": bm.name, "machine": machine(),
        "weights": engine.config.weights, "context": args.context, "fill_tokens": int(fill_tokens), "reps": reps,
        "decode_step_ms": steps, "fused_fills": fills, "bound": bound}, write=not args.quick)


def load_level(path: Path) -> dict | None:
    """bench/load.py's figures in ``path``: each request's fill (mean ``engine_ttft_ms``) and output tokens at one
    client and at 8, the median request's prefilled tokens at one; None without them."""
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    levels = (d.get("servers", {}).get("studio (default arm)") or {}).get("levels", {})
    if any(not levels.get(n, {}).get("engine_ttft_ms") for n in ("1", "8")) or not levels["1"].get("prefilled_tokens"):
        return None
    # a throughput adds up every request's fill: their mean; the median request's tokens are a typical fill forward
    out = {n: {"fill_ms": levels[n]["engine_ttft_ms"]["mean"],
               "tokens": round(levels[n]["output_tokens"] / levels[n]["requests"], 1)} for n in ("1", "8")}
    return {**out, "prefilled_tokens": round(levels["1"]["prefilled_tokens"]["p50"]),
            "source": f"{path.name} ({d['machine'].get('date')})"}


def timed(fn, reps: int, setup=lambda: None) -> dict:
    """min / median / max ms of ``fn()`` over ``reps`` calls after one untimed, each after an untimed ``setup()``."""
    ms = []
    for _ in range(reps + 1):
        setup()
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1000)
    return spread(ms[1:], 1, every=False)


def decode_steps(lm, pool, context: int, reps: int) -> dict:
    """A decode step's time at each row count, every row over its own lease of ``context`` tokens (one prefill's KV
    copied into each: a step's time does not depend on what its keys hold)."""
    leases = [pool.lease(context + 2 * (reps + 1) * len(ROWS)) for _ in range(max(ROWS))]
    forward.prefill(lm, leases[0], token_ids(lm, context, seed=0), range(context))
    kv = leases[0].kv()
    for lease in leases[1:]:
        lease.write(kv)
    out = {}
    for n in ROWS:
        out[str(n)] = timed(lambda: forward.step(lm, [Row(x, 1000 + i, x.length) for i, x in enumerate(leases[:n])]),
                            reps)
    for lease in leases:
        lease.release()
    return out


def fused_fills(lm, pool, context: int, tokens: int, reps: int) -> dict:
    """A fill's forward of ``tokens`` after ``context``; and, for k fills in one forward, what that would save: the
    products of every layer (the weights' part of a forward, which fusing shares) on k·``tokens`` rows against k
    times on ``tokens``, as a share of the k fills' time. Attention stays each request's own, so it saves nothing."""
    lease = pool.lease(context + tokens)
    forward.prefill(lm, lease, token_ids(lm, context, seed=99), range(context))
    before = lease.kv().clone()
    ids = token_ids(lm, tokens, seed=7)

    def again() -> None:  # the context alone, as each fill finds it
        lease.reset()
        lease.write(before)

    fill = timed(lambda: forward.prefill(lm, lease, ids, range(context, context + tokens)), reps, again)
    lease.release()
    layers = decoder_layers(lm.model, "bench/load_parts.py", "measure another model")
    width, dtype = layers[0].input_layernorm.weight.shape[0], layers[0].input_layernorm.weight.dtype

    def products(n: int) -> dict:
        x = torch.randn(1, n, width, dtype=dtype)

        def run() -> None:
            for layer in layers:
                a = layer.self_attn
                a.q_proj(x), a.k_proj(x), a.v_proj(x), a.o_proj(x), layer.mlp(x)

        return timed(run, reps)

    one = products(tokens)
    out = {"fill_ms": fill, "products_ms": one, "fused": {}}
    for k in FUSED[1:]:
        fused = products(k * tokens)
        saved = k * one["median"] - fused["median"]
        out["fused"][str(k)] = {"products_ms": fused, "apart_ms": round(k * one["median"], 1),
                                "saved_of_fills": round(saved / (k * fill["median"]), 3)}
    return out


def token_ids(lm, n: int, seed: int) -> list[int]:
    """``n`` ids drawn from the ordinary part of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, min(lm.model.config.vocab_size, 30000), (n,), generator=g).tolist()


if __name__ == "__main__":
    main()
