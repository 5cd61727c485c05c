"""Shared pieces of the benchmarks: the model a run measures, results folder, machine facts, tables, JSON output.

The workloads themselves (essay text, schema builders, one TTFT measurement) are re-exported from
``bench/workloads.py``, which builds on ``studio/docqa.py``: the studio's Benchmarks tab runs exactly
the same code, without importing bench/.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.records import Machine, Spread
from bench.workloads import (  # noqa: F401  (re-exported for the bench scripts)
    QUESTION, doc_prompt, doc_schema, essay_chunks, essays_dir, fill_docs, has_roles, median, prompt_overhead,
    ttft_point)
from engine.model import MODEL_ENV, SMALL_MODEL, START_MODEL, START_NAME, default_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

__all__ = ["QUESTION", "doc_prompt", "doc_schema", "essay_chunks", "essays_dir", "fill_docs", "has_roles", "median",
           "prompt_overhead", "ttft_point", "ROOT", "RESULTS", "machine", "table", "emit", "result_name", "spread",
           "QUICK_MODEL", "BenchModel", "bench_model", "model_help"]

# What every --quick run measures unless --model says otherwise: the suite's model (tests/conftest.py), loaded in
# seconds. A full run measures default_model(): the studio's start model, or $PML_STUDIO_MODEL.
QUICK_MODEL = SMALL_MODEL


@dataclass(frozen=True)
class BenchModel:
    """The one model a benchmark runs, resolved before anything loads: the studio loads ``spec`` and every peer the
    same model (kvpress ``folder``, llama.cpp :meth:`gguf_file`)."""

    spec: str  # what Engine(model=...) and --model take
    name: str  # the loaded model's name (LoadedModel.name): the JSON's "model"
    folder: Path  # the transformers folder the studio (and kvpress) load

    def gguf_file(self) -> Path:
        """The GGUF the studio's model was converted from: the file llama.cpp runs (a SystemExit naming the fix
        where there is none)."""
        from engine.errors import ModelError
        from engine.model.packaged import PACKAGED, find_packaged, packaged_gguf

        packaged, path = find_packaged(self.spec), Path(self.spec).expanduser()
        try:
            if packaged is not None:
                return packaged_gguf(packaged.key)
        except ModelError as err:
            raise SystemExit(f"--model {self.spec}: {err}") from None
        if path.is_file() and path.suffix == ".gguf":
            return path
        raise SystemExit(f"--model {self.spec}: llama.cpp needs a GGUF file; give a packaged model "
                         f"({', '.join(PACKAGED)}) or a .gguf path")


def bench_model(model: str | None, quick: bool = False, default: str | None = None) -> BenchModel:
    """The model a run measures: ``model`` (--model) if given, else :data:`QUICK_MODEL` for a --quick run, else
    ``default`` (a script's own) or the engine's :func:`default_model`. Resolved once, here; a bad name exits with
    the engine's message."""
    from engine.errors import ModelError
    from engine.model.load import resolve_model_path

    spec = model or (QUICK_MODEL if quick else default or default_model())
    try:
        name, folder = resolve_model_path(spec)
    except ModelError as err:
        raise SystemExit(f"--model: {err}") from None
    return BenchModel(spec, name, Path(folder))


def model_help(default: str | None = None, quick: bool = True) -> str:
    """--model's help, naming the model each mode runs from the constants :func:`bench_model` resolves with."""
    full = default or f"{START_MODEL} ({START_NAME}), or ${MODEL_ENV} where set"
    return f"model to measure (default: {full}" + (f"; with --quick: {QUICK_MODEL})" if quick else ")")


def machine() -> dict:
    """This machine as a result file's "machine" (:class:`bench.records.Machine`)."""
    return Machine.here().to_json()


def spread(xs: list[float], digits: int = 2, every: bool = True) -> dict:
    """min / median / max of a list of timings (or ratios), rounded; with ``every``, each value too
    (:class:`bench.records.Spread`). An empty list gives None for each."""
    return Spread.of(xs, digits, every).to_json()


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
    """Print the JSON document last (and keep a copy under bench/results/), with the command that made it and the
    specs of the tables bench/report.py draws from it (bench/tables.py)."""
    from bench.tables import for_script

    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    specs = for_script(script)
    result = {"command": shlex.join(["python", script, *sys.argv[1:]]), **result, **({"tables": specs} if specs else {})}
    if write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
