"""Where a problem is in a PML document's text, as an editor shows it: line and column of the character to fix.

lxml reports an element by the line its start tag *ends* on and a syntax error where its parser gave up (often a
line after the real slip: a missing '>' is reported at the next word). This module scans the text itself: every
start tag with the offsets of its name and attributes (in document order, as lxml's elements), and for a document
lxml refuses, the first slip a user would fix: a start tag left open, an attribute without quotes or without its
closing quote, an element never closed, an end tag that closes nothing.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

NAME = r"[A-Za-z_:][\w.:-]*"
_SKIP = re.compile(r"<!--.*?(?:-->|\Z)|<!\[CDATA\[.*?(?:\]\]>|\Z)|<\?.*?(?:\?>|\Z)|<!(?!--|\[CDATA\[)[^>]*>?", re.S)
_ATTR = re.compile(rf"\s+({NAME})(\s*=\s*)?")
_NEXT_ATTR = re.compile(rf"\s+{NAME}\s*=")
_NAME = re.compile(NAME)
_END_TAG = re.compile(rf"</({NAME})\s*>")
_TAG_END = re.compile(r"\s*(/?>)")
_QUOTED = re.compile(rf"""\s+({NAME})\s*=\s*(?:"([^"<]*)"|'([^'<]*)')""")  # an attribute read whole


@dataclass(frozen=True)
class Tag:
    """A start tag: offset of its '<', its name, {attribute: (offset of the name, offset of the value)}."""

    start: int
    name: str
    attrs: dict
    end: int = -1  # offset after its '>' (-1: never closed)
    empty: bool = False  # written <x/>


@dataclass(frozen=True)
class Slip:
    """The first syntax slip found: its offset and what to say."""

    offset: int
    message: str
    hint: str


