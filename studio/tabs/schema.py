"""Schema tab: sample picker, upload/download, Import from Python, the editor, live validation, layout table."""

from __future__ import annotations

import hashlib
import html
import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import gradio as gr

from engine.errors import EngineError

from ..builder import BuilderSpec, empty_prompt, spec_of
from ..errors import problem_count, problem_lines
from ..files import import_program, load_sample, read_upload, sample_names
from ..state import Studio
from ..views import highlight_html, ok_html, problems_html
from .editors import Editors, Step

log = logging.getLogger("pml-studio")
LAYOUT_HEADERS = ["module", "positions", "tokens", "params", "cached"]
LAYOUT = "Layout"
STALE = "Layout — STALE: the last valid schema's (the editor's schema does not parse; fix it to refresh)"
# file systems refuse names over 255 bytes, and a schema name may be longer
DOWNLOAD_NAME_CHARS = 100
PY_NOTE = ('<div class="pml-note">Import from Python compiles a prompt program (@prompt_program) into the editor '
           "and its example call into the prompt; the file is imported, so its top-level code runs on this "
           "machine. Schema and program files up to 5 MB.</div>")


@dataclass(frozen=True)
class SchemaTab:
    validate: Step  # other tabs run it after they replace the schema


def build(studio: Studio, editors: Editors, downloads: Path, first_sample: str | None) -> SchemaTab:
    with gr.Row(equal_height=False):
        with gr.Column(scale=1):
            with gr.Row(elem_classes=["pml-toolbar"]):
                sample = gr.Dropdown(sample_names(), value=first_sample, label="Sample schema", scale=3)
                upload = gr.UploadButton("Upload .xml", file_types=[".xml"], size="md", scale=1)
                download = gr.DownloadButton("Download .xml", size="md", scale=1)
            with gr.Row(elem_classes=["pml-toolbar"]):
                py_upload = gr.UploadButton("Import from Python (.py)", file_types=[".py"], size="md", scale=1,
                                            elem_id="py-upload")
                py_program = gr.Dropdown([], value=None, label="Prompt program", scale=2, interactive=False,
                                         elem_id="py-program")
            py_status = gr.HTML(PY_NOTE, elem_id="py-status")
            py_confirm = gr.Button("Run its code and import it", variant="stop", size="sm", visible=False,
                                   elem_id="py-confirm")
            py_path = gr.State(None)  # the file last imported (its code ran with the user's consent)
            py_pending = gr.State(None)  # uploaded, waiting for the confirm click, in this session only
            editors.schema.render()
        with gr.Column(scale=1):
            validation = gr.HTML(elem_id="schema-validation")
            table = gr.Dataframe(headers=LAYOUT_HEADERS, interactive=False, label=LAYOUT, max_height=420, wrap=True,
                                 column_widths=["28%", "16%", "12%", "30%", "14%"], elem_id="layout-table")
            with gr.Accordion("Highlighted source (problem lines in red)", open=False) as source:
                highlighted = gr.HTML()

    outputs = [validation, table, highlighted, editors.spec, editors.schema_ok, download, source, sample]
    validate_step = Step(partial(_validate_ui, studio, downloads), [editors.schema, editors.spec], outputs)
    editors.schema.change(*validate_step, trigger_mode="always_last", show_progress="hidden")

    docs = [editors.schema, editors.prompt]
    sample.input(load_sample, sample, docs, show_progress="hidden").then(*editors.sync, show_progress="hidden")
    upload.upload(on_upload, upload, docs).then(*editors.sync, show_progress="hidden")
    py_out = docs + [py_program, py_status, py_path]
    # importing runs the file's code: the upload only asks; the confirm button of the same session imports
    py_upload.upload(on_python_upload, py_upload, [py_pending, py_confirm, py_status], show_progress="hidden")
    py_confirm.click(on_python_confirm, py_pending, py_out + [py_pending, py_confirm]).then(
        *editors.sync, show_progress="hidden")
    py_program.input(on_python, [py_path, py_program], py_out).then(*editors.sync, show_progress="hidden")
    return SchemaTab(validate_step)



