"""Shared pieces of the benchmarks: results folder, machine facts, tables, JSON output.

The workloads themselves (essay text, schema builders, one TTFT measurement) are re-exported from
``bench/workloads.py``, which builds on ``studio/docqa.py``: the studio's Benchmarks tab runs exactly
the same code, without importing bench/.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

from bench.workloads import (  # noqa: E402  (re-exported for the bench scripts)
    QUESTION, doc_prompt, doc_schema, essay_chunks, essays_dir, fill_docs, has_roles, median, prompt_overhead,
    ttft_point)

__all__ = ["QUESTION", "doc_prompt", "doc_schema", "essay_chunks", "essays_dir", "fill_docs", "has_roles", "median",
           "prompt_overhead", "ttft_point", "ROOT", "RESULTS", "machine", "table", "emit", "result_name", "spread"]


def machine() -> dict:
    import torch

    out = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "python": platform.python_version(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "cuda": torch.cuda.is_available(), "loadavg_1min": round(os.getloadavg()[0], 2)}
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def spread(xs: list[float], digits: int = 2, every: bool = True) -> dict:
    """min / median / max of a list of timings (or ratios), rounded; with ``every``, each value too.
    An empty list gives None for each."""
    import statistics

    if not xs:
        return {"min": None, "median": None, "max": None, **({"all": []} if every else {})}
    out = {"min": round(min(xs), digits), "median": round(statistics.median(xs), digits), "max": round(max(xs), digits)}
    return {**out, "all": [round(x, digits) for x in xs]} if every else out


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.rjust(x) for c, x in zip(r, w)) for r in cells]
    out.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(out)


def result_name(benchmark: str, model: str | None) -> str:
    """``ttft`` for the default model, ``ttft-gemma3-270m`` for another (never overwrites the default's results)."""
    if model in (None, "", "default"):
        return benchmark
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(model).name).strip("-.")
    return f"{benchmark}-{slug}"


def emit(name: str, result: dict, write: bool = True) -> None:
    """Print the JSON document last (and keep a copy under bench/results/), with the command that made it."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    result = {"command": shlex.join(["python", script, *sys.argv[1:]]), **result}
    if write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
