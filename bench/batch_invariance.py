"""Whether a row's product depends on the rows computed with it (batch invariance), for each kind of matrix product the
engine runs: torch's ``F.linear`` in fp32 and in bf16, oneDNN's bf16 over a weight laid out once (the prefill's
``gemm-bf16``), and the engine's int8 and int4 kernels (the C++ decode step's). Each kind multiplies the first M rows
of one 256-row input, at the model's layer shapes (random weights), and each row is compared bit for bit with the
same row of the whole 256-row product. Requests filled in one shared forward get the answers they get alone only
where a kind shows no row that differs: the scheduler batches decode steps for that reason, and fills one request at
a time. JSON last.

    python bench/batch_invariance.py            # the default model's shapes: bench/results/batch-invariance-MODEL.json
    python bench/batch_invariance.py --quick    # SmolLM2's first shape, no file written
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, emit, machine, model_help, result_name, table

from engine.model import kernels, prefill

ROWS = (1, 2, 3, 4, 5, 8, 16, 33, 64, 128, 255)
BATCH = 256


def shapes(folder: Path) -> list[tuple[int, int]]:
    """The model's products (in, out): q and o; gate and up stacked; down."""
    config = AutoConfig.from_pretrained(folder)
    hidden, inner = config.hidden_size, config.intermediate_size
    return [(hidden, hidden), (hidden, 2 * inner), (inner, hidden)]


def kinds() -> dict:
    """name: (make(in, out) -> product of x), or a str saying why the kind cannot run here."""
    def dense(dtype):
        def make(k, n):
            w = torch.randn(n, k).to(dtype)
            return lambda x: F.linear(x.to(dtype), w).float()
        return make

    def int8(k, n):
        q, scale = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01
        packed = kernels.pack_int8(q)
        return lambda x: kernels.ops().int8_matmul(x, packed, scale, None)

    def int4(k, n):
        packed = kernels.pack_int4(torch.randint(0, 32, (n, k)), torch.rand(n, k // 32) * 0.02,
                                   torch.randn(n, k // 32) * 0.1)
        return lambda x: kernels.ops().int4_matmul(x, *packed, None)

    def blocked(k, n):  # the prefill's gemm-bf16: oneDNN over a weight laid out once
        w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(torch.bfloat16))
        return lambda x: prefill.onednn_linear(x.to(torch.bfloat16).contiguous(), w).float()

    out = {"torch fp32": dense(torch.float32), "torch bf16": dense(torch.bfloat16)}
    out["oneDNN bf16, laid out once"] = blocked if prefill.onednn_bf16(torch.device("cpu")) else \
        "oneDNN does not run bf16 on this CPU"
    fused = kernels.ops() is not None
    out["engine int8"] = int8 if fused else kernels.status()
    out["engine int4 (5-bit)"] = int4 if fused else kernels.status()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--quick", action="store_true", help="SmolLM2 unless --model, its first shape, no file written")
    args = ap.parse_args()
    bm = bench_model(args.model, args.quick)
    torch.manual_seed(0)
    products = shapes(bm.folder)[:1 if args.quick else None]
    results = {}
    for name, make in kinds().items():
        if isinstance(make, str):
            results[name] = {"runs": False, "why": make}
            continue
        by_rows = {m: 0 for m in ROWS}
        largest = 0.0
        with torch.inference_mode():
            for k, n in products:
                product = make(k, n)
                x = torch.randn(BATCH, k)
                whole = product(x)
                for m in ROWS:
                    part = product(x[:m])
                    by_rows[m] += int((part != whole[:m]).any(dim=1).sum())
                    largest = max(largest, float((part - whole[:m]).abs().max()))
        checked = sum(ROWS) * len(products)
        results[name] = {"runs": True, "rows_checked": checked, "rows_differing": sum(by_rows.values()),
                         "largest_difference": largest, "differing_by_rows": {str(m): d for m, d in by_rows.items()}}
    print(table(["product", "rows that differ from the same row in a batch of 256", "largest difference"],
                [[name, f"{r['rows_differing']} of {r['rows_checked']}", f"{r['largest_difference']:.3g}"]
                 if r["runs"] else [name, f"not run: {r['why']}", "–"] for name, r in results.items()]))
    emit(result_name("batch-invariance", bm.spec), {
        "benchmark": "batch_invariance", "model": bm.spec, "model_name": bm.name, "machine": machine(),
        "batch": BATCH, "rows": list(ROWS), "shapes": [list(s) for s in products], "products": results},
        write=not args.quick)


if __name__ == "__main__":
    main()
