"""The Benchmarks tab's handlers: read bench/results/*.json into tables, and run scaling at small sizes.

Every reader takes the results folder as a parameter and, for a missing or unreadable file, says how to produce
it. The small scaling run measures with ``studio.docqa``, as bench/scaling.py does, and writes no file.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gradio as gr
import pandas as pd

from engine.errors import EngineError

from .errors import refusal

log = logging.getLogger("pml-studio")

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT_RESULTS = ROOT / "bench" / "results"
INSTALLED_RESULTS = Path(__file__).resolve().parent / "results"  # the copy an installed package carries
RESULTS = CHECKOUT_RESULTS if CHECKOUT_RESULTS.is_dir() else INSTALLED_RESULTS
RESULTS_ENV = "PML_STUDIO_RESULTS"
ASSETS = ROOT / "assets"
PLOTS = {"scaling": "scaling.png", "fidelity": "frontier.png"}
SMALL_LENGTHS = (256, 512, 1024)  # what the tab offers
MIN_LENGTH, MAX_LENGTH = 64, 1024  # what the handler accepts
SMALL_NEW_TOKENS = 2

SCALING_HEADERS = ["prompt tokens", "cached", "uncached", "baseline ms", "cached ms", "copy ms", "prefill ms",
                   "sample ms", "speedup"]
FIT_HEADERS = ["fit", "slope / exponent", "intercept ms", "R²"]
TTFT_HEADERS = ["prompt tokens", "cached", "baseline ms", "cached ms", "copy ms", "speedup", "decode ms/token base",
                "decode ms/token cached", "same text"]
FAMILY_HEADERS = ["model", "layers", "KV heads", "head dim", "MB / token fp16", "MB / token fp32", "GiB per 4K fp16"]
SAMPLE_HEADERS = ["schema", "stored tokens", "predicted bytes", "measured bytes", "equal", "entries"]
FIDELITY_HEADERS = ["path", "accuracy", "95 % CI", "found / n", "1st-token agreement", "mean 1st-token KL",
                    "same text", "ROUGE-L", "median 1st divergence"]
SMALL_HEADERS = ["prompt tokens", "cached", "baseline ms", "cached ms", "copy ms", "prefill ms", "speedup"]
FIT_NAMES = {"cached_ttft_vs_cached_tokens_linear": "cached TTFT vs cached tokens (linear)",
             "baseline_ttft_vs_prompt_tokens_linear": "baseline TTFT vs prompt tokens (linear)",
             "cached_ttft_power": "cached TTFT ∝ tokens^k",
             "baseline_ttft_power": "baseline TTFT ∝ tokens^k"}


# Reading results

@dataclass(frozen=True)
class Result:
    name: str
    path: Path
    data: dict | None
    problem: str = ""  # why data is None

    @property
    def ok(self) -> bool:
        return self.data is not None


def results_folder(folder: str | Path | None = None) -> Path:
    return Path(folder or os.environ.get(RESULTS_ENV) or RESULTS)


def read_result(name: str, folder: str | Path | None = None) -> Result:
    """``NAME.json`` in :func:`results_folder`; data None with the reason when unusable."""
    path = results_folder(folder) / f"{name}.json"
    if not path.exists():
        return Result(name, path, None, f"not run yet: `{command(name)}`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return Result(name, path, None, f"{path.name} cannot be read ({type(err).__name__}: {err}); run "
                                        f"`{command(name)}` again")
    if not isinstance(data, dict):
        return Result(name, path, None, f"{path.name} is not a benchmark result; run `{command(name)}` again")
    return Result(name, path, data)


def recorded_settings(name: str, d: dict) -> dict:
    rows = d.get("results") or []
    out: dict = {}
    if name in ("scaling", "ttft"):
        lengths = [r.get("target_tokens") for r in rows]
        if rows and None not in lengths:
            out["lengths"] = lengths
        out["reps"] = d.get("reps")
        out["new_tokens"] = d.get("new_tokens")
    elif name == "fidelity":
        modules = [int(k) for k in (d.get("by_modules") or {})]
        if modules:
            out["modules"] = modules
            if d.get("prompts"):
                out["per_setting"] = d["prompts"] // len(modules)
        depths = [float(k) for k in (d.get("by_depth") or {})]
        if depths:
            out["depths"] = depths
        out["new_tokens"] = d.get("new_tokens")
    elif name == "compression":
        out.update(prompts=d.get("prompts"), modules=d.get("modules_per_prompt"), new_tokens=d.get("new_tokens"))
    return {k: v for k, v in out.items() if v is not None}


def command(name: str, data: dict | None = None) -> str:
    """The command that produced a result: the one it records, else one rebuilt from its settings."""
    if data and isinstance(data.get("command"), str):
        return data["command"]
    flags: list[str] = []
    for key, value in recorded_settings(name, data or {}).items():
        shown = " ".join(_arg(v) for v in value) if isinstance(value, list) else _arg(value)
        flags.append(f"--{key.replace('_', '-')} {shown}")
    if data and data.get("model") and "SmolLM2-135M" not in str(data["model"]):
        flags.append(f"--model {data['model']}")
    return " ".join([f"python bench/{name}.py"] + flags)


def _arg(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def machine_text(data: dict) -> str:
    m = data.get("machine") or {}
    if not m:
        return "machine not recorded"
    parts = [m.get("date"), m.get("cpu"), f"{m['threads']} threads" if m.get("threads") else None,
             f"torch {m['torch']}" if m.get("torch") else None, f"Python {m['python']}" if m.get("python") else None,
             "CUDA" if m.get("cuda") else "no CUDA"]
    return " · ".join(str(p) for p in parts if p)


def header_md(res: Result, title: str, what: str) -> str:
    if not res.ok:
        return f"### {title}\n{what}\n\n**{res.problem}**"
    d = res.data
    model = f" · {d['model']}" if d.get("model") else ""
    dtype = f" ({d['dtype']})" if d.get("dtype") else ""
    return (f"### {title}\n{what}\n\n**Measured** {machine_text(d)}{model}{dtype} · file `{_rel(res.path)}`  \n"
            f"**Command** `{command(res.name, d)}`")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _frame(rows: list[list], headers: list[str]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=headers)


def _num(x, nd: int = 1):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return round(float(x), nd)


def _pct(x) -> str:
    return "–" if x is None else f"{100 * float(x):.0f} %"


# One view per benchmark

def scaling_view(folder: str | Path | None = None) -> tuple[str, pd.DataFrame, pd.DataFrame]:
    """(header markdown, TTFT per length, fits) of bench/results/scaling.json."""
    res = read_result("scaling", folder)
    head = header_md(res, "Scaling: TTFT against prompt length",
                     "Baseline (full prefill) vs cached (module KV copied, question prefilled); medians.")
    rows, fits = [], []
    if res.ok:
        for r in res.data.get("results") or []:
            rows.append([r.get("prompt_tokens"), r.get("cached_tokens"), r.get("uncached_tokens"),
                         _num(r.get("baseline_ttft_ms")), _num(r.get("cached_ttft_ms")), _num(r.get("cached_copy_ms")),
                         _num(r.get("cached_prefill_ms")), _num(r.get("cached_sample_ms")),
                         f"{r['speedup']:.1f}×" if r.get("speedup") is not None else "–"])
        for key, f in (res.data.get("fits") or {}).items():
            slope = f.get("exponent", f.get("slope_ms_per_token"))
            unit = "" if "exponent" in f else " ms/token"
            fits.append([FIT_NAMES.get(key, key), f"{slope}{unit}", f.get("intercept_ms", "–"), f.get("r2")])
        if res.data.get("gpu_note"):
            head += f"  \n_{res.data['gpu_note']}_"
    return head, _frame(rows, SCALING_HEADERS), _frame(fits, FIT_HEADERS)


def ttft_view(folder: str | Path | None = None) -> tuple[str, pd.DataFrame]:
    """(header markdown, speedup per length) of bench/results/ttft.json."""
    res = read_result("ttft", folder)
    head = header_md(res, "TTFT speedup", "Document-QA prompts; cached TTFT includes the copy of the modules' KV.")
    rows = []
    if res.ok:
        for r in res.data.get("results") or []:
            rows.append([r.get("prompt_tokens"), r.get("cached_tokens"), _num(r.get("baseline_ttft_ms")),
                         _num(r.get("cached_ttft_ms")), _num(r.get("cached_copy_ms")),
                         f"{r['speedup']:.1f}×" if r.get("speedup") is not None else "–",
                         _num(r.get("baseline_decode_ms_per_token")), _num(r.get("cached_decode_ms_per_token")),
                         "yes" if r.get("same_text") else "no"])
    return head, _frame(rows, TTFT_HEADERS)


def memory_view(folder: str | Path | None = None) -> tuple[str, pd.DataFrame, pd.DataFrame]:
    """(header markdown, KV bytes per token by model family, measured vs predicted per sample)."""
    res = read_result("memory", folder)
    head = header_md(res, "Memory per cached token",
                     "KV bytes per token from model configs (the paper's Table 2 and current small models), and "
                     "the bytes the module store holds for each sample schema against the prediction.")
    fams, samples = [], []
    if res.ok:
        d = res.data
        for f in d.get("families") or []:
            fp16 = f.get("fp16_bytes_per_token")
            fams.append([f.get("model"), f.get("layers"), f.get("kv_heads"), f.get("head_dim"),
                         f.get("fp16_mb_per_token"), None if fp16 is None else round(2 * fp16 / 2**20, 4),
                         f.get("fp16_gib_per_4k_tokens")])
        for s in d.get("samples") or []:
            samples.append([s.get("schema"), s.get("stored_tokens"), s.get("predicted_bytes"), s.get("measured_bytes"),
                            "yes" if s.get("match") else "NO", s.get("entries")])
        lm = d.get("loaded") or {}
        if lm:
            head += (f"  \n**Loaded model** {lm.get('model')} ({lm.get('dtype')}): "
                     f"{lm.get('kv_bytes_per_token', 0):,} KV bytes per token")
        if "all_match" in d:
            head += " · measured equals predicted for every sample" if d["all_match"] else \
                " · **measured differs from predicted for some samples**"
    return head, _frame(fams, FAMILY_HEADERS), _frame(samples, SAMPLE_HEADERS)


def fidelity_view(folder: str | Path | None = None) -> tuple[str, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(header markdown, accuracy and agreement per path, accuracy by needle depth, by number of modules)."""
    res = read_result("fidelity", folder)
    head = header_md(res, "Fidelity: needle in a haystack",
                     "Is the needle's number in the answer, per path (95 % Wilson interval), and how the cached "
                     "paths agree with the baseline.")
    summary, depth, modules = [], _frame([], ["needle depth"]), _frame([], ["modules"])
    if res.ok:
        d = res.data
        for path, s in (d.get("summary") or {}).items():
            ci = s.get("ci95") or [None, None]
            summary.append([path, _pct(s.get("accuracy")), f"{_pct(ci[0])} – {_pct(ci[1])}",
                            f"{s.get('found')} / {s.get('n')}", _pct(s.get("first_token_agreement")),
                            s.get("mean_first_token_kl", "–"), _pct(s.get("same_text_rate")),
                            s.get("mean_rouge_l", "–"), s.get("median_first_divergence", "–")])
        depth = _breakdown(d.get("by_depth") or {}, "needle depth")
        modules = _breakdown(d.get("by_modules") or {}, "modules")
        if d.get("prompts"):
            head += f"  \n{d['prompts']} prompts, greedy, {d.get('new_tokens', '?')} new tokens"
    return head, _frame(summary, FIDELITY_HEADERS), depth, modules


