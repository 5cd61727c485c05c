"""Benchmark workloads: document-QA TTFT points with the cached path's floor, and needle prompts.

The document-QA prompts and their timing live in ``studio/docqa.py`` (the studio's Benchmarks tab
times the same prompts at small sizes); they are re-exported here for the bench scripts. Benchmark
code sits above the engine and the studio: neither imports it.
"""

from __future__ import annotations

import math
import re
from xml.sax.saxutils import escape

from studio.docqa import (QUESTION, doc_prompt, doc_qa, doc_schema,  # noqa: F401  (re-exported for the bench scripts)
                          essay_chunks, essays_dir, fill_docs, has_roles, median, prompt_overhead)
from studio.docqa import ttft_point as docqa_point


def ttft_point(eng, target: int, reps: int, new_tokens: int, chunks: list[str], progress=None,
               floor: bool = False) -> dict:
    """Median TTFT of baseline and cached on one document-QA prompt of about ``target`` tokens
    (:func:`studio.docqa.ttft_point`); with ``floor``, also the floor of the cached path
    (:func:`floor_point`), measured in the same process."""
    case = doc_qa(eng, target, new_tokens, chunks)
    out = docqa_point(eng, case, reps, progress)
    if floor:
        out.update(floor_point(eng, case.plan, case.encoded, reps, out["cached_ttft_ms"]))
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

    from engine.cache.assemble import copy_list
    from engine.kv import Lease
    from engine.model.attend import ATTENTION

    lm = eng.lm
    assembled = Lease.private(torch.zeros(lm.n_layers, 2, 1, lm.kv_heads, plan.cached_tokens, lm.head_dim,
                                          dtype=lm.model.dtype, device=lm.device))
    for span in copy_list(plan, encoded, eng.store()):  # the cached arm's fill
        span.write_into(assembled)
    past = assembled.kv().clone()  # [layers, 2, kv_heads, cached, head_dim]
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


def make_cases(chunks: list[str], n_modules: list[int], per_setting: int, depths: list[float],
               seed: int) -> list[dict]:
    """Magic-number prompts: ``per_setting`` per module count of ``n_modules``, the needle at each depth in turn."""
    import random

    rng = random.Random(seed)
    cases = []
    for n in n_modules:
        for i in range(per_setting):
            start = rng.randrange(0, len(chunks) - n)
            docs = list(chunks[start:start + n])
            depth = depths[i % len(depths)]
            target = min(n - 1, int(depth * n))  # which module holds the needle
            name, number = rng.choice(NAMES), str(rng.randrange(1_000_000, 9_999_999))
            docs[target] = insert(docs[target], needle(name, number), rng.random())
            cases.append({"modules": n, "depth": depth, "needle_module": target, "name": name, "number": number,
                          "others": [], "docs": docs})
    return cases


def case_prompt(case: dict, idx: int) -> tuple[str, str]:
    """(schema, prompt) of needle case ``idx``: its modules after the system message, all imported, then its question."""
    schema = doc_schema(f"c{idx}", case["docs"], system=SYSTEM)
    prompt = (f'<prompt schema="c{idx}">' + "".join(f"<doc{j}/>" for j in range(case["modules"])) +
              f" {escape(case.get('question') or question(case['name']))}</prompt>")
    return schema, prompt
