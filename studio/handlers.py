"""The studio's handlers: plain functions and one :class:`Studio` object, testable without a server.

``app.py`` only wires these to Gradio components. Every handler takes and returns plain values
(text, HTML, table rows, dicts). Problems the user can fix come back in two ways: validation
handlers return them as ``line:col: message`` lines, action handlers (encode, compare, load a
model) raise :class:`gradio.Error` with the engine's message. The user's text is never touched
by a failing handler, and a comparison is written to the run log only after it has finished.

The prompt builder works on a *spec*: a JSON-able description of the schema's importable
structure (modules, unions, params) made by :func:`builder_spec`. Its widgets are keyed
``path`` (module checkbox), ``union id`` (radio) and ``path@param`` (argument text box);
:func:`compose_prompt` turns widget values into PML, :func:`selection_from_prompt` does the
reverse for hand-written prompts.
"""

from __future__ import annotations

import html
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from xml.sax.saxutils import escape

import gradio as gr

from engine.errors import EngineError, ModelError, PMLError
from engine.layout import ANONYMOUS, Layout
from engine.runlog import RunLog, RunLogError

log = logging.getLogger("pml-studio")

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_schemas"
NONE = "(none)"  # radio value for "no member of this union"; not a valid PML identifier
MB = 1_000_000
MIB = 2**20  # the module memory budget is set in MiB, like the CLI's --budget-mb
MODE_NOTE = ("**prefixed** (default): each module is encoded after the system text that precedes it, so cached "
             "outputs stay closer to the baseline, at no extra memory. **isolated**: the paper's scheme, each "
             "module encoded alone.")
