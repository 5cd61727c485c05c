"""The compiler: a decorated function's body, read with :mod:`ast`, becomes a PromptProgram's nodes."""

from __future__ import annotations

import ast
import inspect
import re
import unicodedata

from engine.errors import PMLError, Problem
from engine.programs.binding import Refused, bind, check_argument
from engine.programs.model import MISSING, ProgramError, system
from engine.programs.nodes import Branch, Call, Choice, Cond, ParamRef
from engine.programs.program import PromptProgram
from engine.programs.source import Definition, function_node, src
from engine.programs.text import Inline, append_inline
from engine.programs.usage import Usage
from engine.schema.pml import ROLES, parse_schema

_SUGGEST_LOOP = ("a schema is fixed when it is compiled: write each alternative as an if/match branch, or pass "
                 "the varying text as a Param(len=N) argument")


def prompt_program(func=None, *, chat: bool = True):
    """Decorator: compile ``func``'s body into a PML schema; ``chat=False``: no role tags."""
    if func is None:
        return lambda f: compile_program(f, chat)
    return compile_program(func, chat)


def compile_program(func, chat: bool) -> PromptProgram:
    if isinstance(func, PromptProgram):
        raise ProgramError(Problem(func.source, func.line, 1, f"{func.name} is decorated twice",
                                   "use @prompt_program once"))
    if not inspect.isfunction(func):
        raise TypeError("@prompt_program decorates a function")
    source = inspect.getsourcefile(func) or func.__code__.co_filename
    return Compiler(Definition(func, function_node(func, source), source, chat)).program()


class Compiler:
    """One program's statements: text, system(), if / match chains and calls of other programs."""

    def __init__(self, defn: Definition):
        self.defn = defn
        self.usage = Usage(defn)
        self.text = Inline(defn, self.usage)
        self.system: list[str] = []
        self.content_started = False

    def program(self) -> PromptProgram:
        defn = self.defn
        body = self.body(defn.node.body, Names(), root=True)
        prog = PromptProgram(name=defn.name, func=defn.func, params=self.usage.params(), chat=defn.chat,
                             system_text=" ".join(self.system), body=tuple(body), source=defn.source,
                             line=defn.node.lineno, root_param_problem=_root_param_problem(defn, body))
        if prog.root_param_problem is None:
            self.check(prog)
        return prog

    def check(self, prog: PromptProgram) -> None:
        """The compiled schema must parse (else a compiler bug, reported at the `def`)."""
        try:
            parse_schema(prog.schema_xml(), f"{self.defn.source}:{self.defn.name}")
        except PMLError as err:
            raise self.defn.error(self.defn.node, f"{self.defn.name} compiled to an invalid schema: "
                                  f"{err.problems[0].message}", "please report this with the program") from None

    # -- statements ---------------------------------------------------------------------------

    def body(self, stmts, names: Names, root: bool = False) -> list:
        out: list = []
        params_here: set[str] = set()
        for st in stmts:
            if root and self.text.is_system(st):
                if self.content_started:
                    raise self.defn.error(st, "system() must come before any other text",
                                          "move the system(...) call to the top of the function")
                self.system.append(self.text.system_text(st))
                continue
            self.content_started = True
            nodes = self.statement(st, names)
            for n in nodes:
                if isinstance(n, ParamRef):
                    if n.name in params_here:
                        raise self.defn.error(st, f"'{n.name}' is interpolated twice in one module",
                                              "a PML param appears once per module: move one use into a nested "
                                              "if block or a nested program")
                    params_here.add(n.name)
            append_inline(out, nodes)
        return out

    def statement(self, st, names: Names) -> list:
        error = self.defn.error
        if isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)
                                         and st.value.value is Ellipsis):
            return []
        if isinstance(st, ast.Expr):
            return [self.call(st.value, names)] if isinstance(st.value, ast.Call) else self.text.expression(st.value)
        if isinstance(st, ast.If):
            return [self.if_chain(st, names)]
        if isinstance(st, ast.Match):
            return [self.match(st, names)]
        if isinstance(st, (ast.For, ast.While, ast.AsyncFor)):
            raise error(st, "loops are not supported in a prompt program", _SUGGEST_LOOP)
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            raise error(st, "assignments are not supported in a prompt program",
                        "a program only declares text: use the parameter itself, or a nested program")
        if isinstance(st, ast.Return):
            raise error(st, "return is not supported in a prompt program",
                        "remove it: the program is its text; use if/else for alternatives")
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise error(st, "nested definitions are not supported in a prompt program",
                        "define it at module level and decorate it with @prompt_program")
        kind = type(st).__name__.lower()
        raise error(st, f"'{kind}' statements are not supported in a prompt program",
                    "a program body holds text, if/elif/else, match and calls of other prompt programs")

    # -- if / match ---------------------------------------------------------------------------

    def if_chain(self, st: ast.If, names: Names) -> Choice:
        tests: list[tuple[Cond | None, list, object]] = []
        node = st
        while True:
            tests.append((self.usage.condition(node.test), node.body, node))
            if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
                node = node.orelse[0]  # elif (or `else:` holding just an `if`, which means the same)
                continue
            if node.orelse:
                tests.append((None, node.orelse, node.orelse[0]))
            break
        return self.choice(tests, names)

    def match(self, st: ast.Match, names: Names) -> Choice:
        error = self.defn.error
        if not isinstance(st.subject, ast.Name):
            raise error(st.subject, f"`match {src(st.subject)}` does not match a parameter",
                        "write `match param:` with one of the program's parameters")
        var = st.subject.id
        tests: list = []
        for case in st.cases:
            p = case.pattern
            if case.guard is not None:
                raise error(case.guard, "case guards (`case ... if ...`) are not supported",
                            "nest an if block inside the case")
            if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant) and isinstance(p.value.value, str):
                tests.append((Cond(self.usage.selector(st.subject, var, "choice"), "eq", p.value.value), case.body, p))
            elif isinstance(p, ast.MatchAs) and p.pattern is None and p.name is None:
                self.usage.selector(st.subject, var, "choice")
                tests.append((None, case.body, p))
            else:
                raise error(p, f"the pattern `{src(p)}` is not supported",
                            "use string literals (`case \"kyoto\":`) and `case _:`; one value per case")
        return self.choice(tests, names)

    def choice(self, tests: list, names: Names) -> Choice:
        """A chain's branches, each a module named by its test (empty ones import nothing)."""
        self.usage.cases(tests)
        conds = [c for c, _, _ in tests if c is not None]
        branches = []
        for cond, body_stmts, _ in tests:
            body = self.body(body_stmts, Names())
            if not body:
                branches.append(Branch(cond, None, ()))
            else:
                branches.append(Branch(cond, names.take(_branch_name(cond, conds)), tuple(body)))
        return Choice(tuple(branches))

    # -- calls --------------------------------------------------------------------------------

    def call(self, e: ast.Call, names: Names) -> Call:
        """A call of another prompt program: a nested module; its literal arguments are checked now."""
        error, target, label = self.defn.error, self.defn.resolve(e.func), src(e.func)
        if target is system:
            raise error(e, "system() is only allowed as the first statements of the program",
                        "move it to the top of the function body")
        if target is MISSING:
            raise error(e, f"'{label}' is not defined when {self.defn.name} is decorated",
                        f"define and decorate {label} with @prompt_program above {self.defn.name}")
        if not isinstance(target, PromptProgram):
            raise error(e, f"'{label}' is not a prompt program; calls of other functions would be side effects",
                        f"decorate {label} with @prompt_program, or write its text out")
        if target.system_text:
            raise error(e, f"{target.name} has a system message, so it cannot be nested in a module",
                        f"move the system() call from {target.name} into {self.defn.name}")
        if not target.body:
            raise error(e, f"{target.name} has no text, so it would be an empty module", "add text to it")
        for a in list(e.args) + [k.value for k in e.keywords]:
            if isinstance(a, ast.Starred):
                raise error(a, "*args in a program call is not supported", "pass each argument by name")
        if any(k.arg is None for k in e.keywords):
            raise error(e, "**kwargs in a program call is not supported", "pass each argument by name")
        args, kwargs = [self.argument(a) for a in e.args], {k.arg: self.argument(k.value) for k in e.keywords}
        callee_params = {p.name: p for p in target.params}
        try:
            bound = bind(target, args, kwargs, f"{target.name}(...)")
            bound = {k: v for k, v in bound.items() if isinstance(v, tuple)}  # only what the call passes
            for k, (how, v) in bound.items():
                if how == "param":
                    self.usage.forwards.setdefault(v, []).append(callee_params[k])
                else:
                    check_argument(callee_params[k], v, f"{target.name}(...): {k}={v!r}")
        except Refused as err:
            raise error(e, *err.args) from None
        return Call(names.take(target.name), target, tuple(bound.items()))

    def argument(self, a) -> tuple[str, object]:
        if isinstance(a, ast.Name) and a.id in self.usage:
            return ("param", a.id)
        if isinstance(a, ast.Constant) and (a.value is None or isinstance(a.value, (str, bool, int, float))):
            return ("const", a.value)
        raise self.defn.error(a, f"the argument `{src(a)}` is neither a parameter of {self.defn.name} nor a literal",
                              "pass a parameter through (dest=dest) or a literal (overseas=True)")


