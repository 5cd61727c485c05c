"""XML emission of compiled programs: text and attribute escaping, and the schema's pretty-printing."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from engine.programs.nodes import Call, Choice, ParamRef, Text


def xml_safe(text: str) -> bool:
    """True when XML can hold every character of ``text``."""
    return all(xml_char(c) for c in text)


def xml_char(c: str) -> bool:
    o = ord(c)
    return o in (0x9, 0xA, 0xD) or 0x20 <= o <= 0xD7FF or 0xE000 <= o <= 0xFFFD or 0x10000 <= o <= 0x10FFFF


def text_xml(text: str) -> str:
    return escape(text, {"\r": "&#13;"})


def emit(nodes, depth: int, lines: list[str]) -> None:
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