COMPRESSION_HEADERS = ["configuration", "module bytes", "cached TTFT ms", "accuracy", "95 % CI",
                       "1st-token agreement vs cached fp32", "KL vs cached fp32", "1st-token agreement vs baseline",
                       "KL vs baseline"]


def compression_view(folder: str | Path | None = None) -> tuple[str, pd.DataFrame]:
    """(header markdown with the verdicts, one row per storage configuration) of bench/results/compression.json."""
    res = read_result("compression", folder)
    head = header_md(res, "Smaller stored modules: precision and layer-wise compression",
                     "Needle accuracy and agreement when modules are stored in fp16/bf16 or with 75/50/30 % "
                     "retention (pyramid vs the uniform and recent-window controls), at the bytes shown.")
    rows = []
    if res.ok:
        d = res.data
        for name, s in (d.get("summary") or {}).items():
            ci = s.get("ci95") or [None, None]
            ratio = s.get("bytes_ratio")
            rows.append([name, "–" if ratio is None else f"{100 * ratio:.0f} %", _num(s.get("ttft_ms")),
                         _pct(s.get("accuracy")), f"{_pct(ci[0])} – {_pct(ci[1])}", _pct(s.get("agree_ref")),
                         s.get("kl_ref", "–"), _pct(s.get("agree_base")), s.get("kl_base", "–")])
        for v in d.get("verdicts") or []:
            head += f"  \n- {v}"
    return head, _frame(rows, COMPRESSION_HEADERS)


