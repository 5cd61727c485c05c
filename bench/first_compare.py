"""What a newcomer waits for: loading a model and the studio's Compare on the default sample.

The studio's Compare button runs `Engine.compare` on the sample schema and prompt with the
default arms (baseline, prefix cache, modular cache) and 32 new tokens; this script does the same
in one process, per model and dtype:

* **load** — the model's weights and tokenizer (converted once beforehand: the conversion is a
  one-time cost, timed by `make qwen` / the first use, not here);
* **first Compare** — the first compare after the load: encodes the schema's modules, warms the
  prefix cache, runs the three arms;
* **later Compares** — ``--reps`` more compares of the same prompt (modules already encoded).

Issue 17's bar for making a model the studio's default: first Compare within 30 s, later ones within
10 s at 32 new tokens. Prints a table, then one JSON document last (bench/results/first_compare.json).

    python bench/first_compare.py                        # every --setups default (--help names them)
    python bench/first_compare.py --quick                # the small model only, 1 later compare, no file
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import QUICK_MODEL, ROOT, emit, machine, table

from engine.arms.registry import Sampling
from engine.model import START_MODEL
from engine.session import Engine

SETUPS = ((QUICK_MODEL, "float32"), (START_MODEL, "float32"), (START_MODEL, "bfloat16"))


def measure(model: str, dtype: str, sample: str, new_tokens: int, reps: int) -> dict:
    schema = (ROOT / "sample_schemas" / f"{sample}.xml").read_text()
    prompt = (ROOT / "sample_schemas" / f"{sample}.prompt.xml").read_text()
    sampling = Sampling(max_new_tokens=new_tokens)
    t = time.perf_counter()
    eng = Engine(model=model, dtype=dtype, persist=False)
    eng.lm
    load_s = time.perf_counter() - t
    times, last = [], None
    for _ in range(1 + reps):
        t = time.perf_counter()
        last = eng.compare(schema, prompt, sampling)
        times.append(time.perf_counter() - t)
    later = times[1:]
    arms = {a.value: {"ttft_ms": round(r.run.ttft_ms, 1), "new_tokens": len(r.run.token_ids), "text": r.run.text}
            for a, r in last.arms.items()}
    agree = last.agreement("cached")
    row = {"model": eng.lm.name, "key": model, "dtype": dtype, "sample": sample, "prompt_tokens": last.prompt.prompt_tokens,
           "load_s": round(load_s, 2), "first_compare_s": round(times[0], 2),
           "later_compare_s": {"min": round(min(later), 2), "median": round(statistics.median(later), 2),
                               "max": round(max(later), 2), "all": [round(x, 2) for x in later]},
           "arms": arms, "modular_same_text": agree.same_text if agree else None,
           "modular_first_divergence": agree.first_divergence if agree else None,
           "meets_default_bar": times[0] <= 30 and max(later) <= 10}
    print(f"{row['model']} {dtype}: load {row['load_s']} s, first Compare {row['first_compare_s']} s, later "
          f"{row['later_compare_s']['median']} s (max {row['later_compare_s']['max']})", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", default="travel", help="sample schema (the studio opens on travel)")
    ap.add_argument("--new-tokens", type=int, default=32, help="the studio's default")
    ap.add_argument("--reps", type=int, default=3, help="later compares")
    ap.add_argument("--setups", nargs="+", default=[f"{m}:{d}" for m, d in SETUPS], metavar="MODEL:DTYPE",
                    help=f"models and dtypes to measure (default: {' '.join(f'{m}:{d}' for m, d in SETUPS)})")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_MODEL}:float32 only, one later compare, no file written")
    args = ap.parse_args()
    if args.quick:
        args.setups, args.reps = [f"{QUICK_MODEL}:float32"], 1
    t0 = time.perf_counter()
    rows = [measure(*s.split(":"), args.sample, args.new_tokens, args.reps) for s in args.setups]
    print(table(["model", "dtype", "load s", "first Compare s", "later Compare s (min-max)", "tokens per arm",
                 "modular answer = baseline"],
                [[r["model"], r["dtype"], r["load_s"], r["first_compare_s"],
                  f"{r['later_compare_s']['median']} ({r['later_compare_s']['min']}-{r['later_compare_s']['max']})",
                  " / ".join(str(a["new_tokens"]) for a in r["arms"].values()), r["modular_same_text"]]
                 for r in rows]))
    emit("first_compare", {"benchmark": "first_compare", "sample": args.sample, "new_tokens": args.new_tokens,
                           "reps": args.reps, "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
                           "results": rows}, write=not args.quick)


if __name__ == "__main__":
    main()
