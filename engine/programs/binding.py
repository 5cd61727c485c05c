"""A call's arguments: bound as Python binds them, checked once, and turned into imports."""

from __future__ import annotations

import inspect

from engine.programs.model import MISSING, ProgramParam, Selected
from engine.programs.nodes import Call, Callee, Choice, ParamRef
from engine.programs.xmltext import xml_safe


class Refused(Exception):
    """Arguments a program cannot take: ``args`` are (message, hint)."""


def bind(program: Callee, args, kwargs: dict, call: str) -> dict:
    """Parameter name -> value for a call; an omitted Param is MISSING so its cached default is used."""
    try:
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
    except TypeError as err:
        raise Refused(f"{call}: {err}",
                      f"parameters of {program.name}: {', '.join(p.name for p in program.params) or 'none'}") from None
    return env


def check_argument(p: ProgramParam, v, shown: str) -> None:
    """Raise Refused unless ``v`` fits ``p``'s kind (text, a bool, or one of its case values)."""
    if p.kind == "param" and v is not MISSING and v is not None and not (isinstance(v, str) and xml_safe(v)):
        raise Refused(f"{shown}: a Param argument must be text without control characters",
                      f"pass {p.name}=\"...\" (None or nothing: the param's default)")
    if p.kind == "flag" and not isinstance(v, bool):
        raise Refused(f"{shown}: '{p.name}' selects a module with `if {p.name}:`, so it must be True or False",
                      f"pass {p.name}=True or False")
    if p.kind == "choice" and v is not None and not p.open_choice and v not in p.choices:
        raise Refused(f"{shown} matches no case of '{p.name}'",
                      f"valid values: {', '.join(repr(c) for c in p.choices)}")


def select(program: Callee, nodes, env: dict) -> list[Selected]:
    """The imports ``nodes`` make for a call whose arguments are ``env``."""
    out: list[Selected] = []
    for n in nodes:
        if isinstance(n, Choice):
            branch = next((b for b in n.branches if b.cond is None or b.cond.holds(env)), None)
            if branch is not None and branch.name is not None:
                out.append(_module_import(program, branch.name, branch.body, env))
        elif isinstance(n, Call):
            callee = n.program
            kwargs = {k: (env[v] if how == "param" else v) for k, (how, v) in n.args}
            kwargs = {k: v for k, v in kwargs.items() if v is not MISSING}
            out.append(_module_import(callee, n.name, callee.body, callee._env((), kwargs)))
    return out


def _module_import(program: Callee, name: str, body, env: dict) -> Selected:
    args: list[tuple[str, str]] = []
    for n in body:
        if isinstance(n, ParamRef):
            v = env[n.name]
            if v is MISSING:
                if n.default is None:
                    raise program._problem(f"{program.name}() needs an argument for '{n.name}': module '{name}' "
                                           "is imported and the param has no default",
                                           f"pass {n.name}=\"...\" or give it Param(len={n.spec.len}, default=...)")
                continue
            args.append((n.name, v))
    return Selected(name, tuple(args), tuple(select(program, body, env)))
