"""A PML document's text read as XML by lxml (here only): no entities, DTDs or network, a DOCTYPE refused."""

from __future__ import annotations

import re

from lxml import etree

from engine.errors import PMLError, Problem

from .where import Lines, first_slip, start_tags

PARSER_OPTIONS = dict(
    resolve_entities=False, no_network=True, load_dtd=False, dtd_validation=False,
    huge_tree=False, remove_comments=True, remove_pis=True, strip_cdata=True,
)


def parse_xml(text: str, source: str):
    """The root element of ``text``, else a located PMLError."""
    if not isinstance(text, str):
        raise PMLError(Problem(source, 1, 1, "the document is not text"))
    if not text.strip():
        raise PMLError(Problem(source, 1, 1, "the document is empty",
                               "start with <schema name=\"...\"> or <prompt schema=\"...\">"))
    declaration = _declaration(text)
    if declaration is not None:
        line = text.count("\n", 0, declaration) + 1
        _refuse_declarations(source, line, declaration - (text.rfind("\n", 0, declaration) + 1) + 1)
    parser = etree.XMLParser(**PARSER_OPTIONS)
    data = text.encode("utf-8")
    try:
        root = etree.fromstring(data, parser=parser)
    except etree.XMLSyntaxError as err:
        raise PMLError(_syntax_problem(text, source, err)) from None
    info = root.getroottree().docinfo
    if info.doctype or info.internalDTD is not None or info.externalDTD is not None:
        _refuse_declarations(source, 1, 1)  # a second lock behind _declaration
    return root


def tag_map(root, text: str) -> dict:
    """{element: its start tag in ``text``}; empty when the text's scan and lxml's elements disagree."""
    if root is None:
        return {}
    els, tags = list(root.iter(etree.Element)), start_tags(text)
    return dict(zip(els, tags)) if [e.tag for e in els] == [t.name for t in tags] else {}


def strip_comments(text: str) -> str:
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


# -- internal helpers --

# a declaration, or the start of a comment, CDATA section or PI (which may hold "<!DOCTYPE" as text)
_MARKUP = re.compile(r"(?i:<!DOCTYPE|<!ENTITY)|<!--|<!\[CDATA\[|<\?")
_CLOSERS = {"<!--": "-->", "<![CDATA[": "]]>", "<?": "?>"}


def _declaration(text: str) -> int | None:
    """Offset of the first <!DOCTYPE or <!ENTITY that is markup, in one pass."""
    pos, unclosed = 0, set()
    while (m := _MARKUP.search(text, pos)) is not None:
        closer = _CLOSERS.get(m.group())
        if closer is None:
            return m.start()
        end = -1 if closer in unclosed else text.find(closer, m.end())
        if end < 0:
            unclosed.add(closer)
        pos = m.end() if end < 0 else end + len(closer)
    return None


def _refuse_declarations(source: str, line: int, col: int):
    raise PMLError(Problem(source, line, col,
                           "DOCTYPE and ENTITY declarations are not allowed in PML (entities are never expanded)",
                           "remove the <!DOCTYPE ...> block and write the text out literally; inside a module, "
                           "<![CDATA[ <!DOCTYPE ...> ]]> is text and allowed"))


def _syntax_problem(text: str, source: str, err) -> Problem:
    """The problem of a document lxml refused, at the character to fix: the text's own first slip when it comes no
    later than where lxml gave up (a missing '>' is reported at the next word), else lxml's place."""
    lines = Lines(text)
    line, col = err.position if err.position else (1, 1)
    line, col = line or 1, lines.char_col(line or 1, col or 1)
    slip = first_slip(lines)
    if slip is not None and lines.at(slip.offset) <= (line, col):
        return Problem(source, *lines.at(slip.offset), f"malformed XML: {slip.message}", slip.hint)
    return Problem(source, line, col, _syntax_message(err), _syntax_hint(err))


def _syntax_message(err) -> str:
    msg = (err.msg or str(err)).strip()
    msg = re.sub(r",? line \d+, column \d+$", "", msg)
    return f"malformed XML: {msg}"


def _syntax_hint(err) -> str:
    msg = (err.msg or "").lower()
    if "startTag: invalid element name".lower() in msg or "invalid element name" in msg:
        return "a '<' in text starts a tag: wrap the code in <![CDATA[ ... ]]> or write &lt;"
    if "entityref" in msg or "entity" in msg and "not defined" in msg:
        return "a bare '&' starts an entity: write &amp; or wrap the text in <![CDATA[ ... ]]>"
    if "mismatch" in msg:
        return "close the innermost open element first; every <x> needs its </x> in the right order"
    if "premature end" in msg or "extra content" in msg or "end of data" in msg:
        return "check that every element is closed and that there is exactly one root element"
    if "attribute" in msg or "attvalue" in msg:
        return "attribute values need quotes: name=\"value\""
    return "fix the XML syntax at this position"
