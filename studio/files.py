"""Documents coming in: sample schemas, uploaded .xml files, prompt programs imported from a .py file.

Samples and uploads raise ``gr.Error``; a prompt-program import reports its problems inline.
"""

from __future__ import annotations

import html
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from engine.errors import EngineError, InputFileError
from engine.public import DOCUMENT_BYTES, read_text

from .errors import problem_lines, refusal
from .views import problems_html

log = logging.getLogger("pml-studio")

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_BYTES = DOCUMENT_BYTES  # Gradio refuses larger uploads too (app.py)
SAMPLES = ROOT / "sample_schemas"


def sample_names() -> list[str]:
    return sorted(p.stem for p in SAMPLES.glob("*.xml") if not p.name.endswith(".prompt.xml"))


def load_sample(name: str) -> tuple[str, str]:
    if name not in sample_names():
        raise refusal(f"no sample schema named '{name}'; pick one of {', '.join(sample_names())}")
    schema = (SAMPLES / f"{name}.xml").read_text(encoding="utf-8")
    prompt_file = SAMPLES / f"{name}.prompt.xml"
    return schema, prompt_file.read_text(encoding="utf-8") if prompt_file.exists() else ""


def read_upload(path: str | None) -> tuple[str, str]:
    from engine.public import document_kind

    if not path:
        raise refusal("no file was uploaded")
    if (too_big := _too_big(Path(path))) is not None:
        raise refusal(too_big)
    try:
        text = read_text(path, "schema or prompt")
    except InputFileError as err:
        raise refusal(_named(err, Path(path))) from None
    kind = document_kind(text)
    if kind is None:
        raise refusal(f"{Path(path).name} is neither a PML schema (<schema name=...>) nor a prompt "
                       "(<prompt schema=...>)")
    return kind, text


# Import from Python (prompt programs)

_PROGRAM_LOCK = threading.Lock()  # importing the file touches sys.path / sys.modules


@dataclass(frozen=True)
class ProgramImport:
    ok: bool
    status: str  # HTML: what was imported, or the file's problems
    roots: tuple[str, ...] = ()
    program: str | None = None
    schema: str | None = None
    prompt: str | None = None


def import_program(path: str | None, program: str | None = None) -> ProgramImport:
    """Import the prompt programs of a .py file and compile ``program`` (default: the first root with an example
    call); problems come back inline."""
    if not path:
        return _problem(["no file was uploaded"])
    p = Path(path)
    if p.suffix != ".py":
        return _problem([f"{p.name} is not a Python file; upload a .py file with @prompt_program functions"])
    if (too_big := _too_big(p)) is not None:
        return _problem([too_big])
    try:
        text = read_text(p, "program")
    except InputFileError as err:
        return _problem([_named(err, p)])
    with _PROGRAM_LOCK:
        try:
            return _compile(p, program)
        except EngineError as err:
            return _problem(problem_lines(err, text)[0])
        except Exception as err:  # a program the engine did not anticipate: a message, not a traceback
            log.exception("importing %s failed", p)
            return _problem([f"cannot compile {p.name}: {type(err).__name__}: {err}"])


def _compile(p: Path, program: str | None) -> ProgramImport:
    from engine.public import load_program_file

    pf = load_program_file(str(p))
    roots = tuple(pf.roots())
    if not roots:
        return _problem([f"{p.name} defines no @prompt_program function; decorate one with @prompt_program "
                         "(from engine.programs)"])
    examples = [r for r in roots if pf.example(r) is not None]
    name = program if program in roots else (examples[0] if examples else roots[0])
    schema = pf.programs[name].schema_xml()
    call = pf.example(name)
    prompt = call.prompt_xml() if call is not None else None
    what = ("its example call filled the prompt" if prompt is not None
            else "the file has no example call for it (e.g. EXAMPLE = program.bind(...)); build the prompt in the "
                 "Prompt tab")
    others = f" · other programs: {', '.join(r for r in roots if r != name)}" if len(roots) > 1 else ""
    status = (f'<div class="pml-status ok">✓ imported <b>{html.escape(name)}</b> from {html.escape(p.name)}: '
              f"the compiled schema is in the editor; {html.escape(what)}{html.escape(others)}</div>")
    return ProgramImport(True, status, roots, name, schema, prompt)


def _too_big(p: Path) -> str | None:
    try:
        size = p.stat().st_size
    except OSError:
        return None
    if size <= MAX_FILE_BYTES:
        return None
    return (f"{p.name} is {size / 2**20:.1f} MB; schema and program files are limited to {MAX_FILE_BYTES >> 20} MB. "
            "Split it into smaller modules or files")


def _named(err: InputFileError, p: Path) -> str:
    """The error with the upload's name for its path (Gradio's temporary folder means nothing to the user)."""
    return str(err).replace(str(p), p.name)


def _problem(problems: list[str]) -> ProgramImport:
    return ProgramImport(False, problems_html("cannot import the program", problems))