DTYPE_CHOICES = [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16")]
METHOD_CHOICES = ["pyramid", "uniform", "recent"]
RETENTION_NOTE = ("**Retention** below 1 keeps that share of each module's keys and values (the system text is never "
                  "compressed): **pyramid** keeps the tokens the module's last tokens attend to most, fewer in deeper "
                  "layers (PyramidInfer); **uniform** the same share, by attention, in every layer; **recent** only "
                  "the last tokens. Storage precision and retention apply to Compare too.")
SOURCE_LABELS = {"memory": "memory", "disk": "disk", "encoded": "fresh encode"}
UNIT_HEADERS = ["unit", "kind", "tokens", "obtained from", "ms"]
HISTORY_HEADERS = ["id", "time (UTC)", "schema", "model", "storage · mode", "tokens (cached)", "TTFT baseline",
                   "TTFT cached", "speedup", "same text", "KL"]


# ----------------------------------------------------------------------------------------------
# Samples and files
# ----------------------------------------------------------------------------------------------

def sample_names() -> list[str]:
    """Every schema in sample_schemas/ (prompt files excluded), by file stem."""
    return sorted(p.stem for p in SAMPLES.glob("*.xml") if not p.name.endswith(".prompt.xml"))


def load_sample(name: str) -> tuple[str, str]:
    """(schema text, example prompt text) of a sample; the prompt is '' when it has none."""
    if name not in sample_names():
        raise gr.Error(f"no sample schema named '{name}'; pick one of {', '.join(sample_names())}")
    schema = (SAMPLES / f"{name}.xml").read_text(encoding="utf-8")
    prompt_file = SAMPLES / f"{name}.prompt.xml"
    return schema, prompt_file.read_text(encoding="utf-8") if prompt_file.exists() else ""


def read_upload(path: str | None) -> tuple[str, str]:
    """(kind, text) of an uploaded .xml file; kind is 'schema' or 'prompt'."""
    from engine.pml import document_kind

    if not path:
        raise gr.Error("no file was uploaded")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise gr.Error(f"{Path(path).name} is not UTF-8 text; save it as UTF-8 and upload it again") from None
    kind = document_kind(text)
    if kind is None:
        raise gr.Error(f"{Path(path).name} is neither a PML schema (<schema name=...>) nor a prompt "
                       "(<prompt schema=...>)")
    return kind, text


# ----------------------------------------------------------------------------------------------
# Import from Python (prompt programs)
# ----------------------------------------------------------------------------------------------

_PROGRAM_LOCK = threading.Lock()  # load_program_file imports the file and touches sys.path / sys.modules


@dataclass(frozen=True)
class ProgramImport:
    """The result of importing a prompt-program file: the schema of one root program and its example prompt."""

    ok: bool
    status: str  # HTML: what was imported, or the file's problems as line:col lines
    roots: tuple[str, ...] = ()
    program: str | None = None
    schema: str | None = None
    prompt: str | None = None  # the example call's prompt (None when the file has none for this program)


def import_program(path: str | None, program: str | None = None) -> ProgramImport:
    """Import the prompt programs of a .py file and compile ``program`` (default: the first root with an
    example call). Problems come back inline (``ok`` False), never as exceptions."""
    from engine.programs import load_program_file

    if not path:
        return _program_problem(["no file was uploaded"])
    p = Path(path)
    if p.suffix != ".py":
        return _program_problem([f"{p.name} is not a Python file; upload a .py file with @prompt_program functions"])
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return _program_problem([f"cannot read {p.name}: {err}"])
    with _PROGRAM_LOCK:
        try:
            pf = load_program_file(str(p))
            roots = tuple(pf.roots())
            if not roots:
                return _program_problem([f"{p.name} defines no @prompt_program function; decorate one with "
                                         "@prompt_program (from engine.programs)"])
            examples = [r for r in roots if pf.example(r) is not None]
            name = program if program in roots else (examples[0] if examples else roots[0])
            schema = pf.programs[name].schema_xml()
            call = pf.example(name)
            prompt = call.prompt_xml() if call is not None else None
        except EngineError as err:
            problems, _ = problem_lines(err, text)
            return _program_problem(problems)
        except Exception as err:  # compiling a program the engine did not anticipate: a message, not a traceback
            log.exception("importing %s failed", p)
            return _program_problem([f"cannot compile {p.name}: {type(err).__name__}: {err}"])
    what = ("its example call filled the prompt" if prompt is not None
            else "the file has no example call for it (e.g. EXAMPLE = program.bind(...)); build the prompt in the "
                 "Prompt tab")
    others = f" · other programs: {', '.join(r for r in roots if r != name)}" if len(roots) > 1 else ""
    status = (f'<div class="pml-status ok">✓ imported <b>{html.escape(name)}</b> from {html.escape(p.name)}: '
              f"the compiled schema is in the editor; {html.escape(what)}{html.escape(others)}</div>")
    return ProgramImport(True, status, roots, name, schema, prompt)


def _program_problem(problems: list[str]) -> ProgramImport:
    items = "".join(f"<li><code>{html.escape(p)}</code></li>" for p in problems)
    return ProgramImport(False, f'<div class="pml-status err"><b>cannot import the program</b><ul>{items}</ul></div>')


def empty_prompt(schema_name: str) -> str:
    return f'<prompt schema="{escape(schema_name, {chr(34): "&quot;"})}">\n</prompt>\n'


# ----------------------------------------------------------------------------------------------
# Validation and layout view
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Validation:
    """What the schema editor shows for one version of the schema text."""

    ok: bool
    name: str  # schema name ('' when it cannot be parsed)
    problems: tuple[str, ...]  # "line:col: message; hint: ..." lines
    lines: tuple[int, ...]  # offending line numbers (highlighted)
    rows: tuple[tuple, ...]  # layout table rows
    positions: int
    spec: dict | None = field(default=None, repr=False)

    def status_html(self) -> str:
        if self.ok:
            mods = len(self.rows)
            return (f'<div class="pml-status ok">✓ schema <b>{html.escape(self.name)}</b> is valid: {mods} modules, '
                    f"{self.positions} positions</div>")
        items = "".join(f"<li><code>{html.escape(p)}</code></li>" for p in self.problems)
        return f'<div class="pml-status err"><b>{len(self.problems)} problem(s)</b><ul>{items}</ul></div>'


LAYOUT_HEADERS = ["module", "positions", "tokens", "params", "cached"]


def problem_lines(err: EngineError, text: str) -> tuple[list[str], list[int]]:
    """(``line:col: message`` lines, line numbers) of an engine error, with the offending source line."""
    src = text.splitlines()
    out: list[str] = []
    lines: list[int] = []
    problems = err.problems if isinstance(err, PMLError) else []
    for p in problems:
        msg = f"{p.line}:{p.col}: {p.message}" + (f"; hint: {p.hint}" if p.hint else "")
        if 1 <= p.line <= len(src):
            msg += f"\n    {p.line} | {src[p.line - 1].strip()}"
        out.append(msg)
        lines.append(p.line)
    if not problems:
        msg = str(err)
        for prefix in ("<schema>:", "<prompt>:"):
            msg = msg[len(prefix):] if msg.startswith(prefix) else msg
        out.append(msg.replace(": error: ", ": ", 1))
    return out, lines


def highlight_html(text: str, lines: list[int] | tuple[int, ...] = ()) -> str:
    """Read-only pygments rendering of a PML document, ``lines`` highlighted as errors."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import XmlLexer

    fmt = HtmlFormatter(noclasses=True, style=_error_style(), hl_lines=list(lines), linenos="inline",
                        cssclass="pml-highlight")
    return f'<div class="pml-code">{highlight(text or " ", XmlLexer(), fmt)}</div>'


def _error_style():
    from pygments.styles.default import DefaultStyle

    class ErrorLineStyle(DefaultStyle):
        highlight_color = "#fde2e1"
        line_number_color = "#9aa3af"
        line_number_background_color = "transparent"

    return ErrorLineStyle


def builder_spec(lay: Layout) -> dict:
    """JSON-able description of what a prompt can import from ``lay`` (see the module docstring)."""
    from engine.pml import Param

    defaults = {(path, c.name): c.default for path, mod in lay.schema.modules() for c in mod.children
                if isinstance(c, Param)}
    modules = {}
    for path, m in lay.modules.items():
        modules[path] = {"name": m.name, "parent": m.parent, "union": m.union,
                         "params": [{"name": p.name, "len": p.length,
                                     "default": defaults.get((path, p.name)) if p.has_default else None}
                                    for p in m.params]}
    unions = {uid: {"parent": u.parent, "members": list(u.members)} for uid, u in lay.unions.items()}

    def node_of_module(path: str) -> dict:
        m = lay.modules[path]
        kids = [(lay.modules[c].start, node_of_module(c)) for c in m.children]
        kids += [(lay.unions[u].start, node_of_union(u)) for u in m.unions]
        return {"kind": "module", "key": path, "children": [n for _, n in sorted(kids, key=lambda t: t[0])]}

    def node_of_union(uid: str) -> dict:
        return {"kind": "union", "key": uid, "children": [node_of_module(p) for p in lay.unions[uid].members]}

    top = [(m.start, node_of_module(p)) for p, m in lay.modules.items() if m.parent == ANONYMOUS and not m.union]
    top += [(u.start, node_of_union(uid)) for uid, u in lay.unions.items() if u.parent == ANONYMOUS]
    return {"schema": lay.name, "modules": modules, "unions": unions,
            "tree": [n for _, n in sorted(top, key=lambda t: t[0])]}


def widgets(spec: dict) -> list[dict]:
    """The builder's widgets in display order: {type, key, depth, label, ...}."""
    out: list[dict] = []

    def module(node: dict, depth: int, as_member: bool) -> None:
        path = node["key"]
        info = spec["modules"][path]
        if not as_member:
            out.append({"type": "module", "key": path, "depth": depth, "label": info["name"]})
        inner = depth + 1
        if as_member and (info["params"] or node["children"]):
            out.append({"type": "heading", "key": f"{path}#heading", "depth": depth, "label": info["name"]})
        for p in info["params"]:
            out.append({"type": "param", "key": f"{path}@{p['name']}", "depth": inner, "label": p["name"],
                        "len": p["len"], "default": p["default"], "module": path})
        for child in node["children"]:
            visit(child, inner)

    def visit(node: dict, depth: int) -> None:
        if node["kind"] == "module":
            module(node, depth, as_member=False)
        else:
            members = node["children"]
            names = [spec["modules"][m["key"]]["name"] for m in members]
            out.append({"type": "union", "key": node["key"], "depth": depth, "label": "one of: " + ", ".join(names),
                        "choices": [("none", NONE)] + [(n, m["key"]) for n, m in zip(names, members)]})
            for m in members:
                module(m, depth + 1, as_member=True)

    for node in spec["tree"]:
        visit(node, 0)
    return out


# ----------------------------------------------------------------------------------------------
# Prompt builder: widget values <-> PML prompt text
# ----------------------------------------------------------------------------------------------

def imported_modules(spec: dict, values: dict) -> list[str]:
    """Module paths the widget values import (a module counts only when its parents are imported)."""
    out = []
    for path, info in spec["modules"].items():
        chain_ok = True
        p = path
        while p:
            inf = spec["modules"][p]
            picked = values.get(inf["union"]) == p if inf["union"] else bool(values.get(p))
            if not picked:
                chain_ok = False
                break
            p = inf["parent"]
        if chain_ok:
            out.append(path)
    return out


def normalise(spec: dict, values: dict, trigger: str | None = None) -> dict:
    """Make the selection consistent after widget ``trigger`` changed.

    Deselecting a module (or switching a union away from a member) clears what was picked inside
    it; picking a nested module picks its parents.
    """
    values = dict(values)

    def clear_inside(path: str) -> None:
        for key in list(values):
            if (key.startswith(path + "/") or key.startswith(path + "#")) and "@" not in key:
                values[key] = NONE if key in spec["unions"] else False

    if trigger in spec["modules"] and not values.get(trigger):
        clear_inside(trigger)
    if trigger in spec["unions"]:
        for member in spec["unions"][trigger]["members"]:
            if values.get(trigger) != member:
                clear_inside(member)
    picked = [k for k, v in values.items() if (k in spec["modules"] and v) or (k in spec["unions"] and v != NONE)]
    for key in picked:
        path = values[key] if key in spec["unions"] else key
        parent = spec["modules"].get(path, {}).get("parent") if path in spec["modules"] else None
        while parent:
            info = spec["modules"][parent]
            if info["union"]:
                values[info["union"]] = parent
            else:
                values[parent] = True
            parent = info["parent"]
    return values


def compose_prompt(spec: dict, values: dict, free_text: str) -> str:
    """The PML prompt for the builder's state."""
    chosen = set(imported_modules(spec, values))

    def element(path: str) -> str:
        info = spec["modules"][path]
        attrs = ""
        for p in info["params"]:
            value = (values.get(f"{path}@{p['name']}") or "").strip()
            if value:
                attrs += f' {p["name"]}="{escape(value, {chr(34): "&quot;"})}"'
        inner = "".join(element(c) for c in _child_paths(spec, path) if c in chosen)
        return f"<{info['name']}{attrs}>{inner}</{info['name']}>" if inner else f"<{info['name']}{attrs}/>"

    lines = [f'<prompt schema="{spec["schema"]}">']
    for path, info in spec["modules"].items():
        if not info["parent"] and path in chosen:
            lines.append("  " + element(path))
    text = (free_text or "").strip()
    if text:
        safe = text.replace("&", "&amp;").replace("<", "&lt;")  # '>' is legal in XML text and reads better
        lines += ["  " + line if line.strip() else "" for line in safe.splitlines()]
    lines.append("</prompt>")
    return "\n".join(lines) + "\n"


def _child_paths(spec: dict, path: str) -> list[str]:
    return [p for p, info in spec["modules"].items() if info["parent"] == path]


def selection_from_prompt(spec: dict, prompt_text: str) -> tuple[dict, str] | None:
    """(widget values, free text) that reproduce a hand-written prompt, or None when it cannot be read."""
    from engine.pml import Import, NewText, parse_prompt

    try:
        prompt = parse_prompt(prompt_text)
    except EngineError:
        return None
    if prompt.schema != spec["schema"]:
        return None
    values: dict = {w["key"]: (NONE if w["type"] == "union" else "" if w["type"] == "param" else False)
                    for w in widgets(spec) if w["type"] != "heading"}
    texts: list[str] = []

    def names_under(parent: str) -> dict[str, str]:
        return {info["name"]: p for p, info in spec["modules"].items() if info["parent"] == parent}

    def take(item: Import, parent: str) -> bool:
        path = names_under(parent).get(item.name)
        if path is None:
            return False
        info = spec["modules"][path]
        if info["union"]:
            values[info["union"]] = path
        else:
            values[path] = True
        known = {p["name"] for p in info["params"]}
        for k, v in item.args:
            if k not in known:
                return False
            values[f"{path}@{k}"] = v
        return all(take(child, path) for child in item.children)

    for item in prompt.items:
        if isinstance(item, Import):
            if not take(item, ANONYMOUS):
                return None
        elif isinstance(item, NewText) and item.text.strip():
            texts.append(item.text.strip())
    return values, "\n\n".join(texts)


def param_info(codec, value: str, length: int, default: str | None) -> str:
    """Live token count of an argument against its param's budget."""
    value = (value or "").strip()
    if not value:
        return f"empty: uses the default “{default}”" if default is not None else f"required · up to {length} tokens"
    n = len(codec.encode(value))
    return f"{n} / {length} tokens" + (" — too long, shorten it" if n > length else "")


# ----------------------------------------------------------------------------------------------
# Token view
# ----------------------------------------------------------------------------------------------

TOKEN_CLASSES = {  # (kind, source) -> css class, legend label
    ("cached", "module"): ("tok-cached", "cached module"),
    ("cached", "anonymous"): ("tok-anon", "cached system / template text"),
    ("uncached", "argument"): ("tok-arg", "argument (prefilled at its param's positions)"),
    ("uncached", "text"): ("tok-new", "new text (prefilled)"),
    ("uncached", "template"): ("tok-tmpl", "template tokens (prefilled)"),
    ("uncached", "anonymous"): ("tok-tmpl", "template tokens (prefilled)"),
    ("uncached", "module"): ("tok-new", "new text (prefilled)"),
}


def token_view_html(plan, decode: Callable[[int], str]) -> str:
    """The prompt as coloured tokens: cached, new text, arguments, template; hover shows owner and position."""
    legend = {}
    spans = []
    for seg in plan.segments:
        cls, label = TOKEN_CLASSES.get((seg.kind, seg.source), ("tok-new", seg.source))
        legend[cls] = label
        owner = seg.owner or ("prompt text" if seg.source in ("text", "argument") else "system / template")
        for tid, pos in zip(seg.token_ids, seg.positions or (None,) * len(seg.token_ids)):
            piece = decode(tid)
            shown = html.escape(piece).replace("\n", "↵\n")
            title = html.escape(f"{owner} · {seg.kind} · position {pos} · id {tid}")
            spans.append(f'<span class="tok {cls}" title="{title}">{shown}</span>')
    keys = "".join(f'<span class="tok {c}">{html.escape(lbl)}</span>' for c, lbl in legend.items())
    stats = (f"{plan.prompt_tokens} tokens · {plan.cached_tokens} cached · {plan.uncached_tokens} prefilled "
             f"({100 * plan.uncached_tokens / max(plan.prompt_tokens, 1):.0f} %)")
    return (f'<div class="pml-tokens"><div class="tok-legend">{keys}<span class="tok-stats">{stats}</span></div>'
            f'<div class="tok-body">{"".join(spans)}</div></div>')


# ----------------------------------------------------------------------------------------------
# Encode view
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EncodeView:
    """What the encode panel shows after encoding."""

    summary: str  # cards + one line on where the units came from (HTML)
    entries: list[list]  # store entry, tokens, MB, KB / token
    units: list[list]  # UNIT_HEADERS rows
    memory: str  # store readouts before / after (HTML)
    counts: dict  # units by source: memory, disk, encoded
    nbytes: dict = field(default_factory=dict)  # store entry -> bytes (exact; the table rounds)


MEMORY_ROWS = [("module memory", "bytes"), ("entries", "entries"), ("budget", "budget_bytes"), ("pinned", "pinned"),
               ("evictions", "evictions"), ("disk loads", "disk_loads"), ("disk writes", "disk_writes"),
               ("disk write errors", "disk_write_errors"), ("corrupted files", "disk_corrupt")]


def memory_html(before: dict, after: dict) -> str:
    """The module store's readouts before and after an action, changed values marked."""
    def fmt(key: str, value) -> str:
        if key in ("bytes", "budget_bytes"):
            return "none" if value is None else f"{value / MIB:,.1f} MiB"
        return f"{value:,}" if isinstance(value, int) else html.escape(str(value))

    rows = []
    for label, key in MEMORY_ROWS:
        b, a = before.get(key), after.get(key)
        cls = ' class="changed"' if a != b else ""
        rows.append(f"<tr{cls}><th>{label}</th><td>{fmt(key, b)}</td><td>{fmt(key, a)}</td></tr>")
    note = ""
    if after.get("disk_error"):
        note = f'<div class="pml-status err">{html.escape(after["disk_error"])}</div>'
    where = "GPU" if str(after.get("device", "")).startswith("cuda") else "CPU"
    return (f'<table class="pml-memory"><thead><tr><th>{where} module store</th><th>before</th><th>after</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table>{note}')


# ----------------------------------------------------------------------------------------------
# Compare view
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompareUpdate:
    """One step of a streaming comparison."""

    phase: str  # "encoding" | "baseline" | "cached" | "done"
    baseline_text: str
    cached_text: str
    message: str = ""
    result: dict | None = None  # the `run --json` document, on "done"
    run_id: int | None = None
    comparison: object = field(default=None, repr=False)


def column_html(text: str, active: bool, marker: int | None = None) -> str:
    """A generated-text column; text from ``marker`` (a character offset) on is marked as divergent."""
    if marker is not None and 0 <= marker <= len(text):
        body = html.escape(text[:marker]) + f'<mark class="diverge">{html.escape(text[marker:]) or "∅"}</mark>'
    else:
        body = html.escape(text)
    cursor = '<span class="caret"></span>' if active else ""
    return f'<div class="pml-output{" active" if active else ""}">{body or "&nbsp;"}{cursor}</div>'


def metrics_html(run: dict | None, cached: bool) -> str:
    if not run:
        return '<div class="pml-metrics empty">TTFT, decode speed and memory appear here after a run.</div>'
    rows = [("TTFT", f"{run['ttft_ms']:.1f} ms"),
            ("prefill", f"{run['prefill_tokens']} tokens in {run['prefill_ms']:.1f} ms")]
    if cached:
        rows.append(("KV copy (in TTFT)", f"{run['copy_ms']:.1f} ms"))
    dec = run.get("decode_ms_per_token")
    rows += [("decode", "–" if dec is None else f"{dec:.1f} ms/token"),
             ("new tokens", str(run["new_tokens"])),
             ("peak memory", f"{run['peak_rss_bytes'] / MB:,.0f} MB RSS"
              + (f" · {run['cuda_peak_bytes'] / MB:,.0f} MB GPU" if run.get("cuda_peak_bytes") else ""))]
    cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="pml-metrics">{cells}</table>'


def summary_html(result: dict | None, message: str = "") -> str:
    if not result:
        text = html.escape(message) if message else "Press <b>Compare</b> to run baseline and cached on the prompt."
        return f'<div class="pml-summary idle">{text}</div>'
    same = result["same_text"]
    div = result["first_divergence"]
    verdict = ('<span class="badge good">same text</span>' if same
               else f'<span class="badge warn">diverges at token {div}</span>')
    agree = ('<span class="badge good">first token agrees</span>' if result["first_token_agree"]
             else '<span class="badge warn">first token differs</span>')
    return (f'<div class="pml-summary"><div class="speedup"><span class="big">{result["speedup"]:.1f}×</span>'
            f'<span class="sub">faster first token</span></div>'
            f'<div class="facts">{verdict}{agree}<span class="badge">first-token KL {result["first_token_kl"]:.4f}</span>'
            f'<span class="badge">{result["cached_tokens"]} of {result["prompt_tokens"]} prompt tokens cached</span>'
            f'<span class="badge">{result["storage"]} · {result["mode"]}</span>{_memory_badges(result)}</div></div>')


def _memory_badges(result: dict) -> str:
    """Storage precision, retention and how the schema's units were obtained, as badges."""
    comp = result.get("compression") or {}
    kept = comp.get("retention")
    extra = "" if kept is None or kept >= 1.0 else f' · {_retention_text(kept, comp.get("method"))} kept'
    out = f'<span class="badge">{_short_dtype(result.get("storage_dtype"))} storage{extra}</span>'
    enc = result.get("encode")
    if enc:
        out += (f'<span class="badge">units: {enc.get("memory", 0)} memory · {enc.get("disk", 0)} disk · '
                f'{enc.get("encoded", 0)} encoded</span>')
    return out


# ----------------------------------------------------------------------------------------------
# The studio: engine + run log + the handlers that need them
# ----------------------------------------------------------------------------------------------

class Studio:
    """Holds the engine (replaced when another model is loaded) and the run log."""

    def __init__(self, engine, runlog: RunLog):
        self.engine = engine
        self.runlog = runlog
        self._tokenizer = None
        self._lock = threading.Lock()
        self._layouts: dict[tuple[int, str], Layout] = {}

    # -- schema editor ----------------------------------------------------------------------------

    def validate(self, schema_text: str) -> Validation:
        """Parse and lay out the schema; problems come back as lines, never as exceptions."""
        try:
            lay = self.layout(schema_text)
        except EngineError as err:
            problems, lines = problem_lines(err, schema_text or "")
            return Validation(False, "", tuple(problems), tuple(lines), (), 0)
        rows = tuple((r["module"] + (" (union member)" if r["union"] else ""), f"{r['start']}–{r['end']}",
                      r["tokens"], r["params"], "yes" if r["cache"] else "no (cache=false)") for r in lay.rows())
        return Validation(True, lay.name, (), (), rows, lay.length, builder_spec(lay))

    def layout(self, schema_text: str) -> Layout:
        key = (id(self.engine), schema_text)
        lay = self._layouts.get(key)
        if lay is None:
            if not (schema_text or "").strip():
                raise EngineError("1:1: the schema is empty; pick a sample or write <schema name=\"...\">")
            lay = self.engine.layout(schema_text)
            if len(self._layouts) > 32:
                self._layouts.clear()
            self._layouts[key] = lay
        return lay

    # -- prompt -----------------------------------------------------------------------------------

    def preview(self, schema_text: str, prompt_text: str) -> tuple[str, str]:
        """(status HTML, token view HTML) of the prompt against the schema."""
        try:
            lay = self.layout(schema_text)
        except EngineError:
            return ('<div class="pml-status err">Fix the schema first (see the Schema tab).</div>', "")
        try:
            plan = self.engine.plan(lay, prompt_text or "")
        except EngineError as err:
            problems, _ = problem_lines(err, prompt_text or "")
            items = "".join(f"<li><code>{html.escape(p)}</code></li>" for p in problems)
            return f'<div class="pml-status err"><b>prompt problem(s)</b><ul>{items}</ul></div>', ""
        status = (f'<div class="pml-status ok">✓ prompt is valid: {plan.prompt_tokens} tokens, '
                  f"{plan.cached_tokens} cached, {plan.uncached_tokens} prefilled</div>")
        return status, token_view_html(plan, self.decode_token)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @property
    def tokenizer(self):
        """The model's tokenizer, without loading the weights when they are not loaded yet."""
        if self.engine.loaded:
            return self.engine.lm.tokenizer
        if self._tokenizer is None:
            from engine.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.engine.config.model)[1]
        return self._tokenizer

    def divergence_offsets(self, comparison) -> tuple[int | None, int | None]:
        """Character offsets in the (baseline, cached) texts where the first divergent token starts."""
        k = comparison.first_divergence
        if k is None:
            return None, None

        def chars(run) -> int:
            prefix = self.tokenizer.decode(list(run.token_ids[:k]), skip_special_tokens=True)
            return len(prefix) if run.text.startswith(prefix) else min(len(prefix), len(run.text))

        return chars(comparison.baseline), chars(comparison.cached)

    def param_info(self, value: str, length: int, default: str | None) -> str:
        return param_info(self.engine.codec, value, length, default)

    # -- encode ---------------------------------------------------------------------------------

    def memory_defaults(self, storage: str | None = None) -> dict:
        """What the encode panel starts with: the store's budget (MiB) and the persistence settings."""
        try:
            budget = self.engine.store(storage or self.engine.config.storage).budget_bytes
        except EngineError:  # e.g. GPU storage without a GPU: no store, no budget
            budget = None
        return {"budget_mib": None if budget is None else round(budget / MIB, 1), "persist": self.engine.config.persist,
                "module_dir": str(self.engine.config.modules_path)}

    def persistence_html(self) -> str:
        d = self.memory_defaults()
        if d["persist"]:
            state = ('<span class="badge good">persistence on</span> encoded modules are saved under '
                     f'<code>{html.escape(d["module_dir"])}</code> and reloaded after a restart')
        else:
            state = ('<span class="badge">persistence off</span> encoded modules live in memory only '
                     "(start without --no-persist to keep them on disk)")
        return f'<div class="pml-persist">{state}</div>'

    def apply_budget(self, storage: str, budget_mib) -> int | None:
        """Set the module memory budget of ``storage``'s store (MiB; empty keeps it); raises gr.Error."""
        mib = None
        if budget_mib not in (None, ""):
            try:
                mib = float(budget_mib)
            except (TypeError, ValueError):
                raise gr.Error(f"the module memory budget must be a number of MiB, got '{budget_mib}'") from None
            if not mib > 0:
                raise gr.Error("the module memory budget must be more than 0 MiB")
        try:
            store = self.engine.store(storage)
        except EngineError as err:
            raise gr.Error(str(err)) from None
        if mib is not None:
            store.set_budget(int(mib * MIB))
        return store.budget_bytes

    def encode(self, schema_text: str, storage: str, mode: str,
               progress: Callable[[int, int, str], None] | None = None, storage_dtype: str = "float32",
               retention: float = 1.0, method: str = "pyramid", budget_mib=None) -> "EncodeView":
        """Encode the schema's modules with the encode panel's settings; raises gr.Error."""
        compression = _compression(retention, method)
        storage_dtype = _storage_dtype(storage_dtype)
        self.apply_budget(storage, budget_mib)
        try:
            lay = self.layout(schema_text)
            store = self.engine.store(storage)
            before = store.stats()
            cfg = self.engine.config.with_(mode=mode, storage=storage, storage_dtype=storage_dtype,
                                           compression=compression)
            res = self.engine.encode(lay, cfg, progress)
        except EngineError as err:
            raise gr.Error(str(err)) from None
        except Exception as err:  # a torch failure (out of memory...) must not reach the user as a traceback
            log.exception("encode failed")
            raise gr.Error(f"encoding failed: {type(err).__name__}: {err}") from None
        after = store.stats()
        tokens = _tokens_by_entry(lay)
        rows = []
        total_tokens = 0
        for name, nbytes in res.bytes_by_module.items():
            n = tokens.get(name, 0)
            total_tokens += n
            rows.append([name, n, round(nbytes / MB, 3), round(nbytes / n / 1000, 1) if n else None])
        units = res.encoded.units
        unit_rows = [[u.name, u.kind, u.tokens, SOURCE_LABELS.get(u.source, u.source), round(u.ms, 1)] for u in units]
        counts = {src: sum(u.source == src for u in units) for src in SOURCE_LABELS}
        per_token = res.store_bytes / total_tokens / MB if total_tokens else 0.0
        if res.reused and counts["disk"] == 0:
            state = ("Already encoded for this schema, model, mode and storage settings: nothing was recomputed "
                     f"({len(units)} unit(s) in memory).")
        else:
            state = (f"{counts['encoded']} unit(s) encoded afresh, {counts['disk']} loaded from disk, "
                     f"{counts['memory']} already in memory.")
        cards = [("schema store", f"{res.store_bytes / MIB:,.1f} MiB"), ("tokens stored", f"{total_tokens:,}"),
                 ("per token", f"{per_token:.4f} MB"), ("encode time", f"{res.encoded.encode_ms / 1000:.2f} s"),
                 ("storage", f"{res.encoded.device} · {_short_dtype(res.encoded.dtype)}"),
                 ("retention", _retention_text(compression.retention, compression.method))]
        html_cards = "".join(f'<div class="card"><span class="k">{k}</span><span class="v">{v}</span></div>'
                             for k, v in cards)
        summary = f'<div class="pml-cards">{html_cards}</div><div class="pml-note">{state}</div>'
        return EncodeView(summary, rows, unit_rows, memory_html(before, after), counts, dict(res.bytes_by_module))

    # -- compare ----------------------------------------------------------------------------------

    def compare_stream(self, schema_text: str, prompt_text: str, storage: str, mode: str, max_new_tokens: int,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, storage_dtype: str = "float32",
                       retention: float = 1.0, method: str = "pyramid", budget_mib=None) -> Iterator[CompareUpdate]:
        """Run baseline then cached in a worker thread, yielding the text of both as it grows.

        The last update (phase "done") carries the `run --json` document and the run-log id. A failure
        raises gr.Error with the engine's message and writes nothing to the run log.
        """
        from engine.runner import Sampling

        sampling = _sampling(max_new_tokens, temperature, top_p, seed)
        compression = _compression(retention, method)
        storage_dtype = _storage_dtype(storage_dtype)
        self.apply_budget(storage, budget_mib)
        engine = self.engine
        events: queue.Queue = queue.Queue()

        def work() -> None:
            try:
                cfg = engine.config.with_(mode=mode, storage=storage, storage_dtype=storage_dtype,
                                          compression=compression)
                res = engine.compare(schema_text, prompt_text, sampling, config=cfg,
                                     on_token=lambda path, text: events.put(("token", path, text)),
                                     progress=lambda done, total, label: events.put(("encode", done, total, label)))
                events.put(("done", res))
            except BaseException as err:  # handed to the generator, which translates it
                events.put(("error", err))

        assert isinstance(sampling, Sampling)
        threading.Thread(target=work, name="pml-compare", daemon=True).start()
        texts = {"baseline": "", "cached": ""}
        phase = "encoding"
        yield CompareUpdate(phase, "", "", "Preparing the run…")
        while True:
            kind, *payload = events.get()
            if kind == "encode":
                done, total, label = payload
                yield CompareUpdate("encoding", "", "", f"Encoding modules {done}/{total}: {label}")
            elif kind == "token":
                path, text = payload
                texts[path] = text
                phase = path
                yield CompareUpdate(phase, texts["baseline"], texts["cached"],
                                    "Baseline: full prefill, then decoding…" if path == "baseline"
                                    else "Cached: reusing module KV, prefilling the rest…")
            elif kind == "error":
                raise _user_error(payload[0])
            else:
                res = payload[0]
                data = res.to_json()
                run_id = self._record(data, schema_text, prompt_text)
                yield CompareUpdate("done", res.baseline.text, res.cached.text, "", data, run_id, res)
                return

    def compare_json(self, schema_text: str, prompt_text: str, max_new_tokens: int = 32, storage: str = "cpu",
                     mode: str = "prefixed", temperature: float = 0.0, storage_dtype: str = "float32",
                     retention: float = 1.0, method: str = "pyramid") -> dict:
        """One comparison, recorded in the run log; returns the `pml-studio run --json` document."""
        sampling = _sampling(max_new_tokens, temperature)
        compression = _compression(retention, method)
        storage_dtype = _storage_dtype(storage_dtype)
        try:
            cfg = self.engine.config.with_(mode=mode, storage=storage, storage_dtype=storage_dtype,
                                           compression=compression)
            res = self.engine.compare(schema_text, prompt_text, sampling, config=cfg)
        except BaseException as err:
            raise _user_error(err) from None
        data = res.to_json()
        self._record(data, schema_text, prompt_text)
        return data

    def _record(self, data: dict, schema_text: str, prompt_text: str) -> int | None:
        try:
            return self.runlog.record(data, schema_text, prompt_text)
        except RunLogError as err:
            gr.Warning(str(err))
            return None

    # -- history ----------------------------------------------------------------------------------

    def history(self, schema: str | None = None) -> list[list]:
        """Rows of the history table, newest first."""
        rows = []
        for r in self.runlog.runs(schema=_filter(schema), limit=500):
            rows.append([r["id"], (r["created_at"] or "").replace("T", " ").replace("+00:00", ""), r["schema_name"],
                         r["model"], _storage_cell(r), f"{r['prompt_tokens']} ({r['cached_tokens']})",
                         f"{r['baseline_ttft_ms']:.0f} ms", f"{r['cached_ttft_ms']:.0f} ms", f"{r['speedup']:.1f}×",
                         "yes" if r["same_text"] else f"no (token {r['first_divergence']})",
                         f"{r['first_token_kl']:.4f}"])
        return rows

    def history_plot(self, schema: str | None = None):
        """Long-format table for the TTFT plot: one point per run and path."""
        import pandas as pd

        points = []
        for r in self.runlog.runs(schema=_filter(schema), limit=500):
            points.append({"prompt tokens": r["prompt_tokens"], "TTFT ms": r["baseline_ttft_ms"], "path": "baseline",
                           "run": r["id"], "schema": r["schema_name"]})
            points.append({"prompt tokens": r["prompt_tokens"], "TTFT ms": r["cached_ttft_ms"], "path": "cached",
                           "run": r["id"], "schema": r["schema_name"]})
        return pd.DataFrame(points, columns=["prompt tokens", "TTFT ms", "path", "run", "schema"])

    def history_schemas(self) -> list[str]:
        return ["all"] + self.runlog.schemas()

    def open_run(self, run_id) -> dict:
        """The stored run (schema text, prompt, settings) to load into the editors."""
        text = str(run_id if run_id is not None else "").strip()
        if not text:
            raise gr.Error("select a run in the table first")
        if not text.isdigit():
            raise gr.Error(f"'{text}' is not a run id; click a row in the table")
        row = self.runlog.get(int(text))
        if row is None:
            raise gr.Error(f"there is no run {int(run_id)} in {self.runlog.path}")
        return row

    def export_csv(self, schema: str | None, folder: str | Path) -> str:
        path = Path(folder) / ("pml-runs.csv" if not _filter(schema) else f"pml-runs-{schema}.csv")
        return self.runlog.export_csv(path, schema=_filter(schema))

    # -- model ------------------------------------------------------------------------------------

    def model_html(self) -> str:
        """The model panel as an HTML key/value table."""
        cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in self.model_info())
        return f'<table class="pml-kv">{cells}</table>'

    def model_info(self) -> list[list]:
        """Key/value rows of the model panel (the model is not loaded by this call)."""
        from engine.session import gpu_status

        ok, why = gpu_status()
        rows = [["model", self.engine.config.model or "SmolLM2-135M-Instruct (default)"],
                ["status", "loaded" if self.engine.loaded else "not loaded yet (loads on first encode or compare)"]]
        if self.engine.loaded:
            info = self.engine.info()
            rows += [["name", info["model"]], ["device", info["device"]], ["dtype", info["dtype"]],
                     ["parameters", f"{info['parameters']:,}"],
                     ["layers · KV heads · head dim", f"{info['layers']} · {info['kv_heads']} · {info['head_dim']}"],
                     ["KV bytes per token", f"{info['kv_bytes_per_token']:,}"],
                     ["context", f"{info['max_positions']:,} positions"]]
        rows += [["GPU storage", why if ok else "unavailable: " + gpu_explanation(why)],
                 ["run log", str(self.runlog.path)]]
        return rows

    def load_model(self, folder: str | None) -> list[list]:
        """Load the current model (folder empty) or another local model folder; raises gr.Error."""
        from engine.session import Engine

        with self._lock:
            if folder and folder.strip():
                path = Path(folder.strip()).expanduser()
                if not path.is_dir():
                    raise gr.Error(f"{path} is not a folder; give the path of a local transformers model folder "
                                   "(config.json, weights and tokenizer files)")
                try:
                    eng = Engine(self.engine.config.with_(model=str(path.resolve())))
                    eng.lm
                except EngineError as err:
                    raise gr.Error(str(err)) from None
                except Exception as err:
                    log.exception("model load failed")
                    raise gr.Error(f"cannot load {path}: {type(err).__name__}: {err}") from None
                self.engine = eng
                self._tokenizer = None
                self._layouts.clear()
            else:
                try:
                    self.engine.lm
                except EngineError as err:
                    raise gr.Error(str(err)) from None
        return self.model_info()

    def status_html(self) -> str:
        name = self.engine.lm.name if self.engine.loaded else (self.engine.config.model or "SmolLM2-135M-Instruct")
        state = "loaded" if self.engine.loaded else "loads on first run"
        path = str(self.runlog.path)
        short = path if len(path) <= 30 else "…" + path[-29:]
        return (f'<div class="pml-chips"><span class="chip"><b>model</b> {html.escape(str(name))} · {state}</span>'
                f'<span class="chip" title="{html.escape(path)}"><b>run log</b> {html.escape(short)}</span></div>')