class Lines:
    """One text's line index, built once: a problem's offset becomes its line and column by a binary search, so
    reporting many problems costs no more than reading the text once."""

    def __init__(self, text: str):
        self.text = text
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]  # offset of each line's first character

    def at(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of ``offset``; columns count characters, as an editor does."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self.starts, offset)
        return line, offset - self.starts[line - 1] + 1

    def line(self, number: int) -> str:
        """The text of 1-based line ``number`` ('' past the end), without its newline."""
        if not 1 <= number <= len(self.starts):
            return ""
        end = self.starts[number] - 1 if number < len(self.starts) else len(self.text)
        return self.text[self.starts[number - 1]:end]

    def char_col(self, line: int, byte_col: int) -> int:
        """libxml2's column (bytes of UTF-8 from the line's start) as a character column."""
        if not 1 <= line <= len(self.starts):
            return max(byte_col, 1)
        raw = self.line(line).encode("utf-8")[:max(byte_col - 1, 0)]
        return len(raw.decode("utf-8", errors="ignore")) + 1


def start_tags(text: str) -> list[Tag]:
    """Every well-formed start tag of ``text`` in document order (comments, CDATA and PIs skipped)."""
    return [t for t in _scan(text)[0] if t.end >= 0]


def first_slip(lines: Lines) -> Slip | None:
    """The first slip of a document lxml refused, or None when the scan finds none (lxml's position then)."""
    tags, slip, events = _scan(lines.text)
    return slip or _nesting(lines, events)


def _scan(text: str):
    """(start tags, the first slip inside a tag, [(kind, offset, name)] of start/end tags in order)."""
    tags: list[Tag] = []
    events: list[tuple[str, int, str]] = []
    pos = 0
    while (lt := text.find("<", pos)) >= 0:
        skip = _SKIP.match(text, lt)
        if skip:
            pos = skip.end()
            continue
        end_tag = _END_TAG.match(text, lt)
        if end_tag:
            events.append(("end", lt, end_tag.group(1)))
            pos = end_tag.end()
            continue
        name = _NAME.match(text, lt + 1)
        if not name:
            return tags, Slip(lt, "a '<' that starts no tag", "in text write &lt; or wrap the text in "
                              "<![CDATA[ ... ]]>; a tag starts with its name: <module ...>"), events
        tag, slip = _tag(text, lt, name)
        tags.append(tag)
        if slip:
            return tags, slip, events
        events.append(("empty" if tag.empty else "start", lt, tag.name))
        pos = tag.end
    return tags, None, events


def _tag(text: str, lt: int, name) -> tuple[Tag, Slip | None]:
    """The start tag at ``lt``, walked attribute by attribute, and the slip that ends the walk early."""
    attrs: dict[str, tuple[int, int]] = {}
    pos, tag_name, last = name.end(), name.group(), None  # last: the match of the last attribute read
    while (a := _QUOTED.match(text, pos)) is not None:
        attrs[a.group(1)] = (a.start(1), a.start(a.lastindex))
        pos, last = a.end(), a
    m = _TAG_END.match(text, pos)
    if m:
        return Tag(lt, tag_name, attrs, m.end(), m.group(1) == "/>"), None
    return Tag(lt, tag_name, attrs), _slip_in_tag(text, tag_name, pos, last)


def _slip_in_tag(text: str, tag_name: str, pos: int, last) -> Slip:
    """Why the start tag stops being read at ``pos``: an attribute without quotes or without its closing quote,
    or a word that is no attribute (a quote or the '>' was forgotten)."""
    last = None if last is None else (last.group(1), last.start(last.lastindex), text[last.start(last.lastindex) - 1])
    a = _ATTR.match(text, pos)
    if not a or not a.group(2):
        return _broken(text, tag_name, pos, last)
    value, quote = a.end(), text[a.end():a.end() + 1]
    if quote not in ("'", '"'):
        return Slip(value, f"the value of {a.group(1)}= has no quotes", f"write {a.group(1)}=\"value\"")
    return _broken(text, tag_name, pos, (a.group(1), value + 1, quote), True)  # ran into the next tag


def _broken(text: str, tag: str, pos: int, last, runaway: bool = False) -> Slip:
    """The slip of a start tag that stopped parsing at ``pos``: the last value's closing quote, else its '>'."""
    if last is not None:
        attr, value, quote = last
        close = text.find(quote, value)
        cut = _runaway(text[value:] if runaway or close < 0 else text[value:close])
        if cut is not None:
            return Slip(value + cut, f"the value of {attr}= is not closed: its closing {quote} is missing here",
                        f"write {attr}={quote}value{quote}")
    return Slip(pos, f"the start tag <{tag}> is not closed: '>' is missing here",
                f"end the tag with '>' (or '/>' for an empty element): <{tag} ...>")


def _runaway(inner: str) -> int | None:
    """Where a quoted value ran past its end (into a newline, a tag or the next attribute), else None."""
    cuts = [i for i in (inner.find("\n"), inner.find("<"), inner.find(">")) if i >= 0]
    nxt = _NEXT_ATTR.search(inner)
    if nxt:
        cuts.append(nxt.start())
    return min(cuts) if cuts else None


def _nesting(lines: Lines, events) -> Slip | None:
    """The first element left open (or end tag that closes nothing) in well-formed tags."""
    stack: list[tuple[int, str]] = []
    for i, (kind, offset, name) in enumerate(events):
        if kind == "start":
            stack.append((offset, name))
        elif kind == "end":
            if stack and stack[-1][1] == name:
                stack.pop()
            elif any(n == name for _, n in stack) and not _extra(events[i + 1:], stack):  # inner ones left open
                return _open(stack[-1], f"</{name}> on line {lines.at(offset)[0]}")
            else:
                top = f" (the open element here is <{stack[-1][1]}>)" if stack else ""
                return Slip(offset, f"an extra </{name}>: no <{name}> is open here{top}", "remove this end tag")
    return _open(stack[-1], "the end of the document") if stack else None


def _extra(rest, stack) -> bool:
    """Whether the document nests well once a mismatched end tag is dropped (then that tag is the one extra)."""
    stack = [name for _, name in stack]
    for kind, _, name in rest:
        if kind == "start":
            stack.append(name)
        elif kind == "end":
            if not stack or stack.pop() != name:
                return False
    return not stack


def _open(opened: tuple[int, str], found: str) -> Slip:
    offset, name = opened
    return Slip(offset, f"<{name}> is never closed (reached {found} first)",
                f"add </{name}> where the element ends")
