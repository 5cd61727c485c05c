"""A compiled program's schema, pretty-printed as XML."""

from __future__ import annotations

from xml.sax.saxutils import quoteattr

from engine.programs.nodes import Call, Choice, ParamRef, Text
from engine.programs.xmltext import text_xml


def emit(nodes, depth: int, lines: list[str]) -> None:
    """Each run of text and params on one line, elements on their own (PML collapses the indentation)."""
    pad = "  " * depth
    inline: list[str] = []

    def flush():
        if inline:
            lines.append(pad + "".join(inline))
            inline.clear()

    for n in nodes:
        if isinstance(n, Text):
            inline.append(text_xml(n.text))
        elif isinstance(n, ParamRef):
            inline.append(_param_xml(n))
        elif isinstance(n, Call):
            flush()
            _emit_module(n.name, n.program.body, depth, lines)
        elif isinstance(n, Choice):
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


def _param_xml(ref: ParamRef) -> str:
    default = f" default={quoteattr(ref.default)}" if ref.default is not None else ""
    return f"<param name={quoteattr(ref.name)} len=\"{ref.spec.len}\"{default}/>"


def _emit_module(name: str, body, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    if not body:
        lines.append(f"{pad}<module name={quoteattr(name)}/>")
        return
    lines.append(f"{pad}<module name={quoteattr(name)}>")
    emit(body, depth + 1, lines)
    lines.append(f"{pad}</module>")
