"""What each parameter of a program is: from its signature, its uses in the body, and the calls it feeds."""

from __future__ import annotations

import ast
import inspect
import typing

from engine.programs.binding import Refused, check_argument
from engine.programs.model import MISSING, Param, ProgramParam
from engine.programs.nodes import Cond, ParamRef
from engine.programs.source import Definition, src
from engine.schema.pml import IDENT

_CONDITION_HINT = "conditions test a parameter: `if flag:`, `if not flag:` or `if x == \"value\":`"


class Usage:
    """The parameters of one program as its body compiles."""

    def __init__(self, defn: Definition):
        self.defn = defn
        self.signature = read_signature(defn)
        self.kinds: dict[str, str] = {}  # "flag" | "choice" | "param-text"
        self.choices: dict[str, list[str]] = {}
        self.open_choices: set[str] = set()
        self.forwards: dict[str, list[ProgramParam]] = {}  # to the callee parameters it is passed to

    def __contains__(self, name: str) -> bool:
        return name in self.signature

    def params(self) -> tuple[ProgramParam, ...]:
        """Every parameter with its final kind."""
        out = []
        for name, (spec, default, _) in self.signature.items():
            used = self.kinds.get(name)
            kind = "param" if spec is not None else {"flag": "flag", "choice": "choice"}.get(used, "value")
            p = ProgramParam(name, kind, spec, default, tuple(self.choices.get(name, ())), name in self.open_choices)
            out.append(inherit(p, self.forwards.get(name, [])))
        return tuple(out)

    def condition(self, test) -> Cond:
        """The test of an `if` / `elif`."""
        if isinstance(test, ast.Name):
            return Cond(self.selector(test, test.id, "flag"), "flag")
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name):
            return Cond(self.selector(test, test.operand.id, "flag"), "not")
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            a, b = test.left, test.comparators[0]
            if isinstance(b, ast.Name) and isinstance(a, ast.Constant):
                a, b = b, a
            if isinstance(a, ast.Name) and isinstance(b, ast.Constant) and isinstance(b.value, str):
                var = self.selector(test, a.id, "choice")
                return Cond(var, "eq", b.value)
            raise self.defn.error(test, f"the condition `{src(test)}` does not compare a parameter with a string",
                                  _CONDITION_HINT)
        if isinstance(test, ast.BoolOp):
            raise self.defn.error(test, f"`{src(test)}`: and/or conditions are not supported",
                                  "nest the if blocks (`if a:` then `if b:` inside), each becomes a module")
        raise self.defn.error(test, f"the condition `{src(test)}` is not supported", _CONDITION_HINT)

    def selector(self, node, var: str, kind: str) -> str:
        """``var`` used as a ``kind`` ("flag" or "choice"), checked against its other uses."""
        error = self.defn.error
        if var not in self.signature:
            raise error(node, f"the condition tests '{var}', which is not a parameter of {self.defn.name}",
                        "conditions may only test the program's parameters (the call decides what is imported)")
        spec, _, ann = self.signature[var]
        if spec is not None:
            raise error(node, f"'{var}' is a Param (text) and cannot select a module",
                        "use a bool or str parameter for the condition")
        if kind == "choice" and ann is bool:
            raise error(node, f"'{var}' is a bool but is compared with a string", f"write `if {var}:`")
        if kind == "flag" and ann is str:
            raise error(node, f"'{var}' is a str; `if {var}:` would test whether it is empty",
                        f"compare it: `if {var} == \"value\":`, or annotate it bool")
        seen = self.kinds.setdefault(var, kind)
        if seen != kind:
            raise error(node, f"'{var}' is used both as a flag (`if {var}:`) and compared with values",
                        "use one form for each parameter")
        return var

    def text(self, e: ast.Name) -> ParamRef:
        """Parameter ``e`` interpolated into the text: a Param, never a condition."""
        spec, _, _ = self.signature[e.id]
        if spec is None:
            raise self.defn.error(e, f"'{e.id}' is interpolated into the text but is not a Param",
                                  f"annotate it: {e.id}: Param(len=N) (N = the most tokens it may have)")
        if self.kinds.get(e.id, "param-text") != "param-text":
            raise self.defn.error(e, f"'{e.id}' is used both as text and as a condition", "use two parameters")
        self.kinds[e.id] = "param-text"
        return ParamRef(e.id, spec, spec.default)

    def cases(self, tests: list) -> None:
        """Record the values a chain's tests compare with."""
        seen: set[tuple] = set()
        for c, _, node in tests:
            if c is not None:
                key = (c.var, c.kind, c.value)
                if key in seen:
                    raise self.defn.error(node, f"`{c.source()}` is tested twice in one chain",
                                          "the second branch could never be chosen: merge the two")
                seen.add(key)
                if c.kind == "eq" and c.value not in self.choices.setdefault(c.var, []):
                    self.choices[c.var].append(c.value)
        if tests[-1][0] is None:
            for c, _, _ in tests:
                if c is not None and c.kind == "eq":
                    self.open_choices.add(c.var)


def read_signature(defn: Definition) -> dict[str, tuple[Param | None, object, object]]:
    """name -> (Param spec, Python default, annotation), each checked."""
    error, name, node = defn.error, defn.name, defn.node
    if not IDENT.match(name):
        raise error(node, f"'{name}' is not a valid PML name", "use ASCII letters, digits and '_'")
    try:
        sig = inspect.signature(defn.func, eval_str=True)
    except Exception as err:
        raise error(node, f"cannot read the annotations of {name}: {err}",
                    "annotate text parameters with Param(len=N) from engine.programs") from None
    args = {a.arg: a for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
    out = {}
    for p in sig.parameters.values():
        where = args.get(p.name, node)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise error(where, f"*{p.name} / **{p.name} parameters are not supported",
                        "name every parameter: the schema is compiled from the signature")
        if not IDENT.match(p.name):
            raise error(where, f"parameter '{p.name}' is not a valid PML name", "use ASCII letters and '_'")
        if p.name == "question":
            raise error(where, "the parameter name 'question' is reserved for the prompt's trailing text",
                        "rename the parameter")
        spec = _param_spec(p.annotation)
        default = MISSING if p.default is p.empty else p.default
        if spec is not None and default is not MISSING:
            if not isinstance(default, str):
                raise error(where, f"the default of Param '{p.name}' must be text", "write = \"...\"")
            if spec.default is not None and spec.default != default:
                raise error(where, f"Param '{p.name}' has two different defaults",
                            "give the default once, as Param(len=N, default=\"...\")")
            spec = Param(spec.len, default)
        out[p.name] = (spec, default, p.annotation)
    return out


def inherit(p: ProgramParam, targets: list[ProgramParam]) -> ProgramParam:
    """Widen a parameter's kind by the callee parameters it is passed on to."""
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
        try:
            check_argument(t, p.default, f"{p.name}={p.default!r}")
        except Refused:
            return p  # passed on as given; the nested call reports it
        return ProgramParam(p.name, "param", t.spec, p.default)
    choices = tuple(dict.fromkeys(c for t in targets for c in t.choices))
    return ProgramParam(p.name, t.kind, None, p.default, choices, any(t.open_choice for t in targets))


def _param_spec(annotation) -> Param | None:
    if isinstance(annotation, Param):
        return annotation
    if typing.get_origin(annotation) is typing.Annotated:
        return next((m for m in typing.get_args(annotation)[1:] if isinstance(m, Param)), None)
    return None