def gpu_explanation(why: str) -> str:
    """gpu_status()'s explanation without the CLI's flag advice."""
    return why.replace("; use --storage cpu", "")


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

def _sampling(max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
    from engine.runner import Sampling

    try:
        n = int(max_new_tokens)
        t = float(temperature or 0.0)
    except (TypeError, ValueError):
        raise gr.Error("max new tokens must be a whole number and temperature a number") from None
    if n < 1:
        raise gr.Error("max new tokens must be at least 1")
    if t < 0:
        raise gr.Error("temperature must be 0 (greedy) or more")
    return Sampling(max_new_tokens=n, temperature=t, top_p=float(top_p), seed=int(seed))


def _user_error(err: BaseException) -> gr.Error:
    if isinstance(err, gr.Error):
        return err
    if isinstance(err, PMLError):
        return gr.Error("\n".join(str(p).replace("<schema>:", "schema ").replace("<prompt>:", "prompt ")
                                  for p in err.problems))
    if isinstance(err, EngineError):
        return gr.Error(str(err).replace("<schema>:", "schema ").replace("<prompt>:", "prompt "))
    log.error("run failed", exc_info=err)
    return gr.Error(f"the run failed: {type(err).__name__}: {err}")


def _compression(retention, method):
    from engine.compress import Compression

    try:
        return Compression(float(1.0 if retention in (None, "") else retention), method or "pyramid")
    except (TypeError, ValueError):
        raise gr.Error(f"retention must be a number in (0, 1], got '{retention}'") from None
    except EngineError as err:
        raise gr.Error(str(err)) from None


def _storage_dtype(value: str | None) -> str:
    from engine.config import STORAGE_DTYPES as DTYPES

    value = value or "float32"
    if value not in DTYPES:
        raise gr.Error(f"unknown storage dtype '{value}'; use one of {', '.join(DTYPES)}")
    return value


def _short_dtype(dtype: str | None) -> str:
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype or "float32", dtype or "fp32")


