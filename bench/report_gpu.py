"""The GPU part of the Measured section (docs/benchmarks.md): bench/ttft.py on a lent GPU, at the default model's
and at Llama-2-7B's shape, its paths and profile. bench/report.py calls :func:`gpu_section`; the prose is in
bench/report_template.md like the rest."""

from __future__ import annotations

from bench.common import RESULTS
from bench.page import SHAPE, gpu_runs, load, say, shape_runs, span, table


def _where(storage: str) -> str:
    return f"{'GPU' if storage == 'cuda' else storage.upper()} memory"


def gpu_table(runs: list[dict], commands: bool = True) -> list[str]:
    """One row per length and storage: the paper's two GPU settings side by side (each row's command with
    ``commands``; else the text names them)."""
    rows = [{**r, "where": f"{d['storage'].upper()} memory (`{d['command']}`)" if commands else _where(d["storage"])}
            for d in runs for r in d["results"]]
    return [table("gpu", runs[0], rows)]


def _test_log(name: str) -> dict | None:
    """The first and last line of a test log kept beside the results (the command, and pytest's summary)."""
    log = RESULTS / name
    lines = log.read_text().strip().splitlines() if log.exists() else None
    return {"command": lines[0].lstrip("$ "), "summary": lines[-1].strip()} if lines else None


def gpu_section() -> list[str]:
    """bench/ttft.py on a lent GPU: the paper's two GPU settings (Fig. 4), modules in GPU and in CPU memory."""
    runs = gpu_runs()
    if not runs:
        return []
    out = [say("gpu", runs[0], m=runs[0]["machine"], gpu=runs[0]["machine"].get("gpu", "a CUDA GPU"))] + gpu_table(runs)
    rows = [r for d in runs for r in d["results"]]
    flat, alone = span([r["baseline_ttft_ms"] for r in rows]), span([r["nocache_ms"] for r in rows])
    copies = [r["cached_copy_ms"] for d in runs if d["storage"] == "cpu" for r in d["results"]]
    out += ["", say("gpu_after", runs[0], flat=flat, alone=alone, tokens=max(r["prompt_tokens"] for r in rows),
                    uncached=max(r["uncached_tokens"] for r in rows),
                    copies=f"; copying from CPU memory, {min(copies):.0f}–{max(copies):.0f} ms" if copies else "",
                    shape=say("gpu_shape_below" if shape_runs() else "gpu_no_shape"))]
    tests = _test_log("gpu-tests.log")
    out += [say("gpu_tests", tests)] if tests else []
    return out + [""] + shape_section(shape_runs())


def shape_section(runs: list[dict]) -> list[str]:
    """The paper's GPU settings at Llama-2-7B's shape with random weights (bench/ttft.py --random-shape)."""
    if not runs:
        return []
    d0, sh = runs[0], runs[0]["shape"]
    rows = [r for d in runs for r in d["results"]]
    words = d0["command"].split()
    tok_arg = words[words.index("--model") + 1] if "--model" in words[:-1] else None
    cut = [r for r in rows if r["target_tokens"] == sh["max_position_embeddings"] - d0["new_tokens"] - 16]
    out = [say("shape", d0, m=d0["machine"], gpu=d0["machine"].get("gpu", "a CUDA GPU"), billions=d0["params"] / 1e9,
               cut=say("shape_cut", d0, tokens=max(r["prompt_tokens"] for r in cut)) if cut else "",
               commands=" and ".join(f"`{d['command']}`" for d in runs),
               tok_note=say("shape_tokenizer", tok_arg=tok_arg) if tok_arg else "")]
    out += gpu_table(runs, commands=False) + paths_section(runs)
    on_gpu = [r for d in runs if d["storage"] == "cuda" for r in d["results"]]
    on_cpu = [r for d in runs if d["storage"] == "cpu" for r in d["results"]]
    profile, said = load(f"gpu-profile-{SHAPE}-random"), []
    if on_gpu:
        said.append(say("shape_gpu", first=on_gpu[0], last=on_gpu[-1],
                        cached=span([r["cached_ttft_ms"] for r in on_gpu]),
                        floor=span([r["cached_over_floor"] for r in on_gpu]), speedups=_speedups(on_gpu)))
        alone = [r for r in on_gpu if r["baseline_ttft_ms"] <= 1.1 * r["nocache_ms"]]
        if alone:
            said.append(say("shape_alone", at=", ".join(f"{r['prompt_tokens']:,}" for r in alone), first=alone[0],
                            ms=", ".join(f"{r['baseline_ttft_ms']:.1f} against {r['nocache_ms']:.1f} ms"
                                         for r in alone)))
    if on_cpu and profile:
        said.append(say("shape_cpu_profiled", speedups=_speedups(on_cpu)))
    elif on_cpu:
        rate = [r["store_bytes"] / r["cached_copy_ms"] / 1e6 for r in on_cpu if r["cached_copy_ms"]]
        over = all(r["cached_copy_ms"] > r["baseline_ttft_ms"] for r in on_cpu)
        said.append(say("shape_cpu", copy=span([r["cached_copy_ms"] for r in on_cpu]), rate=span(rate), first=on_cpu[0],
                        last=on_cpu[-1], over=say("shape_over") if over else "",
                        sp=span([r["speedup"] for r in on_cpu])))
    out = out + ["", " ".join(said), ""] if said else out + [""]
    return out + profile_section(profile)


def _speedups(rows: list[dict]) -> str:
    return ", ".join(f"{r['speedup']:.2f}× at {r['prompt_tokens']:,}" for r in rows)


def profile_section(d: dict | None) -> list[str]:
    """bench/gpu_profile.py: the CPU-memory setting's copy and forward, each way of combining them."""
    if not d:
        return []
    rows = [r for r in d["results"] if "error" not in r["copies"] and "error" not in r["ways_ms"]]
    return [say("profile", d, gpu=d["machine"].get("gpu"), table=table("profile", d, rows))]


def paths_section(runs: list[dict]) -> list[str]:
    """The GPU paths (pinned storage, layer-wise copies, CUDA graphs: bench/gpu.sh) against the eager pass measured
    in the same process (``--eager-too``); nothing for runs made before them."""
    runs = [d for d in runs if d.get("results_eager")]
    if not runs:
        return []
    rows = [{"on": r, "off": e, "where": _where(d["storage"])} for d in runs
            for eager in [{x["target_tokens"]: x for x in d["results_eager"]}] for r in d["results"]
            for e in [eager.get(r["target_tokens"])] if e is not None]
    paths = "; ".join(say("paths_on", d["gpu_paths"], where=_where(d["storage"])) for d in runs)
    out = ["", say("paths", paths=paths, table=table("gpu_paths", runs[0], rows))]
    read = [d["weight_read_ms"] for d in runs if d.get("weight_read_ms")]
    if read:
        out += ["", say("paths_read", gb=runs[0]["weight_bytes"] / 1e9, read=span(read))]
    tests = _test_log("gpu-paths-tests.log")
    return out + ([say("paths_tests", tests)] if tests else [])
