"""Prompt programs read from a Python file by importing it."""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from engine.errors import Problem
from engine.files import DOCUMENT_BYTES, check_file
from engine.programs.model import ProgramCall, ProgramError
from engine.programs.nodes import walk_calls
from engine.programs.program import PromptProgram


@dataclass(frozen=True)
class ProgramFile:
    """One file's prompt programs and top-level example calls."""

    path: str
    programs: dict[str, PromptProgram]
    calls: dict[str, ProgramCall]  # by variable name

    def roots(self) -> list[str]:
        """Programs that no other program in the file calls."""
        nested = {c.program.name for p in self.programs.values() for c in walk_calls(p.body)}
        return [n for n in self.programs if n not in nested]

    def example(self, program: str) -> ProgramCall | None:
        """The first top-level call of ``program``, if any."""
        return next((c for c in self.calls.values() if c.schema == program), None)


def load_program_file(path: str) -> ProgramFile:
    """Import the file at ``path`` and collect its programs; any failure is a ProgramError located in it."""
    p = Path(path)
    check_file(p, "program", DOCUMENT_BYTES, "give the path of a .py file")
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
    name = f"_pml_program_{re.sub(r'[^0-9A-Za-z_]', '_', p.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ProgramError(Problem(str(path), 1, 1, "cannot import this file", "give a .py file"))
    module = importlib.util.module_from_spec(spec)
    linecache.checkcache(str(p))
    folder = str(p.resolve().parent)
    sys.path.insert(0, folder)  # like `python FILE.py`: sibling modules can be imported
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ProgramError:
        sys.modules.pop(name, None)
        raise
    except SyntaxError as err:
        sys.modules.pop(name, None)
        raise ProgramError(Problem(err.filename or str(path), err.lineno or 1, err.offset or 1,
                                   f"Python syntax error: {err.msg}", "fix the Python syntax")) from None
    except (Exception, SystemExit) as err:  # the file's own code: say where, no traceback
        sys.modules.pop(name, None)
        line = next((f.lineno for f in reversed(traceback.extract_tb(err.__traceback__))
                     if Path(f.filename).resolve() == p.resolve()), 1)
        raise ProgramError(Problem(str(path), line or 1, 1,
                                   f"importing the file raised {type(err).__name__}: {err}",
                                   "fix the error; the file is imported, so its top-level code runs")) from None
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    programs = {v.name: v for v in vars(module).values() if isinstance(v, PromptProgram)}
    calls = {k: v for k, v in vars(module).items() if isinstance(v, ProgramCall)}
    return ProgramFile(str(path), programs, calls)