class Names:
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


def _branch_name(cond: Cond | None, conds: list[Cond]) -> str:
    """The module name a branch's test gives it, before siblings' suffixes (``else``: from the chain's tests)."""
    if cond is None:
        only = conds[0] if len(conds) == 1 else None
        if only is not None and only.kind == "flag":
            return f"not-{only.var}"
        if only is not None and only.kind == "not":
            return only.var
        return f"{conds[0].var}-other"
    if cond.kind == "flag":
        return cond.var
    if cond.kind == "not":
        return f"not-{cond.var}"
    return _ident(cond.value, f"{cond.var}-empty")


def _ident(value: str, fallback: str) -> str:
    """A case value as a module name: ASCII-folded, other characters → '-'."""
    ascii_ = unicodedata.normalize("NFKD", value).encode("ascii", "ignore").decode()
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", ascii_).strip("-.")
    if not s:
        return fallback
    return s if re.match(r"[A-Za-z_]", s) else "_" + s


def _root_param_problem(defn: Definition, body: list) -> Problem | None:
    """A program whose top level interpolates a Param can only be nested: the problem its schema reports."""
    root_params = [n for n in body if isinstance(n, ParamRef)]
    if not root_params:
        return None
    return Problem(defn.source, defn.node.lineno, defn.node.col_offset + 1,
                   f"{defn.name} interpolates '{root_params[0].name}' outside any module; as a schema its top level "
                   "is fixed text, so it can only be used as a nested program",
                   f"call {defn.name}(...) from another program (it becomes a module), or move the text into an if "
                   "block")