@dataclass(frozen=True)
class Validation:
    ok: bool
    name: str  # '' when it cannot be parsed
    problems: tuple[str, ...]  # "line:col: message; hint: ..." lines
    lines: tuple[int, ...]  # highlighted
    rows: tuple[tuple, ...]  # layout table rows
    positions: int
    spec: BuilderSpec | None = field(default=None, repr=False)
    count: int = 0  # problems found, the listed ones and those past the list's cap

    def status_html(self) -> str:
        if self.ok:
            return ok_html(f"schema <b>{html.escape(self.name)}</b> is valid: {len(self.rows)} modules, "
                           f"{self.positions} positions")
        return problems_html(f"{self.count or len(self.problems)} problem(s) — the layout beside is the last valid schema's, "
                             "stale until these are fixed", self.problems)


def validate(studio: Studio, schema_text: str) -> Validation:
    """Parse and lay out the schema; problems come back as lines, never as exceptions."""
    try:
        lay = studio.layout(schema_text)
    except EngineError as err:
        problems, lines = problem_lines(err, schema_text or "")
        return Validation(False, "", tuple(problems), tuple(lines), (), 0, count=problem_count(err))
    # a nested module's path may break after each "/" (a zero-width space), never inside a name, never clipped
    rows = tuple((r["module"].replace("/", "/\u200b") + (" (union member)" if r["union"] else ""),
                  f"{r['start']}–{r['end']}", r["tokens"],
                  r["params"], "yes" if r["cache"] else "no (cache=false)") for r in lay.rows())
    return Validation(True, lay.name, (), (), rows, lay.length, spec_of(lay))


def on_upload(path: str | None):
    kind, text = read_upload(path)
    return (text, gr.skip()) if kind == "schema" else (gr.skip(), text)


def on_python_upload(path: str | None):
    """A .py file arrived: keep it for this session and ask before its code runs."""
    if not path:
        return None, gr.Button(visible=False), PY_NOTE
    ask = (f'<div class="pml-status warn">Importing <b>{html.escape(Path(path).name)}</b> runs its top-level code on '
           "this machine, as you. Run it only if you trust the file: click <b>Run its code and import it</b>.</div>")
    return path, gr.Button(visible=True), ask


def on_python_confirm(pending: str | None):
    """Import the file this session uploaded: ``pending`` is server-side session state, so a request cannot name a
    file of its own to run."""
    if not pending:
        status = problems_html("cannot import the program", ["no .py file is waiting: upload one with "
                                                              "Import from Python, then confirm"])
        return gr.skip(), gr.skip(), gr.skip(), status, gr.skip(), None, gr.Button(visible=False)
    return (*on_python(pending), None, gr.Button(visible=False))


def on_python(path: str | None, program: str | None = None):
    imp = import_program(path, program)
    if not imp.ok:
        return gr.skip(), gr.skip(), gr.skip(), imp.status, gr.skip()
    prompt = imp.prompt if imp.prompt is not None else empty_prompt(imp.program)
    return (imp.schema, prompt, gr.Dropdown(choices=list(imp.roots), value=imp.program, interactive=True),
            imp.status, path)


def download_name(schema_name: str) -> str:
    name = "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in schema_name) or "schema"
    if len(name) > DOWNLOAD_NAME_CHARS:
        digest = hashlib.sha256(schema_name.encode()).hexdigest()[:10]
        name = f"{name[:DOWNLOAD_NAME_CHARS - 11]}-{digest}"
    return f"{name.lstrip('.') or 'schema'}.xml"


def _download(downloads: Path, schema_name: str, schema_text: str) -> Path | None:
    file = downloads / download_name(schema_name)
    try:
        file.write_text(schema_text, encoding="utf-8")
    except OSError as err:  # the folder gone or full: validation still answers
        log.warning("the schema download could not be written (%s): %s", file, err)
        return None
    return file


def _validate_ui(studio: Studio, downloads: Path, schema_text: str, prev_spec):
    v = validate(studio, schema_text)
    file = _download(downloads, v.name, schema_text) if v.ok else gr.skip()
    table = gr.Dataframe([list(r) for r in v.rows], label=LAYOUT) if v.ok else gr.Dataframe(label=STALE)
    return (v.status_html(), table, highlight_html(schema_text, v.lines),
            v.spec if v.ok and v.spec != prev_spec else gr.skip(), v.ok, file,
            gr.skip() if v.ok else gr.Accordion(open=True), _sample_shown(v))


def _sample_shown(v: Validation):
    """The sample dropdown follows the text (an undo can bring back another sample's): the sample the schema is
    named after, or none for a schema of another name. It only listens to the user's picks (.input)."""
    if not v.ok:
        return gr.skip()
    return gr.Dropdown(value=v.name if v.name in sample_names() else None)
