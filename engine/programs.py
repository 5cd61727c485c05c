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

Public API first, internal helpers after.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import linecache
import re
import sys
import traceback
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from .errors import PMLError, Problem
from .pml import IDENT, ROLES, parse_schema

__all__ = ["Param", "PromptProgram", "ProgramCall", "ProgramError", "ProgramFile", "Selected",
           "load_program_file", "prompt_program", "system"]


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

class ProgramError(PMLError):
    """A prompt program that cannot be compiled or called; lines read ``FILE:LINE:COL: error: ...``.

    A subclass of PMLError (and so of EngineError) because it carries located problems exactly
    like a PML document: the CLI and the studio print it the same way.
    """


@dataclass(frozen=True)
class Param:
    """Annotation of a text parameter: at most ``len`` tokens, ``default`` when none is given."""

    len: int
    default: str | None = None

    def __post_init__(self):
        if not isinstance(self.len, int) or isinstance(self.len, bool) or self.len <= 0:
            raise ValueError(f"Param(len={self.len!r}): len must be a positive whole number of tokens")
        if self.default is not None and not isinstance(self.default, str):
            raise ValueError(f"Param(default={self.default!r}): a default must be text")


def system(*text: str) -> None:
    """In a prompt program, ``system("...")`` sets the system message. Never called at run time."""
    raise RuntimeError("system() only has a meaning inside a @prompt_program function")


@dataclass(frozen=True)
class ProgramParam:
    """One parameter of a program and how its body uses it."""

    name: str
    kind: str  # "param" (text, Param annotation) | "flag" (if x:) | "choice" (x == "a", match) | "value"
    spec: Param | None  # for kind "param"
    default: object  # Python default, or MISSING
    choices: tuple[str, ...] = ()  # case values, for kind "choice"
    open_choice: bool = False  # a chain on it has else / case _: any value is accepted


@dataclass(frozen=True)
class Selected:
    """One import of a call: ``<name arg="value">children</name>``."""

    name: str
    args: tuple[tuple[str, str], ...]
    children: tuple["Selected", ...]

    def xml(self) -> str:
        attrs = "".join(f" {k}={quoteattr(v)}" for k, v in self.args)
        if not self.children:
            return f"<{self.name}{attrs}/>"
        return f"<{self.name}{attrs}>" + "".join(c.xml() for c in self.children) + f"</{self.name}>"


@dataclass(frozen=True)
class ProgramCall:
    """A concrete call of a program: what it imports, plus the trailing question."""

    schema: str
    imports: tuple[Selected, ...]
    question: str | None = None

    def prompt_xml(self) -> str:
        """The PML prompt: one line per top-level import, then the question as new text."""
        lines = [f"<prompt schema={quoteattr(self.schema)}>"]
        lines += ["  " + s.xml() for s in self.imports]
        if self.question and self.question.strip():
            lines.append("  " + _text_xml(self.question.strip()))
        lines.append("</prompt>")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True, eq=False)
