"""Short documents as modules or as new text: what a module costs against what its reuse saves, by length (issue 64).

For each document length (characters), four essay snippets of that length and a question go through the API's own
compilation (studio/api/modes.py) and the cached arm, greedy, 4 new tokens:

* first sight, marked (``cache_control``: modules at any length): the documents are encoded, then answered;
* the same documents reordered with another question, marked: their KV is read back;
* that reordered request as plain text (what a part under ``min_module_chars`` runs as).

TTFT is the API's (``pml.ttft_ms``): from the start of the work to the first token, layout and encoding included.
Per length: the TTFT that reuse saves (plain − reused), what the first sight costs over plain (first − plain), and
whether the reused answer is the plain one. Fresh snippets each repetition (each a first sight). JSON last.

    python bench/short_documents.py --model SmolLM2-135M-Instruct --lengths 64,128,256,512 --reps 2   # its result
    python bench/short_documents.py --reps 2 --lengths 128,256,512   # the engine's default model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, emit, essays_dir, machine, model_help, result_name, spread, table

from engine.arms.registry import Sampling
from engine.run.events import Done, FirstToken
from engine.session import Engine
from studio.api import modes
from studio.api.positions import PositionRegistry

DOCS = 4
QUESTIONS = ("Which note mentions a river?", "Which note is the longest?")


def snippets(length: int, count: int, skip: int) -> list[str]:
    """``count`` successive pieces of essay text of about ``length`` characters, cut between words, after ``skip``."""
    words = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(essays_dir().glob("*.txt"))[:3])
    words = words.split()[skip * count * (length // 4):]
    out, cur = [], []
    for w in words:
        cur.append(w)
        if len(" ".join(cur)) >= length:
            out.append(" ".join(cur)[:length])
            cur = []
            if len(out) == count:
                return out
    raise SystemExit("not enough essay text")


def request(eng: Engine, registry: PositionRegistry, docs: list[str], question: str, how: str) -> tuple[float, str]:
    """(TTFT ms from the start of the work, the answer) of one request compiled as the API compiles it."""
    parts = tuple(modes.Part(d, marked=True) for d in docs) + (modes.Part(question),)
    turns = [modes.Turn("system", (modes.Part("Answer from the notes."),)), modes.Turn("user", parts)]
    first: list[float] = []
    start = time.perf_counter()
    compiled = modes.chat_pml(turns, how, eng.codec, registry)
    for event in eng.events(compiled.schema, compiled.prompt, Sampling(max_new_tokens=4),
                            config=eng.config.with_(arms=("cached",), warmup=False)):
        if isinstance(event, FirstToken) and not first:
            first.append(time.perf_counter())
        elif isinstance(event, Done):
            res = event.comparison
    return (first[0] - start) * 1000, res.arm("cached").run.text


def measure(eng: Engine, length: int, reps: int) -> dict:
    registry = PositionRegistry()
    first, reused, plain, same = [], [], [], 0
    for rep in range(reps):
        docs = snippets(length, DOCS, skip=rep + 1)
        first.append(request(eng, registry, docs, QUESTIONS[0], "marked")[0])
        swapped = docs[::-1]
        ms, text = request(eng, registry, swapped, QUESTIONS[1], "marked")
        reused.append(ms)
        ms, plain_text = request(eng, registry, swapped, QUESTIONS[1], "plain")
        plain.append(ms)
        same += text == plain_text
    tokens = statistics.mean(len(eng.codec.encode(d)) for d in snippets(length, DOCS, skip=1))
    saved = [p - r for p, r in zip(plain, reused)]
    extra = [f - p for f, p in zip(first, plain)]
    return {"chars": length, "tokens_per_document": round(tokens, 1), "first_ms": spread(first),
            "reused_ms": spread(reused), "plain_ms": spread(plain), "saved_ms": spread(saved),
            "first_sight_extra_ms": spread(extra), "same_answer_as_plain": f"{same}/{reps}",
            "reuses_to_repay": round(statistics.median(extra) / statistics.median(saved), 2)
            if statistics.median(saved) > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=model_help(quick=False))
    ap.add_argument("--lengths", default="64,128,256,512,1024", help="document lengths in characters")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model = bench_model(args.model)
    eng = Engine(model=model.spec)
    eng.lm
    request(eng, PositionRegistry(), snippets(64, DOCS, skip=0), QUESTIONS[0], "plain")  # warm-up, discarded
    rows = [measure(eng, int(n), args.reps) for n in args.lengths.split(",")]
    print(table(["chars", "tokens/doc", "first ms", "reused ms", "plain ms", "saved ms", "reuses to repay", "same"],
                [[r["chars"], r["tokens_per_document"], r["first_ms"]["median"], r["reused_ms"]["median"],
                  r["plain_ms"]["median"], r["saved_ms"]["median"], r["reuses_to_repay"], r["same_answer_as_plain"]]
                 for r in rows]))
    emit(result_name("short-documents", model.spec), {"model": eng.lm.name, "machine": machine(),
                                                      "documents": DOCS, "rows": rows})


if __name__ == "__main__":
    main()
