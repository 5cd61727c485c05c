"""Prompt programs: a decorated Python function compiled to a PML schema, and a call to a prompt.

The source is parsed when decorated, never run; the rules are docs/prompt-programs.md.
"""

from engine.programs.compiler import prompt_program
from engine.programs.files import ProgramFile, load_program_file
from engine.programs.model import Param, ProgramCall, ProgramError, Selected, system
from engine.programs.program import PromptProgram

__all__ = ["Param", "PromptProgram", "ProgramCall", "ProgramError", "ProgramFile", "Selected",
           "load_program_file", "prompt_program", "system"]