class PromptProgram:
    """A compiled prompt program (what ``@prompt_program`` returns)."""

    name: str
    func: typing.Callable = field(repr=False)
    params: tuple[ProgramParam, ...]
    chat: bool
    system_text: str
    body: tuple = field(repr=False)  # compiled nodes (internal)
    source: str  # file the function is defined in
    line: int  # line of its `def`
    root_param_problem: Problem | None = field(default=None, repr=False)

    def schema_xml(self) -> str:
        """The PML schema ``<schema name=NAME>`` of this program."""
        if self.root_param_problem:
            raise ProgramError(self.root_param_problem)
        lines = [f"<schema name={quoteattr(self.name)}>"]
        if self.system_text:
            lines.append(f"  <system>{_text_xml(self.system_text)}</system>")
        if self.chat:
            if self.body:
                lines.append("  <user>")
                _emit(self.body, 2, lines)
                lines.append("  </user>")
        else:
            _emit(self.body, 1, lines)
        lines.append("</schema>")
        return "\n".join(lines) + "\n"

    def bind(self, *args, question: str | None = None, **kwargs) -> ProgramCall:
        """The imports a call with these arguments selects (validated like a Python call)."""
        if self.root_param_problem:
            raise ProgramError(self.root_param_problem)
        env = self._env(args, kwargs)
        if question is not None and (not isinstance(question, str) or not _xml_safe(question)):
            raise self._problem(f"{self.name}(question={question!r}): the question must be text without control "
                                "characters", "pass question=\"...\"")
        return ProgramCall(self.name, tuple(_select(self, self.body, env)), question)

    def prompt_xml(self, *args, question: str | None = None, **kwargs) -> str:
        """The PML prompt for a call: ``prog.prompt_xml(duration="5 days", question="...")``."""
        return self.bind(*args, question=question, **kwargs).prompt_xml()

    __call__ = prompt_xml

    # -- internal -----------------------------------------------------------------------------

    def _problem(self, message: str, hint: str = "") -> ProgramError:
        """A call-time error, located at the caller's line (the first frame outside this module)."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back
        source, line = (frame.f_code.co_filename, frame.f_lineno) if frame else (self.source, self.line)
        return ProgramError(Problem(source, line, 1, message, hint))

    def _env(self, args: tuple, kwargs: dict) -> dict:
        """Bind a call like Python would; omitted Params stay MISSING (their PML default applies)."""
        try:
            env = _bind(self, args, kwargs)
        except TypeError as err:
            raise self._problem(f"{self.name}(): {err}",
                                f"arguments of {self.name}: {', '.join(p.name for p in self.params) or 'none'}"
                                ) from None
        for p in self.params:
            v = env[p.name]
            if p.kind == "param" and v is None:
                env[p.name] = v = MISSING  # None means "no argument": the param's default applies
            if p.kind == "param" and v is not MISSING and not (isinstance(v, str) and _xml_safe(v)):
                raise self._problem(f"{self.name}({p.name}={v!r}): a Param argument must be text without control "
                                    "characters", f"pass {p.name}=\"...\" (None or nothing: the param's default)")
            if p.kind == "flag" and not isinstance(v, bool):
                raise self._problem(f"{self.name}({p.name}={v!r}): '{p.name}' selects a module with "
                                    f"`if {p.name}:`, so it must be True or False", f"pass {p.name}=True or False")
            if p.kind == "choice" and v is not None and not p.open_choice and v not in p.choices:
                raise self._problem(f"{self.name}({p.name}={v!r}) matches no case of '{p.name}'",
                                    f"valid values: {', '.join(repr(c) for c in p.choices)}")
        return env


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()  # an omitted Param argument / a parameter without a Python default


def prompt_program(func=None, *, chat: bool = True):
    """Decorator: compile ``func``'s body into a PML schema (raises ProgramError on what it cannot).

    ``chat=False`` leaves out the chat-role tags (text sits directly in ``<schema>``).
    """
    if func is None:
        return lambda f: _compile(f, chat)
    return _compile(func, chat)


@dataclass(frozen=True)
class ProgramFile:
    """The prompt programs of one imported file, and the example calls it defines at top level."""

    path: str
    programs: dict[str, PromptProgram]
    calls: dict[str, ProgramCall]  # module-level variable name -> ProgramCall

    def roots(self) -> list[str]:
        """Programs that no other program in the file calls (the schemas the file is written for)."""
        nested = {c.program.name for p in self.programs.values() for c in _walk_calls(p.body)}
        return [n for n in self.programs if n not in nested]

    def example(self, program: str) -> ProgramCall | None:
        """The first module-level call of ``program`` (e.g. ``EXAMPLE = travel.bind(...)``), if any."""
        return next((c for c in self.calls.values() if c.schema == program), None)


def load_program_file(path: str) -> ProgramFile:
    """Import the Python file at ``path`` (its top-level code runs, as with any import) and collect its
    programs. Every failure — syntax, an exception while importing, a ProgramError — is raised as a
    ProgramError located in that file."""
    p = Path(path)
    if not p.is_file():
        raise ProgramError(Problem(str(path), 1, 1, "no such file", "give the path of a .py file"))
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
    except (Exception, SystemExit) as err:  # the file's own code failed: report where, never a traceback
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


# ----------------------------------------------------------------------------------------------
# Internal helpers: compiled nodes
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Text:
    text: str


@dataclass(frozen=True)
class _ParamRef:
    name: str
    spec: Param
    default: str | None  # the PML default (Param.default or the Python default)


@dataclass(frozen=True)
class _Cond:
    """A test of one parameter: ``x`` (flag), ``not x`` (not) or ``x == "v"`` (eq)."""

    var: str
    kind: str
    value: str | None = None

    def holds(self, env: dict) -> bool:
        v = env[self.var]
        if self.kind == "flag":
            return bool(v)
        if self.kind == "not":
            return not v
        return v == self.value


@dataclass(frozen=True)
class _Branch:
    cond: _Cond | None  # None: else / case _
    name: str | None  # None when the branch is empty (only `pass`)
    body: tuple


@dataclass(frozen=True)
class _Choice:
    """An if/elif/else chain or a match: the first branch that holds is imported."""

    branches: tuple[_Branch, ...]

    def members(self) -> list[_Branch]:
        return [b for b in self.branches if b.name is not None]


@dataclass(frozen=True)
class _Call:
    """A call of another program: a nested module named ``name``."""

    name: str
    program: PromptProgram
    args: tuple[tuple[str, tuple[str, object]], ...]  # callee param -> ("param", caller param) | ("const", value)


def _walk_calls(nodes):
    for n in nodes:
        if isinstance(n, _Call):
            yield n
            yield from _walk_calls(n.program.body)
        elif isinstance(n, _Choice):
            for b in n.branches:
                yield from _walk_calls(b.body)


# -- schema emission ---------------------------------------------------------------------------

def _xml_safe(text: str) -> bool:
    return all(_xml_char(c) for c in text)


def _xml_char(c: str) -> bool:
    o = ord(c)
    return o in (0x9, 0xA, 0xD) or 0x20 <= o <= 0xD7FF or 0xE000 <= o <= 0xFFFD or 0x10000 <= o <= 0x10FFFF


def _text_xml(text: str) -> str:
    return escape(text, {"\r": "&#13;"})


def _param_xml(ref: _ParamRef) -> str:
    default = f" default={quoteattr(ref.default)}" if ref.default is not None else ""
    return f"<param name={quoteattr(ref.name)} len=\"{ref.spec.len}\"{default}/>"


def _emit(nodes, depth: int, lines: list[str]) -> None:
    """Pretty-print nodes: each run of text and params on one line, elements on their own lines.

    Indentation only ever touches the ends of a text run, where PML collapses whitespace to one
    space anyway, so the emitted document means exactly the compiled text.
    """
    pad = "  " * depth
    inline: list[str] = []

    def flush():
        if inline:
            lines.append(pad + "".join(inline))
            inline.clear()

    for n in nodes:
        if isinstance(n, _Text):
            inline.append(_text_xml(n.text))
        elif isinstance(n, _ParamRef):
            inline.append(_param_xml(n))
        elif isinstance(n, _Call):
            flush()
            _emit_module(n.name, n.program.body, depth, lines)
        elif isinstance(n, _Choice):
            members = n.members()
            if not members:
                continue
            flush()
            if len(members) == 1:
                _emit_module(members[0].name, members[0].body, depth, lines)
            else:
                lines.append(pad + "<union>")
                for m in members:
                    _emit_module(m.name, m.body, depth + 1, lines)
                lines.append(pad + "</union>")
    flush()


def _emit_module(name: str, body, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    if not body:
        lines.append(f"{pad}<module name={quoteattr(name)}/>")
        return
    lines.append(f"{pad}<module name={quoteattr(name)}>")
    _emit(body, depth + 1, lines)
    lines.append(f"{pad}</module>")


# -- call selection ----------------------------------------------------------------------------

def _select(program: PromptProgram, nodes, env: dict) -> list[Selected]:
    out: list[Selected] = []
    for n in nodes:
        if isinstance(n, _Choice):
            branch = next((b for b in n.branches if b.cond is None or b.cond.holds(env)), None)
            if branch is not None and branch.name is not None:
                out.append(_module_import(program, branch.name, branch.body, env))
        elif isinstance(n, _Call):
            callee = n.program
            kwargs = {k: (env[v] if how == "param" else v) for k, (how, v) in n.args}
            kwargs = {k: v for k, v in kwargs.items() if v is not MISSING}
            out.append(_module_import(callee, n.name, callee.body, callee._env((), kwargs)))
    return out


def _module_import(program: PromptProgram, name: str, body, env: dict) -> Selected:
    args: list[tuple[str, str]] = []
    for n in body:
        if isinstance(n, _ParamRef):
            v = env[n.name]
            if v is MISSING:
                if n.default is None:
                    raise program._problem(f"{program.name}() needs an argument for '{n.name}': module '{name}' "
                                           "is imported and the param has no default",
                                           f"pass {n.name}=\"...\" or give it Param(len={n.spec.len}, default=...)")
                continue
            args.append((n.name, v))
    return Selected(name, tuple(args), tuple(_select(program, body, env)))


# ----------------------------------------------------------------------------------------------
# Internal helpers: the compiler
# ----------------------------------------------------------------------------------------------

def _compile(func, chat: bool) -> PromptProgram:
    if isinstance(func, PromptProgram):
        raise ProgramError(Problem(func.source, func.line, 1, f"{func.name} is decorated twice",
                                   "use @prompt_program once"))
    if not inspect.isfunction(func):
        raise TypeError("@prompt_program decorates a function")
    source = inspect.getsourcefile(func) or func.__code__.co_filename
    node = _function_node(func, source)
    return _Compiler(func, node, source, chat).program()


def _function_node(func, source: str) -> ast.FunctionDef:
    """The function's `def` node, parsed from its whole file so lines and columns are the file's."""
    linecache.checkcache(source)
    lines = linecache.getlines(source, func.__globals__)
    first = func.__code__.co_firstlineno
    where = Problem(source, first, 1, f"cannot read the source of {func.__name__}",
                    "define prompt programs in a .py file (not in a REPL or with exec)")
    if not lines:
        raise ProgramError(where)
    try:
        tree = ast.parse("".join(lines), filename=source)
    except SyntaxError:
        raise ProgramError(where) from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func.__name__:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if start == first:
                if isinstance(node, ast.AsyncFunctionDef):
                    raise ProgramError(Problem(source, node.lineno, node.col_offset + 1,
                                               "a prompt program cannot be async", "write `def`, not `async def`"))
                return node
    raise ProgramError(where)


class _Names:
    """Module names among siblings: unique, never a role name, suffixed -2, -3... in source order."""

    def __init__(self):
        self.used: set[str] = set()

    def take(self, base: str) -> str:
        name, k = base, 1
        while name in self.used or name in ROLES:
            k += 1
            name = f"{base}-{k}"
        self.used.add(name)
        return name


def _ident(value: str, fallback: str) -> str:
    """A case value as a module name: ASCII-folded, other characters → '-'."""
    ascii_ = unicodedata.normalize("NFKD", value).encode("ascii", "ignore").decode()
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", ascii_).strip("-.")
    if not s:
        return fallback
    return s if re.match(r"[A-Za-z_]", s) else "_" + s


_SUGGEST_LOOP = ("a schema is fixed when it is compiled: write each alternative as an if/match branch, or pass "
                 "the varying text as a Param(len=N) argument")


class _Compiler:
    def __init__(self, func, node: ast.FunctionDef, source: str, chat: bool):
        self.func = func
        self.node = node
        self.source = source
        self.chat = chat
        self.name = func.__name__
        self.kinds: dict[str, str] = {}  # parameter -> "flag" | "choice" | "param-text"
        self.choices: dict[str, list[str]] = {}
        self.open_choices: set[str] = set()
        self.system: list[str] = []
        self.content_started = False
        self.forwards: dict[str, list[ProgramParam]] = {}  # caller parameter -> callee parameters it is passed to

    # -- reporting ----------------------------------------------------------------------------

    def error(self, node, message: str, hint: str = "") -> ProgramError:
        line = getattr(node, "lineno", self.node.lineno)
        col = getattr(node, "col_offset", 0) + 1
        return ProgramError(Problem(self.source, line, col, message, hint))

    # -- signature ----------------------------------------------------------------------------

    def signature(self) -> dict[str, tuple[Param | None, object, object]]:
        """name -> (Param spec, Python default, annotation)."""
        if not IDENT.match(self.name):
            raise self.error(self.node, f"'{self.name}' is not a valid PML name", "use ASCII letters, digits and '_'")
        try:
            sig = inspect.signature(self.func, eval_str=True)
        except Exception as err:
            raise self.error(self.node, f"cannot read the annotations of {self.name}: {err}",
                             "annotate text parameters with Param(len=N) from engine.programs") from None
        args = {a.arg: a for a in self.node.args.posonlyargs + self.node.args.args + self.node.args.kwonlyargs}
        out = {}
        for p in sig.parameters.values():
            where = args.get(p.name, self.node)
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise self.error(where, f"*{p.name} / **{p.name} parameters are not supported",
                                 "name every parameter: the schema is compiled from the signature")
            if not IDENT.match(p.name):
                raise self.error(where, f"parameter '{p.name}' is not a valid PML name", "use ASCII letters and '_'")
            if p.name == "question":
                raise self.error(where, "the parameter name 'question' is reserved for the prompt's trailing text",
                                 "rename the parameter")
            spec = _param_spec(p.annotation)
            default = MISSING if p.default is p.empty else p.default
            if spec is not None and default is not MISSING:
                if not isinstance(default, str):
                    raise self.error(where, f"the default of Param '{p.name}' must be text", "write = \"...\"")
                if spec.default is not None and spec.default != default:
                    raise self.error(where, f"Param '{p.name}' has two different defaults",
                                     "give the default once, as Param(len=N, default=\"...\")")
                spec = Param(spec.len, default)
            out[p.name] = (spec, default, p.annotation)
        return out

    # -- program ------------------------------------------------------------------------------

    def program(self) -> PromptProgram:
        self.params = self.signature()
        body = self.body(self.node.body, _Names(), root=True)
        root_params = [n for n in body if isinstance(n, _ParamRef)]
        root_problem = None
        if root_params:
            root_problem = Problem(
                self.source, self.node.lineno, self.node.col_offset + 1,
                f"{self.name} interpolates '{root_params[0].name}' outside any module; as a schema its top level "
                "is fixed text, so it can only be used as a nested program",
                f"call {self.name}(...) from another program (it becomes a module), or move the text into an if block")
        params = []
        for name, (spec, default, ann) in self.params.items():
            kind = self.kinds.get(name)
            kind = "param" if spec is not None else {"flag": "flag", "choice": "choice"}.get(kind, "value")
            p = ProgramParam(name, kind, spec, default, tuple(self.choices.get(name, ())), name in self.open_choices)
            params.append(self.inherit(p))
        prog = PromptProgram(name=self.name, func=self.func, params=tuple(params), chat=self.chat,
                             system_text=" ".join(self.system), body=tuple(body), source=self.source,
                             line=self.node.lineno, root_param_problem=root_problem)
        if root_problem is None:
            self.check(prog)
        return prog

    def inherit(self, p: ProgramParam) -> ProgramParam:
        """Widen a parameter's kind by what it is passed on to in nested calls.

        A parameter used only to pass on takes the kind of its targets, so
        `def travel(duration): trip_plan(duration=duration)` treats `duration` as trip_plan's
        Param (omitted → its default). A choice passed on also accepts its targets' values.
        """
        targets = self.forwards.get(p.name, [])
        kinds = {t.kind for t in targets}
        if not targets or p.kind in ("param", "flag"):
            return p
        if p.kind == "choice":
            if kinds != {"choice"}:
                return ProgramParam(p.name, "choice", None, p.default, p.choices, True)  # the callee checks
            choices = tuple(dict.fromkeys(p.choices + tuple(c for t in targets for c in t.choices)))
            return ProgramParam(p.name, "choice", None, p.default, choices,
                                p.open_choice or any(t.open_choice for t in targets))
        if len(kinds) != 1 or "value" in kinds:
            return p
        t = targets[0]
        if t.kind == "param":
            if p.default is not MISSING and p.default is not None and not isinstance(p.default, str):
                return p  # passed on as given; the nested call reports it
            return ProgramParam(p.name, "param", t.spec, p.default)
        choices = tuple(dict.fromkeys(c for t in targets for c in t.choices))
        return ProgramParam(p.name, t.kind, None, p.default, choices, any(t.open_choice for t in targets))

    def check(self, prog: PromptProgram) -> None:
        """The compiled schema must parse: a failure here is a compiler bug, reported at the `def`."""
        try:
            parse_schema(prog.schema_xml(), f"{self.source}:{self.name}")
        except PMLError as err:
            raise self.error(self.node, f"{self.name} compiled to an invalid schema: {err.problems[0].message}",
                             "please report this with the program") from None

    # -- statements ---------------------------------------------------------------------------

    def body(self, stmts, names: _Names, root: bool = False) -> list:
        out: list = []
        params_here: set[str] = set()
        for st in stmts:
            if root and self.is_system(st):
                if self.content_started:
                    raise self.error(st, "system() must come before any other text",
                                     "move the system(...) call to the top of the function")
                self.system.append(self.system_text(st))
                continue
            self.content_started = True
            nodes = self.statement(st, names)
            for n in nodes:
                if isinstance(n, _ParamRef):
                    if n.name in params_here:
                        raise self.error(st, f"'{n.name}' is interpolated twice in one module",
                                         "a PML param appears once per module: move one use into a nested "
                                         "if block or a nested program")
                    params_here.add(n.name)
            _append_inline(out, nodes)
        return out

    def statement(self, st, names: _Names) -> list:
        if isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)
                                         and st.value.value is Ellipsis):
            return []
        if isinstance(st, ast.Expr):
            return self.expression(st, names)
        if isinstance(st, ast.If):
            return [self.if_chain(st, names)]
        if isinstance(st, ast.Match):
            return [self.match(st, names)]
        if isinstance(st, (ast.For, ast.While, ast.AsyncFor)):
            raise self.error(st, "loops are not supported in a prompt program", _SUGGEST_LOOP)
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            raise self.error(st, "assignments are not supported in a prompt program",
                             "a program only declares text: use the parameter itself, or a nested program")
        if isinstance(st, ast.Return):
            raise self.error(st, "return is not supported in a prompt program",
                             "remove it: the program is its text; use if/else for alternatives")
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise self.error(st, "nested definitions are not supported in a prompt program",
                             "define it at module level and decorate it with @prompt_program")
        kind = type(st).__name__.lower()
        raise self.error(st, f"'{kind}' statements are not supported in a prompt program",
                         "a program body holds text, if/elif/else, match and calls of other prompt programs")

    def expression(self, st: ast.Expr, names: _Names) -> list:
        e = st.value
        if isinstance(e, ast.Call):
            return [self.call(e, names)]
        if isinstance(e, ast.JoinedStr):
            raise self.error(e, "f-strings are not supported: their value is unknown when the schema is compiled",
                             "annotate the parameter with Param(len=N) and concatenate: \"a trip of \" + duration")
        return self.inline(e)

    def inline(self, e) -> list:
        """Text and params of a string statement: a literal, a Param, or a `+` chain of them."""
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [_Text(self.checked_text(e, e.value))] if e.value else []
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
            left, right = self.inline(e.left), self.inline(e.right)
            return _join(left, right)
        if isinstance(e, ast.Name) and e.id in self.params:
            spec, _, _ = self.params[e.id]
            if spec is None:
                raise self.error(e, f"'{e.id}' is interpolated into the text but is not a Param",
                                 f"annotate it: {e.id}: Param(len=N) (N = the most tokens it may have)")
            if self.kinds.get(e.id, "param-text") != "param-text":
                raise self.error(e, f"'{e.id}' is used both as text and as a condition", "use two parameters")
            self.kinds[e.id] = "param-text"
            return [_ParamRef(e.id, spec, spec.default)]
        if isinstance(e, ast.JoinedStr):
            raise self.error(e, "f-strings are not supported: their value is unknown when the schema is compiled",
                             "annotate the parameter with Param(len=N) and concatenate: \"a trip of \" + duration")
        if isinstance(e, ast.Name):
            raise self.error(e, f"'{e.id}' is not a parameter of {self.name}",
                             "text must be string literals; interpolate parameters annotated with Param(len=N)")
        raise self.error(e, f"the expression `{_src(e)}` is not supported in a prompt program",
                         "write text as string literals, joined with + to Param parameters")

    def checked_text(self, node, text: str) -> str:
        bad = next((c for c in text if not _xml_char(c)), None)
        if bad is not None:
            raise self.error(node, f"the text contains the character {bad!r}, which XML cannot hold",
                             "remove control characters from the text")
        return text

    # -- system message -----------------------------------------------------------------------

    def is_system(self, st) -> bool:
        return (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
                and self.resolve(st.value.func) is system)

    def system_text(self, st) -> str:
        call = st.value
        if not self.chat:
            raise self.error(st, "system() needs chat-role tags, but the program says chat=False",
                             "remove chat=False or write the text as a string statement")
        if call.keywords or not call.args:
            raise self.error(st, "system() takes the text as its only argument", "write system(\"You are ...\")")
        parts = []
        for a in call.args:
            nodes = self.inline(a)
            if any(isinstance(n, _ParamRef) for n in nodes):
                raise self.error(a, "the system message cannot hold a Param (params live inside modules)",
                                 "move the parameterised text into the body")
            parts += nodes
        return " ".join(n.text for n in parts if isinstance(n, _Text)).strip()

    # -- conditions ---------------------------------------------------------------------------

    def condition(self, test) -> _Cond:
        hint = "conditions test a parameter: `if flag:`, `if not flag:` or `if x == \"value\":`"
        if isinstance(test, ast.Name):
            return _Cond(self.selector(test, test.id, "flag"), "flag")
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name):
            return _Cond(self.selector(test, test.operand.id, "flag"), "not")
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            a, b = test.left, test.comparators[0]
            if isinstance(b, ast.Name) and isinstance(a, ast.Constant):
                a, b = b, a
            if isinstance(a, ast.Name) and isinstance(b, ast.Constant) and isinstance(b.value, str):
                var = self.selector(test, a.id, "choice")
                return _Cond(var, "eq", b.value)
            raise self.error(test, f"the condition `{_src(test)}` does not compare a parameter with a string", hint)
        if isinstance(test, ast.BoolOp):
            raise self.error(test, f"`{_src(test)}`: and/or conditions are not supported",
                             "nest the if blocks (`if a:` then `if b:` inside), each becomes a module")
        raise self.error(test, f"the condition `{_src(test)}` is not supported", hint)

    def selector(self, node, var: str, kind: str) -> str:
        if var not in self.params:
            raise self.error(node, f"the condition tests '{var}', which is not a parameter of {self.name}",
                             "conditions may only test the program's parameters (the call decides what is imported)")
        spec, _, ann = self.params[var]
        if spec is not None:
            raise self.error(node, f"'{var}' is a Param (text) and cannot select a module",
                             "use a bool or str parameter for the condition")
        if kind == "choice" and ann is bool:
            raise self.error(node, f"'{var}' is a bool but is compared with a string", f"write `if {var}:`")
        if kind == "flag" and ann is str:
            raise self.error(node, f"'{var}' is a str; `if {var}:` would test whether it is empty",
                             f"compare it: `if {var} == \"value\":`, or annotate it bool")
        seen = self.kinds.setdefault(var, kind)
        if seen != kind:
            raise self.error(node, f"'{var}' is used both as a flag (`if {var}:`) and compared with values",
                             "use one form for each parameter")
        return var

    # -- if / match ---------------------------------------------------------------------------

    def if_chain(self, st: ast.If, names: _Names) -> _Choice:
        tests: list[tuple[_Cond | None, list, object]] = []
        node = st
        while True:
            tests.append((self.condition(node.test), node.body, node))
            if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
                node = node.orelse[0]  # elif (or `else:` holding just an `if`, which means the same)
                continue
            if node.orelse:
                tests.append((None, node.orelse, node.orelse[0]))
            break
        return self.choice(tests, names)

    def match(self, st: ast.Match, names: _Names) -> _Choice:
        if not isinstance(st.subject, ast.Name):
            raise self.error(st.subject, f"`match {_src(st.subject)}` does not match a parameter",
                             "write `match param:` with one of the program's parameters")
        var = st.subject.id
        tests: list = []
        for case in st.cases:
            p = case.pattern
            if case.guard is not None:
                raise self.error(case.guard, "case guards (`case ... if ...`) are not supported",
                                 "nest an if block inside the case")
            if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant) and isinstance(p.value.value, str):
                tests.append((_Cond(self.selector(st.subject, var, "choice"), "eq", p.value.value), case.body, p))
            elif isinstance(p, ast.MatchAs) and p.pattern is None and p.name is None:
                self.selector(st.subject, var, "choice")
                tests.append((None, case.body, p))
            else:
                raise self.error(p, f"the pattern `{_src(p)}` is not supported",
                                 "use string literals (`case \"kyoto\":`) and `case _:`; one value per case")
        return self.choice(tests, names)

    def choice(self, tests: list, names: _Names) -> _Choice:
        conds = [c for c, _, _ in tests if c is not None]
        seen: set[tuple] = set()
        for c, _, node in tests:
            if c is not None:
                key = (c.var, c.kind, c.value)
                if key in seen:
                    raise self.error(node, f"`{_cond_src(c)}` is tested twice in one chain",
                                     "the second branch could never be chosen: merge the two")
                seen.add(key)
                if c.kind == "eq" and c.value not in self.choices.setdefault(c.var, []):
                    self.choices[c.var].append(c.value)
        if tests[-1][0] is None:
            for c in conds:
                if c.kind == "eq":
                    self.open_choices.add(c.var)
        branches = []
        for cond, body_stmts, node in tests:
            inner = _Names()
            body = self.body(body_stmts, inner)
            if not body:
                branches.append(_Branch(cond, None, ()))
                continue
            if cond is None:
                only = conds[0] if len(conds) == 1 else None
                if only is not None and only.kind == "flag":
                    base = f"not-{only.var}"
                elif only is not None and only.kind == "not":
                    base = only.var
                else:
                    base = f"{conds[0].var}-other"
            elif cond.kind == "flag":
                base = cond.var
            elif cond.kind == "not":
                base = f"not-{cond.var}"
            else:
                base = _ident(cond.value, f"{cond.var}-empty")
            branches.append(_Branch(cond, names.take(base), tuple(body)))
        return _Choice(tuple(branches))

    # -- calls --------------------------------------------------------------------------------

    def resolve(self, func_node):
        """The object a call's function expression names, looked up like Python would (no calls made)."""
        if isinstance(func_node, ast.Name):
            closure = dict(zip(self.func.__code__.co_freevars,
                               [c.cell_contents if _cell_full(c) else MISSING for c in (self.func.__closure__ or ())]))
            if func_node.id in closure:
                return closure[func_node.id]
            if func_node.id in self.func.__globals__:
                return self.func.__globals__[func_node.id]
            builtins = self.func.__globals__.get("__builtins__", {})
            builtins = builtins if isinstance(builtins, dict) else vars(builtins)
            return builtins.get(func_node.id, MISSING)
        if isinstance(func_node, ast.Attribute):
            base = self.resolve(func_node.value)
            if isinstance(base, type(sys)):  # attribute of a module only: no properties run
                return vars(base).get(func_node.attr, MISSING)
        return MISSING

    def call(self, e: ast.Call, names: _Names) -> _Call:
        target = self.resolve(e.func)
        label = _src(e.func)
        if target is system:
            raise self.error(e, "system() is only allowed as the first statements of the program",
                             "move it to the top of the function body")
        if target is MISSING:
            raise self.error(e, f"'{label}' is not defined when {self.name} is decorated",
                             f"define and decorate {label} with @prompt_program above {self.name}")
        if not isinstance(target, PromptProgram):
            raise self.error(e, f"'{label}' is not a prompt program; calls of other functions would be side effects",
                             f"decorate {label} with @prompt_program, or write its text out")
        if target.system_text:
            raise self.error(e, f"{target.name} has a system message, so it cannot be nested in a module",
                             f"move the system() call from {target.name} into {self.name}")
        if not target.body:
            raise self.error(e, f"{target.name} has no text, so it would be an empty module", "add text to it")
        for a in list(e.args) + [k.value for k in e.keywords]:
            if isinstance(a, ast.Starred):
                raise self.error(a, "*args in a program call is not supported", "pass each argument by name")
        if any(k.arg is None for k in e.keywords):
            raise self.error(e, "**kwargs in a program call is not supported", "pass each argument by name")
        try:
            bound = _bind(target, [self.argument(a) for a in e.args],
                          {k.arg: self.argument(k.value) for k in e.keywords})
        except TypeError as err:
            raise self.error(e, f"{target.name}(...): {err}",
                             f"parameters of {target.name}: {', '.join(p.name for p in target.params) or 'none'}"
                             ) from None
        bound = {k: v for k, v in bound.items() if isinstance(v, tuple)}  # only what the call passes
        callee_params = {p.name: p for p in target.params}
        for k, (how, v) in bound.items():
            if how == "param":
                self.forwards.setdefault(v, []).append(callee_params[k])
            else:
                self.check_literal(e, target, callee_params[k], v)
        return _Call(names.take(target.name), target, tuple(bound.items()))

    def check_literal(self, node, target: PromptProgram, p: ProgramParam, v) -> None:
        """A literal argument of a nested call is checked now, not when a call happens to select it."""
        problem = None
        if p.kind == "param" and v is not None and not isinstance(v, str):
            problem = f"a Param argument must be text, not {v!r}", f"write {p.name}=\"...\""
        elif p.kind == "flag" and not isinstance(v, bool):
            problem = f"'{p.name}' is a flag, so it must be True or False, not {v!r}", f"write {p.name}=True"
        elif p.kind == "choice" and v is not None and not p.open_choice and v not in p.choices:
            problem = (f"{p.name}={v!r} matches no case of '{p.name}'",
                       f"valid values: {', '.join(repr(c) for c in p.choices)}")
        if problem:
            raise self.error(node, f"{target.name}(...): {problem[0]}", problem[1])

    def argument(self, a) -> tuple[str, object]:
        if isinstance(a, ast.Name) and a.id in self.params:
            return ("param", a.id)
        if isinstance(a, ast.Constant) and (a.value is None or isinstance(a.value, (str, bool, int, float))):
            return ("const", a.value)
        raise self.error(a, f"the argument `{_src(a)}` is neither a parameter of {self.name} nor a literal",
                         "pass a parameter through (dest=dest) or a literal (overseas=True)")


