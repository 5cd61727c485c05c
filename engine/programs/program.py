"""A compiled prompt program: its schema, and the prompt a call of it makes."""

from __future__ import annotations

import os
import sys
import typing
from dataclasses import dataclass, field
from xml.sax.saxutils import quoteattr

from engine.errors import Problem
from engine.programs.binding import Refused, bind, check_argument, select
from engine.programs.emit import emit
from engine.programs.model import MISSING, ProgramCall, ProgramError, ProgramParam
from engine.programs.xmltext import text_xml, xml_safe

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, eq=False)
class PromptProgram:
    """A compiled prompt program (what ``@prompt_program`` returns)."""

    name: str
    func: typing.Callable = field(repr=False)
    params: tuple[ProgramParam, ...]
    chat: bool
    system_text: str
    body: tuple = field(repr=False)  # compiled nodes
    source: str  # its file
    line: int  # of its `def`
    root_param_problem: Problem | None = field(default=None, repr=False)

    def schema_xml(self) -> str:
        """The program's PML schema."""
        if self.root_param_problem:
            raise ProgramError(self.root_param_problem)
        lines = [f"<schema name={quoteattr(self.name)}>"]
        if self.system_text:
            lines.append(f"  <system>{text_xml(self.system_text)}</system>")
        if self.chat:
            if self.body:
                lines.append("  <user>")
                emit(self.body, 2, lines)
                lines.append("  </user>")
        else:
            emit(self.body, 1, lines)
        lines.append("</schema>")
        return "\n".join(lines) + "\n"

    def bind(self, *args, question: str | None = None, **kwargs) -> ProgramCall:
        """The imports a call with these arguments selects."""
        if self.root_param_problem:
            raise ProgramError(self.root_param_problem)
        env = self._env(args, kwargs)
        if question is not None and (not isinstance(question, str) or not xml_safe(question)):
            raise self._problem(f"{self.name}(question={question!r}): the question must be text without control "
                                "characters", "pass question=\"...\"")
        return ProgramCall(self.name, tuple(select(self, self.body, env)), question)

    def prompt_xml(self, *args, question: str | None = None, **kwargs) -> str:
        """The PML prompt for a call."""
        return self.bind(*args, question=question, **kwargs).prompt_xml()

    __call__ = prompt_xml

    # -- internal -----------------------------------------------------------------------------

    def _problem(self, message: str, hint: str = "") -> ProgramError:
        """A call-time error, located at the caller's line."""
        frame = sys._getframe(1)
        while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE:
            frame = frame.f_back
        source, line = (frame.f_code.co_filename, frame.f_lineno) if frame else (self.source, self.line)
        return ProgramError(Problem(source, line, 1, message, hint))

    def _env(self, args: tuple, kwargs: dict) -> dict:
        """Bind and check a call's arguments."""
        try:
            env = bind(self, args, kwargs, f"{self.name}()")
            for p in self.params:
                if p.kind == "param" and env[p.name] is None:
                    env[p.name] = MISSING  # None: the param's default
                check_argument(p, env[p.name], f"{self.name}({p.name}={env[p.name]!r})")
        except Refused as err:
            raise self._problem(*err.args) from None
        return env