def _breakdown(data: dict, key: str) -> pd.DataFrame:
    paths = [p for p in next(iter(data.values()), {}) if p != "n"]
    rows = [[k] + [_pct(v.get(p)) for p in paths] + [v.get("n")] for k, v in data.items()]
    return _frame(rows, [key] + paths + ["n"])


def plot_path(name: str, assets: str | Path | None = None) -> str | None:
    path = Path(assets or ASSETS) / PLOTS[name]
    return str(path) if path.exists() else None


def plot_note(name: str, assets: str | Path | None = None) -> str:
    if plot_path(name, assets):
        return ""
    return f"_No plot yet: `python bench/{name}.py` draws `assets/{PLOTS[name]}`._"


# Scaling at small sizes, in the studio

_CHUNKS: dict[str, list[str]] = {}  # per tokenizer: cutting them takes a few seconds


def parse_lengths(lengths, max_positions: int | None = None) -> list[int]:
    """Sorted distinct prompt lengths in [MIN_LENGTH, MAX_LENGTH]; raises gr.Error otherwise."""
    if lengths in (None, "", []):
        raise refusal("pick at least one prompt length")
    if isinstance(lengths, (int, str)):
        lengths = [lengths]
    out = set()
    for x in lengths:
        try:
            n = int(x)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise refusal(f"'{x}' is not a prompt length in tokens") from None
        if not MIN_LENGTH <= n <= MAX_LENGTH:
            raise refusal(f"{n} tokens is outside what the studio runs ({MIN_LENGTH}–{MAX_LENGTH}); longer prompts "
                           "are for `python bench/scaling.py`")
        if max_positions and n + SMALL_NEW_TOKENS + 1 > max_positions:
            raise refusal(f"{n} tokens does not fit the model's context of {max_positions} positions")
        out.add(n)
    return sorted(out)


