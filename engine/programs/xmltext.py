"""Text as XML, shared by the program model and the emitter."""

from __future__ import annotations

from xml.sax.saxutils import escape


def xml_safe(text: str) -> bool:
    """Whether XML can hold ``text``."""
    return all(xml_char(c) for c in text)


def xml_char(c: str) -> bool:
    o = ord(c)
    return o in (0x9, 0xA, 0xD) or 0x20 <= o <= 0xD7FF or 0xE000 <= o <= 0xFFFD or 0x10000 <= o <= 0x10FFFF


def text_xml(text: str) -> str:
    return escape(text, {"\r": "&#13;"})
