"""A program's text statements: literals, Params and `+` chains."""

from __future__ import annotations

import ast

from engine.programs.model import system
from engine.programs.nodes import ParamRef, Text
from engine.programs.source import Definition, src
from engine.programs.usage import Usage
from engine.programs.xmltext import xml_char


class Inline:
    """A program's string expressions compiled to text and param nodes."""

    def __init__(self, defn: Definition, usage: Usage):
        self.defn = defn
        self.usage = usage

    def expression(self, e) -> list:
        """Text and params of a string statement."""
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [Text(self.checked(e, e.value))] if e.value else []
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
            left, right = self.expression(e.left), self.expression(e.right)
            return join(left, right)
        if isinstance(e, ast.Name) and e.id in self.usage:
            return [self.usage.text(e)]
        if isinstance(e, ast.JoinedStr):
            raise self.defn.error(e, "f-strings are not supported: their value is unknown when the schema is compiled",
                                  "annotate the parameter with Param(len=N) and concatenate: \"a trip of \" + duration")
        if isinstance(e, ast.Name):
            raise self.defn.error(e, f"'{e.id}' is not a parameter of {self.defn.name}",
                                  "text must be string literals; interpolate parameters annotated with Param(len=N)")
        raise self.defn.error(e, f"the expression `{src(e)}` is not supported in a prompt program",
                              "write text as string literals, joined with + to Param parameters")

    def checked(self, node, text: str) -> str:
        """``text``, refused when XML cannot hold it."""
        bad = next((c for c in text if not xml_char(c)), None)
        if bad is not None:
            raise self.defn.error(node, f"the text contains the character {bad!r}, which XML cannot hold",
                                  "remove control characters from the text")
        return text

    def is_system(self, st) -> bool:
        return (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
                and self.defn.resolve(st.value.func) is system)

    def system_text(self, st) -> str:
        """The text of a ``system("...")`` statement."""
        call = st.value
        if not self.defn.chat:
            raise self.defn.error(st, "system() needs chat-role tags, but the program says chat=False",
                                  "remove chat=False or write the text as a string statement")
        if call.keywords or not call.args:
            raise self.defn.error(st, "system() takes the text as its only argument",
                                  "write system(\"You are ...\")")
        parts = []
        for a in call.args:
            nodes = self.expression(a)
            if any(isinstance(n, ParamRef) for n in nodes):
                raise self.defn.error(a, "the system message cannot hold a Param (params live inside modules)",
                                      "move the parameterised text into the body")
            parts += nodes
        return " ".join(n.text for n in parts if isinstance(n, Text)).strip()


def join(left: list, right: list) -> list:
    """Concatenate pieces exactly, merging adjacent text."""
    if left and right and isinstance(left[-1], Text) and isinstance(right[0], Text):
        return left[:-1] + [Text(left[-1].text + right[0].text)] + right[1:]
    return left + right


def append_inline(out: list, nodes: list) -> None:
    """Add one statement's nodes, one space after the previous statement's."""
    if not nodes:
        return
    if out and isinstance(out[-1], (Text, ParamRef)) and isinstance(nodes[0], (Text, ParamRef)):
        last, first = out[-1], nodes[0]
        gap = (isinstance(last, Text) and last.text[-1:].isspace()) or (
            isinstance(first, Text) and first.text[:1].isspace())
        joined = join(out[-1:], ([] if gap else [Text(" ")]))
        out[-1:] = joined
        out[-1:] = join(out[-1:], nodes)
        return
    out.extend(nodes)
