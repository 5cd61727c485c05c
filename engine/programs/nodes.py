"""What a program body compiles to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from engine.programs.model import Param, ProgramError, ProgramParam


class Callee(Protocol):
    """What the nodes read of a ``PromptProgram``, which imports them."""

    name: str
    func: Callable
    params: tuple[ProgramParam, ...]
    body: tuple

    def _problem(self, message: str, hint: str = "") -> ProgramError: ...


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class ParamRef:
    name: str
    spec: Param
    default: str | None


@dataclass(frozen=True)
class Cond:
    """A test of one parameter: flag, not or eq."""

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

    def source(self) -> str:
        """The test as written."""
        return {"flag": self.var, "not": f"not {self.var}"}.get(self.kind, f"{self.var} == {self.value!r}")


@dataclass(frozen=True)
class Branch:
    cond: Cond | None  # None: else
    name: str | None  # None: only `pass`
    body: tuple


@dataclass(frozen=True)
class Choice:
    """An if/elif/else chain or a match."""

    branches: tuple[Branch, ...]

    def members(self) -> list[Branch]:
        return [b for b in self.branches if b.name is not None]


@dataclass(frozen=True)
class Call:
    """A call of another program: a nested module."""

    name: str
    program: Callee
    args: tuple[tuple[str, tuple[str, object]], ...]  # (callee param, ("param" | "const", value))


def walk_calls(nodes):
    """Every nested call in ``nodes``, depth first."""
    for n in nodes:
        if isinstance(n, Call):
            yield n
            yield from walk_calls(n.program.body)
        elif isinstance(n, Choice):
            for b in n.branches:
                yield from walk_calls(b.body)