def _retention_text(retention, method) -> str:
    r = 1.0 if retention is None else float(retention)
    return "100 % (full)" if r >= 1.0 else f"{r:.0%} {method or 'pyramid'}".replace("%", " %")


def _storage_cell(r: dict) -> str:
    """'cpu · prefixed', plus the storage precision and retention when they are not the defaults."""
    out = f"{r['storage']} · {r['mode']}"
    if r.get("storage_dtype") and r["storage_dtype"] != "float32":
        out += f" · {_short_dtype(r['storage_dtype'])}"
    if r.get("retention") is not None and r["retention"] < 1.0:
        out += f" · {_retention_text(r['retention'], r.get('compression_method'))}"
    return out


def _filter(schema: str | None) -> str | None:
    return None if schema in (None, "", "all") else schema


def _tokens_by_entry(lay: Layout) -> dict[str, int]:
    """Tokens of every store entry, keyed like EncodedSchema.bytes_by_module."""
    out = {r["module"]: r["tokens"] for r in lay.rows()}
    out["(anonymous)"] = lay.anonymous_tokens()
    for sc in lay.schema.scaffolds:
        _, covered = lay.scaffold_unit(sc.name)
        out[f"scaffold:{sc.name}"] = sum(len(lay.pieces[i]) for i in covered)
    return out
