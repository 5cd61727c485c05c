"""A question that needs no module: does the routed arm answer as the modular arm does? (issue 27)

Six greetings and small talk ("Hello! How are you today?", ...) asked over 8 confusable essay modules (the
documents of bench/fidelity.py's confusable set). For each, the modular arm's greedy answer against the routed
arm's at top-1, top-2 (the default) and share 0.3. Reported: how many answers are the same text, and which
modules each routed run read. JSON last.

    python bench/routed_greetings.py --model qwen2.5-coder-0.5b --weights int8     # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, doc_schema, emit, essay_chunks, has_roles, machine, model_help, result_name

from bench import needles
from bench.workloads import SYSTEM
from engine.arms.compare import decoding, run_arm
from engine.arms.registry import ArmContext
from engine.run.events import finish
from engine.arms.registry import Sampling
from engine.arms.routed import RoutedSettings, routed_run
from engine.session import Engine

GREETINGS = ("Hello! How are you today?", "Thanks, that is all for now.", "Good morning!", "Hi there, who are you?",
             "Can you help me?", "Goodbye and have a nice day.")
SETTINGS = {"routed (default)": {}, "route 1": {"k": 1}, "route 2": {"k": 2}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help(quick=False))
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    eng = Engine(model=bench_model(args.model).spec, weights=args.weights, persist=False)
    cases = needles.confusable_cases(essay_chunks(eng.codec.encode, 250), 8, len(GREETINGS), 7)
    rows, same = [], {name: 0 for name in SETTINGS}
    for idx, (case, greeting) in enumerate(zip(cases, GREETINGS)):
        prompt = f'<prompt schema="g{idx}">' + "".join(f"<doc{i}/>" for i in range(8)) + f" {escape(greeting)}</prompt>"
        lay = eng.layout(doc_schema(f"g{idx}", case["docs"], system=SYSTEM, roles=has_roles(eng)))
        plan = eng.plan(lay, prompt, args.new_tokens)
        enc = eng.encode(lay, eng.config.with_(mode="prefixed")).encoded
        store = eng.store()
        ctx = decoding(ArmContext(eng.lm, plan, enc, store, Sampling(args.new_tokens)))
        modular = run_arm(ctx, "cached").run
        row = {"greeting": greeting, "modular": modular.text}
        for name, kw in SETTINGS.items():
            run, info = finish(routed_run(ctx, RoutedSettings(**kw)))
            row[name] = {"text": run.text, "same_text": run.text == modular.text, "kept": list(info.kept),
                         "pull": {m: round(v, 4) for m, v in info.pull.items()}}
            same[name] += run.text == modular.text
        rows.append(row)
        print(f"[{idx + 1}/{len(GREETINGS)}] {greeting!r}: " + ", ".join(
            f"{n} {'same' if row[n]['same_text'] else 'differs'}" for n in SETTINGS), flush=True)
        for key in list(store.keys()):
            store.evict(key)
    print("same answer as the modular arm: " + ", ".join(f"{n} {k}/{len(rows)}" for n, k in same.items()))
    emit(result_name("routed-greetings", args.model), {
        "benchmark": "routed-greetings", "model": eng.lm.name, "weights": args.weights, "new_tokens": args.new_tokens,
        "machine": machine(), "same_text": same, "prompts": len(rows), "rows": rows})


if __name__ == "__main__":
    main()
