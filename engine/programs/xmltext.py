"""Text as XML: which characters XML can hold, and escaping text for an element. The bottom of the programs
package (it imports none of it), so the program model and the emitter both read it."""

from __future__ import annotations

from xml.sax.saxutils import escape


def xml_safe(text: str) -> bool:
    """True when XML can hold every character of ``text``."""
    return all(xml_char(c) for c in text)


def xml_char(c: str) -> bool:
    o = ord(c)
    return o in (0x9, 0xA, 0xD) or 0x20 <= o <= 0xD7FF or 0xE000 <= o <= 0xFFFD or 0x10000 <= o <= 0x10FFFF


def text_xml(text: str) -> str:
    return escape(text, {"\r": "&#13;"})
