"""The values of prompt programs."""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import quoteattr

from engine.errors import PMLError
from engine.programs.xmltext import text_xml


class ProgramError(PMLError):
    """A prompt program that cannot be compiled or called."""


@dataclass(frozen=True)
class Param:
    """Annotation of a text parameter of at most ``len`` tokens."""

    len: int
    default: str | None = None

    def __post_init__(self):
        if not isinstance(self.len, int) or isinstance(self.len, bool) or self.len <= 0:
            raise ValueError(f"Param(len={self.len!r}): len must be a positive whole number of tokens")
        if self.default is not None and not isinstance(self.default, str):
            raise ValueError(f"Param(default={self.default!r}): a default must be text")


def system(*text: str) -> None:
    """Sets the system message inside a prompt program; never called."""
    raise RuntimeError("system() only has a meaning inside a @prompt_program function")


@dataclass(frozen=True)
class ProgramParam:
    """One parameter of a program and how its body uses it."""

    name: str
    kind: str  # "param" | "flag" | "choice" | "value"
    spec: Param | None
    default: object  # or MISSING
    choices: tuple[str, ...] = ()
    open_choice: bool = False  # has else / case _


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
    """A call of a program: what it imports, and the question."""

    schema: str
    imports: tuple[Selected, ...]
    question: str | None = None

    def prompt_xml(self) -> str:
        """The PML prompt."""
        lines = [f"<prompt schema={quoteattr(self.schema)}>"]
        lines += ["  " + s.xml() for s in self.imports]
        if self.question and self.question.strip():
            lines.append("  " + text_xml(self.question.strip()))
        lines.append("</prompt>")
        return "\n".join(lines) + "\n"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()
