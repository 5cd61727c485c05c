"""Decode speed and fidelity per weight precision (fp32 / bf16 / int8 / int4), one model, one run.

For each ``--weights`` setting the model is loaded with its linear layers kept that way
(engine/model/weights.py) and every sample schema's example prompt is run through the modular arm with
``--new-tokens`` greedy tokens: decode ms/token (min / median / max over the prompts and ``--reps``), TTFT
of the modular arm, the first-token KL against fp32 weights and how many greedy answers equal fp32's word
for word. Weight bytes are the linear layers' as kept. JSON last.

    python bench/decode.py --model qwen2.5-coder-0.5b      # ~4 min on 2 cores
    python bench/decode.py --quick                         # two settings, two samples
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import ROOT, bench_model, emit, machine, model_help, result_name, spread, table

from engine.arms.compare import run_arm
from engine.arms.registry import ArmContext, Sampling
from engine.model import WEIGHTS
from engine.session import Engine

SAMPLES = ROOT / "sample_schemas"


def cases(eng, names):
    out = []
    for name in names:
        schema, prompt = (SAMPLES / f"{name}.xml").read_text(), (SAMPLES / f"{name}.prompt.xml").read_text()
        lay = eng.layout(schema)
        out.append((name, lay, eng.plan(lay, prompt)))
    return out


def measure(model: str | None, weights: str, names: list[str], new_tokens: int, reps: int) -> dict:
    eng = Engine(model=model, weights=weights, persist=False)
    runs = {}
    for name, lay, plan in cases(eng, names):
        enc = eng.encode(lay).encoded
        done = [run_arm(ArmContext(eng.lm, plan, enc, eng.store(), Sampling(new_tokens)), "cached").run for _ in range(reps + 1)][1:]
        runs[name] = done
    return {"weights": weights, "weight_bytes": eng.lm.weight_bytes, "runs": runs, "model": eng.lm.name}


def summarize(m: dict, ref: dict | None) -> dict:
    runs = [r for rs in m["runs"].values() for r in rs]
    decode = [r.decode_ms_per_token for r in runs if r.decode_ms_per_token is not None]
    out = {"weights": m["weights"], "weight_bytes": m["weight_bytes"], "decode_ms_per_token": spread(decode),
           "ttft_ms": spread([r.ttft_ms for r in runs])}
    if ref is not None:
        kls, same = [], 0
        for name, rs in m["runs"].items():
            a, b = ref["runs"][name][0], rs[0]
            la, lb = torch.log_softmax(a.first_logits.float(), -1), torch.log_softmax(b.first_logits.float(), -1)
            kls.append(float(torch.sum(la.exp() * (la - lb))))
            same += a.token_ids == b.token_ids
        out.update(first_token_kl=spread(kls, 5), same_text=same, prompts=len(m["runs"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=WEIGHTS)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    names = sorted(p.stem for p in SAMPLES.glob("*.prompt.xml"))
    names = [n.removesuffix(".prompt") for n in names]
    if args.quick:  # the two smallest samples: encoding them is most of a smoke run
        small = sorted(names, key=lambda n: (SAMPLES / f"{n}.xml").stat().st_size)[:2]
        args.weights, args.new_tokens, args.reps, names = ["fp32", "int8"], 8, 1, small
    model = bench_model(args.model, args.quick)
    measured = {w: measure(model.spec, w, names, args.new_tokens, args.reps) for w in args.weights}
    ref = measured.get("fp32")
    rows = {w: summarize(m, ref if w != "fp32" else None) for w, m in measured.items()}
    print(table(["weights", "MiB", "decode ms/token median (min–max)", "TTFT ms median", "first-token KL mean",
                 "same greedy text"],
                [[w, f"{r['weight_bytes'] / 2**20:,.0f}",
                  f"{r['decode_ms_per_token']['median']} ({r['decode_ms_per_token']['min']}–"
                  f"{r['decode_ms_per_token']['max']})", r["ttft_ms"]["median"],
                  f"{statistics.mean(r['first_token_kl']['all']):.4f}" if "first_token_kl" in r else "—",
                  f"{r['same_text']}/{r['prompts']}" if "same_text" in r else "—"] for w, r in rows.items()]))
    model = next(iter(measured.values()))["model"]
    emit(result_name("decode", args.model), {"machine": machine(), "model": model, "new_tokens": args.new_tokens,
                                             "reps": args.reps, "prompts": names, "results": list(rows.values())},
         write=not args.quick)


if __name__ == "__main__":
    main()