def _bind(program: PromptProgram, args, kwargs: dict) -> dict:
    """Parameter name -> value for a call, as Python binds it (raises TypeError like Python).

    Omitted Params are MISSING rather than their default, so the schema's cached default text is
    used; other omitted parameters take their Python default.
    """
    bound = inspect.signature(program.func).bind_partial(*args, **kwargs).arguments
    env = {}
    for p in program.params:
        if p.name in bound:
            env[p.name] = bound[p.name]
        elif p.kind == "param":
            same = p.default is MISSING or p.default == p.spec.default
            env[p.name] = MISSING if same else p.default
        elif p.default is not MISSING:
            env[p.name] = p.default
        else:
            raise TypeError(f"missing a required argument: '{p.name}'")
    return env


def _param_spec(annotation) -> Param | None:
    if isinstance(annotation, Param):
        return annotation
    if typing.get_origin(annotation) is typing.Annotated:
        return next((m for m in typing.get_args(annotation)[1:] if isinstance(m, Param)), None)
    return None


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _src(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:
        return type(node).__name__


def _cond_src(c: _Cond) -> str:
    return {"flag": c.var, "not": f"not {c.var}"}.get(c.kind, f"{c.var} == {c.value!r}")


def _join(left: list, right: list) -> list:
    """Concatenate inline pieces exactly (no added space), merging adjacent text."""
    if left and right and isinstance(left[-1], _Text) and isinstance(right[0], _Text):
        return left[:-1] + [_Text(left[-1].text + right[0].text)] + right[1:]
    return left + right


def _append_inline(out: list, nodes: list) -> None:
    """Add one statement's nodes; consecutive text statements are separated by one space."""
    if not nodes:
        return
    if out and isinstance(out[-1], (_Text, _ParamRef)) and isinstance(nodes[0], (_Text, _ParamRef)):
        last, first = out[-1], nodes[0]
        gap = (isinstance(last, _Text) and last.text[-1:].isspace()) or (
            isinstance(first, _Text) and first.text[:1].isspace())
        joined = _join(out[-1:], ([] if gap else [_Text(" ")]))
        out[-1:] = joined
        out[-1:] = _join(out[-1:], nodes)
        return
    out.extend(nodes)
