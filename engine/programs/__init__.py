"""Prompt programs: a decorated Python function compiled to a PML schema, and a call to a prompt.

The contract is ``docs/pml-spec.md`` section 8. The function is never executed: its source is
parsed with :mod:`ast` when it is decorated, and every construct is translated or rejected then,
with the file, line and a suggestion (:class:`ProgramError`).

    from engine.programs import Param, prompt_program, system

    @prompt_program
    def city_guide(dest: str):
        match dest:
            case "kyoto":
                "Kyoto has well over a thousand temples."
            case "lisbon":
                "Lisbon is a hilly capital on the Tagus estuary."

    @prompt_program
    def trip(duration: Param(len=4), overseas: bool, dest: str = "kyoto"):
        system("You are a travel planner.")
        "Plan my trip, please."
        if overseas:
            "We travel abroad for " + duration + "."
            city_guide(dest=dest)

    trip.schema_xml()   # <schema name="trip"> ... <module name="overseas"> ... <module name="city_guide">
    trip.prompt_xml(duration="5 days", overseas=True, question="What should I book first?")
    # <prompt schema="trip"> <overseas duration="5 days"><city_guide><kyoto/></city_guide></overseas> ...

Translation (a program body may contain only these statements; anything else — loops,
assignments, f-strings, calls of ordinary functions, conditions that do not test a parameter —
is a ProgramError at decoration time, naming ``file:line:col`` and what to write instead):

- a string statement is text. Adjacent literals join exactly; consecutive string statements
  are joined with one space. As everywhere in PML, the two ends of a text run (between
  elements) collapse to one space; whitespace inside is kept. The docstring is text too (a
  program *is* its prompt; write documentation as ``#`` comments).
- a parameter annotated ``Param(len=N[, default=...])`` (or ``Annotated[str, Param(...)]``)
  is interpolated by concatenation, ``"a trip of " + duration + " days"``, or as a bare
  ``duration`` statement → ``<param name="duration" len="N"/>``. A param may appear once per
  module and only inside a module (a program whose top level holds one can only be nested).
- ``system("...")``, as the first statements of the body, is the system message; everything
  else sits in one ``<user>`` region (``@prompt_program(chat=False)``: no role tags at all).
- ``if flag:`` → module ``flag``, imported when the argument is true; ``if not flag:`` →
  module ``not-flag``.
- ``if x == "a": ... elif x == "b": ... else: ...`` and ``match x: case "a": ... case _: ...``
  → a union whose members are named by the case values, made identifiers (``"New York"`` →
  ``New-York``). ``else`` / ``case _`` → member ``x-other``; the ``else`` of a lone
  ``if flag:`` → ``not-flag``. A chain whose branches test different flags (``if a: elif b:``)
  is a union too, and, as in Python, the first branch that holds is imported. A chain with
  only one branch that has text is a plain module; ``pass``-only branches import nothing.
- ``other(arg=value, ...)`` where ``other`` is a prompt program defined above → a nested
  module named ``other`` holding ``other``'s body; each argument is a parameter of the caller
  or a literal. A caller parameter that is only passed on takes the kind of what it is passed
  to (a Param, a flag, a choice), so root programs need not repeat annotations.

Names come from the source, so they are stable across runs; a name already used by a sibling
(or a chat-role name) gets ``-2``, ``-3``, ... in source order.

A call (``prog.bind(...)``, ``prog.prompt_xml(...)`` or ``prog(...)``) binds its arguments as
Python would and imports exactly the modules the same code would run through: Param arguments
become attributes (an omitted or ``None`` Param falls back to its default), nested imports
become children, and ``question=`` adds trailing new text. A value that no case lists, a
non-bool flag or a missing Param without default is a ProgramError located at the call.

The source is read from the function's file (so programs must live in a .py file) and parsed
whole, so reported lines and columns are the file's.

Layout: ``model`` (the public values), ``program`` (PromptProgram), ``files`` (load_program_file),
``compiler`` (statements) with ``text`` (string expressions), ``usage`` (what each parameter is)
and ``source`` (the `def` node, located errors); ``binding`` binds and checks a call's arguments
(once, for calls and for nested calls' literals); ``emit`` writes XML; ``nodes`` are what a body
compiles to.
"""

from engine.programs.compiler import prompt_program
from engine.programs.files import ProgramFile, load_program_file
from engine.programs.model import Param, ProgramCall, ProgramError, Selected, system
from engine.programs.program import PromptProgram

__all__ = ["Param", "PromptProgram", "ProgramCall", "ProgramError", "ProgramFile", "Selected",
           "load_program_file", "prompt_program", "system"]
