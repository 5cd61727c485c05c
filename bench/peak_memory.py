"""What reading a run's peak memory costs its TTFT: the kernel's high-water mark against a sampling thread.

Every timed run reports the process's peak resident memory. It used to be sampled by a thread every 5 ms
inside the timed block — on a 2-core machine that thread competes with the prefill, while the floor the
cached path is compared with (bench/workloads.py) runs without it. The engine now resets ``VmHWM``
through ``/proc/self/clear_refs`` before the run and reads it after (``engine.run.memory.PeakMemory``).

This measures, on document-QA prompts of ``--model`` (see ``--help``), the baseline's and the modular arm's TTFT
with each way of reading the peak and with none: one warm-up, then ``--reps`` rounds, each round running
every method in turn (so a noisy second hits them all alike). min / median / max per method, and the
median of each round's ratio to the no-peak run. JSON last.

    python bench/peak_memory.py             # ~2 min on 2 cores
    python bench/peak_memory.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, emit, essay_chunks, machine, model_help, result_name, spread, table

from engine.run import memory
from engine.arms.compare import run_arm
from engine.arms.registry import ArmContext, Sampling
from engine.session import Engine
from studio.docqa import doc_qa


class _NoPeak(memory.PeakMemory):
    """Reads nothing: the TTFT without any peak-memory reading."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


METHODS = {"none": _NoPeak, "hwm (now)": memory.PeakMemory, "thread 5 ms (before)": memory.SampledPeak}


def measure(eng, case, reps: int) -> dict:
    lm, store = eng.lm, eng.store()
    arms = {"baseline": lambda: run_arm(ArmContext(lm, case.plan, None, None, Sampling(1)), "baseline").run,
            "cached": lambda: run_arm(ArmContext(lm, case.plan, case.encoded, store, Sampling(1)), "cached").run}
    out = {arm: {m: [] for m in METHODS} for arm in arms}
    for rnd in range(reps + 1):
        for arm, run in arms.items():
            for method, cls in METHODS.items():
                with _using(cls):
                    ms = run().ttft_ms
                if rnd:  # round 0 warms up
                    out[arm][method].append(ms)
    return out


@contextlib.contextmanager
def _using(cls):
    before = memory.PEAK_MEMORY
    memory.PEAK_MEMORY = cls
    try:
        yield
    finally:
        memory.PEAK_MEMORY = before


def summary(times: dict) -> dict:
    none = times["none"]
    return {m: {"ttft_ms": spread(xs), "ratio_to_none": spread([x / n for x, n in zip(xs, none)], 3)}
            for m, xs in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.reps = [128], 2
    eng = Engine(model=bench_model(args.model, args.quick).spec)
    chunks = essay_chunks(eng.codec.encode, 250)
    rows, results = [], []
    for n in args.lengths:
        case = doc_qa(eng, n, 1, chunks)
        per_arm = {arm: summary(t) for arm, t in measure(eng, case, args.reps).items()}
        results.append({"prompt_tokens": case.plan.prompt_tokens, "arms": per_arm})
        for arm, methods in per_arm.items():
            rows += [[case.plan.prompt_tokens, arm, m, f"{v['ttft_ms']['median']:.1f}",
                      f"{v['ttft_ms']['min']:.1f}–{v['ttft_ms']['max']:.1f}", f"{v['ratio_to_none']['median']:.3f}"]
                     for m, v in methods.items()]
    print(table(["tokens", "arm", "peak read by", "TTFT median ms", "min–max", "× none (median)"], rows))
    worst = max(v["ratio_to_none"]["median"] for r in results for a in r["arms"].values()
                for m, v in a.items() if m.startswith("thread"))
    hwm = max(v["ratio_to_none"]["median"] for r in results for a in r["arms"].values()
              for m, v in a.items() if m.startswith("hwm"))
    emit(result_name("peak-memory", None if eng.config.model is None else eng.config.model),
         {"machine": machine(), "model": eng.lm.name, "reps": args.reps, "results": results,
          "thread_cost_median_max": round(worst, 3), "hwm_cost_median_max": round(hwm, 3)},
         write=not args.quick)


if __name__ == "__main__":
    main()