def run_small_scaling(engine, lengths, progress: Callable[[int, int, str], None] | None = None,
                      reps: int = 1) -> tuple[list[dict], str]:
    """Baseline vs cached TTFT at each length (1 rep after a warm-up pair), in a throw-away engine around the loaded
    model under ``engine.run_lock``; the ttft_point dicts and a one-line note. Raises gr.Error; writes no file."""
    from engine.session import Engine

    from .docqa import doc_qa, essay_chunks, ttft_point
    from .streaming import with_progress

    def work(report) -> tuple:  # on the engine thread
        report(0, 1, "loading the model" if not engine.loaded else "preparing")
        lm = engine.lm
        targets = parse_lengths(lengths, getattr(lm, "max_positions", None))
        codec = engine.codec
        key = getattr(codec, "fingerprint", None) or str(id(codec))
        if key not in _CHUNKS:
            report(0, len(targets), "cutting the essays into chunks")
            _CHUNKS[key] = essay_chunks(codec.encode, 250)
        chunks = _CHUNKS[key]
        bench = Engine.from_loaded(lm, storage="cpu", mode=engine.config.mode)  # persist=False: nothing kept
        rows = []
        with engine.run_lock:
            for i, n in enumerate(targets):
                report(i, len(targets), f"{n} tokens: warm-up, baseline and cached")
                rows.append(ttft_point(bench, doc_qa(bench, n, SMALL_NEW_TOKENS, chunks), reps))
        report(len(targets), len(targets), "done")
        return lm, rows

    try:
        lm, rows = with_progress(work, progress)
    except gr.Error:
        raise
    except EngineError as err:
        raise refusal(str(err)) from None
    except Exception as err:
        log.exception("small scaling run failed")
        raise refusal(f"the scaling run failed: {type(err).__name__}: {err}") from None
    note = (f"{len(rows)} length(s), {reps} rep after a warm-up pair, {SMALL_NEW_TOKENS} new tokens, model "
            f"{lm.name}, CPU storage, {engine.config.mode} mode. Not saved: `python bench/scaling.py` writes "
            "bench/results/scaling.json.")
    return rows, note


def small_rows(rows: list[dict]) -> pd.DataFrame:
    return _frame([[r["prompt_tokens"], r["cached_tokens"], _num(r["baseline_ttft_ms"]), _num(r["cached_ttft_ms"]),
                    _num(r["cached_copy_ms"]), _num(r["cached_prefill_ms"]), f"{r['speedup']:.1f}×"] for r in rows],
                  SMALL_HEADERS)


def small_plot(rows: list[dict]) -> pd.DataFrame:
    points = []
    for r in rows:
        points.append({"prompt tokens": r["prompt_tokens"], "TTFT ms": r["baseline_ttft_ms"], "path": "baseline"})
        points.append({"prompt tokens": r["prompt_tokens"], "TTFT ms": r["cached_ttft_ms"], "path": "cached"})
    return pd.DataFrame(points, columns=["prompt tokens", "TTFT ms", "path"])
