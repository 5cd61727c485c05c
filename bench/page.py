"""What every part of the generated pages shares (bench/report.py writes the Measured section of docs/benchmarks.md,
bench/headline.py the README's headline, bench/report_gpu.py the GPU part): the result files, the template's
blocks and the table specs they are rendered with."""

from __future__ import annotations

import json
import re
from collections import ChainMap

from bench import tables
from bench.common import RESULTS, ROOT

TEMPLATE = ROOT / "bench" / "report_template.md"
HEAD_START, HEAD_END = "<!-- headline:start -->", "<!-- headline:end -->"  # the headline, in README.md
ASSETS = "../assets"  # images as docs/benchmarks.md links them
LEAD = "qwen2.5-coder-0.5b"  # the model the Measured section leads with (issue 17): one that answers
SHAPE = "llama-2-7b"  # bench/ttft.py --random-shape: the paper's model size, random weights


def blocks(text: str) -> dict[str, str]:
    """The template's blocks: each ``<!-- name -->`` line starts one, which runs to the next, its last newline off."""
    parts = re.split(r"^<!-- (\w+) -->\n", text, flags=re.M)
    return {name: body[:-1] for name, body in zip(parts[1::2], parts[2::2])}


BLOCKS = blocks(TEMPLATE.read_text())


def say(block: str, d: dict | None = None, /, **values) -> str:
    """Block ``block`` filled from ``values``, then the result document ``d`` (its machine as ``machine_line``)."""
    line = {"machine_line": machine_line(d)} if d and "machine" in d else {}
    return tables.fill(BLOCKS[block], ChainMap(values, line, {"assets": ASSETS}, d or {}))


def table(name: str, d: dict | None, rows: list, each: list[str] | None = None, /, **head) -> str:
    return "\n".join(tables.render(tables.spec(d, name), rows, each, **head))


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine_line(d: dict) -> str:
    m = d["machine"]
    gpu = (m.get("gpu") or "a CUDA GPU") if m.get("cuda") else "no GPU"
    load = f", load average {m['loadavg_1min']:g} when it ended" if m.get("loadavg_1min") is not None else ""
    cpu = m.get("cpu_model") or m["cpu"]
    if m.get("cpu_model"):
        cpu += f" with {', '.join(m['cpu_features'])}" if m.get("cpu_features") else ", none of AVX2, AVX-512 and AMX"
    return f"{m['date']}, {m['threads']} CPU threads ({cpu}), {gpu}, torch {m['torch']}{load}"


def span(xs: list[float]) -> tuple[float, float]:
    return min(xs), max(xs)


def first_n(summary: dict) -> int:
    return next(iter(summary.values()))["n"]


def gpu_runs() -> list[dict]:
    return [d for d in (load("gpu-ttft-cuda"), load("gpu-ttft-cpu")) if d]


def shape_runs() -> list[dict]:
    """bench/ttft.py --random-shape llama-2-7b on a lent GPU, modules in GPU and in CPU memory."""
    return [d for d in (load(f"gpu-ttft-cuda-{SHAPE}-random"), load(f"gpu-ttft-cpu-{SHAPE}-random")) if d]
