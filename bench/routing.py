"""Where the question's attention points: the routed arm's scout (engine/arms/routed.py) at every layer, on the
confusable and two-fact sets of bench/fidelity.py. No generation: this measures the routing, not the answers.

For each prompt the modules are encoded (``prefixed``, the modular arm's mode there), the uncached tokens are
run over all of them and, at every decoder layer, two scores per module: its **pull** (the strongest attention
any head of any uncached token pays one of its keys: what the routed arm routes by) and its attention **mass**
(summed over heads and uncached tokens: the obvious rule, for comparison). Reported per rule, per layer and
per window of layers (a window takes the max of the pulls, the sum of the masses): how many prompts rank the
asked module(s) first (both in the top 2 for two-fact prompts), with a 95 % Wilson interval, and the asked
module's mean share. SCOUT_LAYERS comes from here: the window with the best rate. JSON last.

    python bench/routing.py --model qwen2.5-coder-0.5b            # 24 confusable + 24 two-fact prompts, ~12 min
    python bench/routing.py --quick                               # 2 prompts each
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, doc_schema, emit, essay_chunks, has_roles, machine, model_help, result_name, table

from bench import needles
from bench.workloads import SYSTEM
from engine.arms.routed import SCOUT_LAYERS, scout_plan
from engine.session import Engine

WINDOWS = (1, 2, 4, 6, 8)  # widths of the layer windows tried


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [round(max(0.0, c - h), 4), round(min(1.0, c + h), 4)]


def scout_case(eng: Engine, case: dict, idx: int) -> dict[str, torch.Tensor]:
    """{"pull": [layers, modules], "mass": [layers, modules]} of the question on each module, every layer."""
    from xml.sax.saxutils import escape

    n = case["modules"]
    prompt = f'<prompt schema="route{idx}">' + "".join(f"<doc{i}/>" for i in range(n)) + \
        f" {escape(case['question'])}</prompt>"
    lay = eng.layout(doc_schema(f"route{idx}", case["docs"], system=SYSTEM, roles=has_roles(eng)))
    plan = eng.plan(lay, prompt, 8)
    enc = eng.encode(lay, eng.config.with_(mode="prefixed")).encoded
    store = eng.store()
    seen = scout_plan(eng.lm, plan, enc, store, tuple(range(eng.lm.n_layers)))
    for key in list(store.keys()):
        store.evict(key)
    assert seen.modules == tuple(f"doc{i}" for i in range(n))
    return {"pull": seen.pull, "mass": seen.mass}


def hits(mass: torch.Tensor, targets: list[int]) -> tuple[bool, float]:
    """(the asked modules are the top len(targets), their share of the mass) for one layer or window's [modules]."""
    top = set(torch.sort(mass, descending=True, stable=True).indices[: len(targets)].tolist())
    return top == set(targets), float(mass[targets].sum() / mass.sum())


def summarise(masses: list[torch.Tensor], cases: list[dict], window=lambda x: x.sum(0)) -> dict:
    layers = masses[0].shape[0]
    per_layer, windows = [], []
    for layer in range(layers):
        got = [hits(m[layer], c.get("needle_modules") or [c["needle_module"]]) for m, c in zip(masses, cases)]
        k = sum(h for h, _ in got)
        per_layer.append({"layer": layer, "top": k, "n": len(got), "rate": round(k / len(got), 4),
                          "ci95": wilson(k, len(got)), "asked_share": round(sum(s for _, s in got) / len(got), 4)})
    for width in WINDOWS:
        for start in range(0, layers - width + 1):
            got = [hits(window(m[start:start + width]), c.get("needle_modules") or [c["needle_module"]])
                   for m, c in zip(masses, cases)]
            k = sum(h for h, _ in got)
            windows.append({"layers": [start, start + width - 1], "top": k, "n": len(got), "rate": round(k / len(got), 4),
                            "ci95": wilson(k, len(got)), "asked_share": round(sum(s for _, s in got) / len(got), 4)})
    best = max(windows, key=lambda w: (w["rate"], w["asked_share"]))
    return {"per_layer": per_layer, "windows": windows, "best_window": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--confusable", type=int, default=24)
    ap.add_argument("--two-fact", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0, help="bench/fidelity.py's: the same prompts")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    modules, chunk_tokens = 8, 250
    if args.quick:
        args.confusable, args.two_fact, modules, chunk_tokens = 2, 2, 3, 80
    eng = Engine(model=bench_model(args.model, args.quick).spec, weights=args.weights, persist=False)
    chunks = essay_chunks(eng.codec.encode, chunk_tokens)
    sets = {"confusable": needles.confusable_cases(chunks, modules, args.confusable, args.seed + 1),
            "two_fact": needles.two_fact_cases(chunks, modules, args.two_fact, args.seed + 2)}
    out = {}
    for label, cases in sets.items():
        masses = []
        for i, case in enumerate(cases):
            masses.append(scout_case(eng, case, i))
            print(f"[{label} {i + 1}/{len(cases)}]", flush=True)
        if not cases:
            continue
        out[label] = {"pull": summarise([m["pull"] for m in masses], cases, lambda x: x.amax(0)),
                      "mass": summarise([m["mass"] for m in masses], cases)}
        for rule in ("pull", "mass"):
            got = out[label][rule]
            rows = [[r["layer"], f"{r['top']}/{r['n']}", r["ci95"], r["asked_share"]] for r in got["per_layer"]]
            print(f"{label}, by {rule}")
            print(table(["layer", "asked module(s) on top", "95 % CI", "asked share"], rows))
            now = next(w for w in got["windows"] if w["layers"] == [SCOUT_LAYERS[0], SCOUT_LAYERS[-1]]) \
                if len(SCOUT_LAYERS) in WINDOWS else None
            print(f"{label}, by {rule}: best window {got['best_window']}; SCOUT_LAYERS {now}")
    emit(result_name("routing", args.model), {
        "benchmark": "routing", "model": eng.lm.name, "weights": args.weights, "modules": modules,
        "scout_layers_now": list(SCOUT_LAYERS), "machine": machine(), **out}, write=not args.quick)


if __name__ == "__main__":
    main()
