"""What one C++ decode step spends beside its weight products (engine/model/step.py), side by side in one run.

Three things timed alternately, ``--reps`` times each, on the model loaded with ``--weights`` (a setting the C++
step applies to): the whole step over a KV buffer of ``--context`` cached tokens (one row, as a run decoding
alone); the same step's weight products alone, called in the same order on inputs of the right sizes; and the
step through transformers' modules (``PML_STUDIO_STEP=0``'s path: the model's forward over the same buffer). The
difference between the first two is everything that is not weight traffic (norms, rotary embedding, attention
over the cache, the activation, the call itself): what ``torch.compile`` or any other fusion could still take.
min / median / max, JSON last.

    python bench/step_parts.py --model qwen2.5-coder-0.5b        # ~1 min
    python bench/step_parts.py --quick                            # int8, 3 repetitions, no file
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import QUICK_MODEL, bench_model, emit, machine, model_help, result_name, spread, table

from engine.kv import Lease
from engine.model import kernels, step
from engine.session import Engine


def products(model) -> list:
    """The step's weight products in order, as (C++ linear layer, input width)."""
    ops = kernels.ops()
    out = []
    for layer in model.model.layers:
        qkv, o, gate_up, down = step.layer_products(layer)
        hidden = layer.self_attn.q_proj.in_features
        out += [(step._linear(ops, p), hidden) for p in qkv]
        out += [(step._linear(ops, o), layer.self_attn.o_proj.in_features), (step._linear(ops, gate_up), hidden),
                (step._linear(ops, down), layer.mlp.down_proj.in_features)]
    return out + [(step._linear(ops, model.lm_head), model.lm_head.in_features)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--weights", default="gguf", choices=step.PACKED)
    ap.add_argument("--context", type=int, default=600, help="cached tokens the step attends to")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_MODEL} unless --model, int8 weights, 3 repetitions, no file")
    args = ap.parse_args()
    if args.quick:
        args.weights, args.reps, args.context = "int8", 3, 64
    lm = Engine(model=bench_model(args.model, args.quick).spec, weights=args.weights, persist=False).lm
    fast = step.decoder(lm.model, lm.weights)
    if fast is None:
        raise SystemExit(f"the C++ decode step does not apply: {step.why_not(lm.model, lm.weights)}")
    torch.manual_seed(0)
    data = torch.zeros(lm.n_layers, 2, 1, lm.kv_heads, args.context + 8, lm.head_dim)
    data[:, :, :, :, : args.context].normal_()
    prods = products(lm.model)
    inputs = {w: torch.randn(1, w) for _, w in prods}

    def buffer():
        lease = Lease.private(data)
        lease.advance(args.context)
        return lease.cache()

    def whole():
        fast([100], [args.context], data, torch.tensor([0]), torch.tensor([args.context]))

    def parts():
        for lin, width in prods:
            lin(inputs[width])

    def transformers_path():
        lm.model(input_ids=torch.tensor([[100]]), position_ids=torch.tensor([[args.context]]),
                 past_key_values=buffer(), use_cache=True, logits_to_keep=1)

    timed = {"step": whole, "products": parts, "transformers": transformers_path}
    ms: dict[str, list[float]] = {k: [] for k in timed}
    with torch.inference_mode():
        for f in timed.values():
            for _ in range(3):
                f()
        for _ in range(args.reps):
            for name, f in timed.items():
                t = time.perf_counter()
                f()
                ms[name].append((time.perf_counter() - t) * 1000)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(table(["what", "ms median (min–max)"],
                [[k, f"{med[k]:.2f} ({min(v):.2f}–{max(v):.2f})"] for k, v in ms.items()]
                + [["step − products", f"{med['step'] - med['products']:.2f}"]]))
    emit(result_name("step-parts", args.model), {
        "benchmark": "step_parts", "machine": machine(), "model": lm.name, "weights": lm.weights,
        "context": args.context, "reps": args.reps, "products_per_step": len(prods),
        "ms": {k: spread(v) for k, v in ms.items()}, "not_products_ms": round(med["step"] - med["products"], 2),
        "transformers_over_step": round(med["transformers"] / med["step"], 2)}, write=not args.quick)


if __name__ == "__main__":
    main()
