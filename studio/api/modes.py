"""A request's messages (or completion prompt) as one PML schema + prompt: explicit, marked, transparent or
plain (docs/api.md). Documents are measured with the tokenizer: the engine lays the request out once."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from typing import Callable
from xml.sax.saxutils import escape

from engine.public import TextCodec, compact as as_parsed

from .positions import PositionRegistry

MIN_MODULE_CHARS = 256  # a transparent module's shortest text
SEPARATOR = " # # "  # LMCache's blend_special_str
ROOM_SHARE = 4  # the context's last quarter is for the question and the answer
JOIN = "\n"  # between the text parts of one message
PLAIN_SCHEMA = "api_plain"
# (end, prompt_tokens, spare) as Compiled counts them -> whether to place the documents from the context's start
Compacts = Callable[[int, int, int], bool]
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")  # not in XML 1.0


@dataclass(frozen=True)
class Part:
    text: str
    marked: bool = False  # it carries cache_control


@dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple[Part, ...]

    @property
    def text(self) -> str:
        return JOIN.join(p.text for p in self.parts)


@dataclass(frozen=True)
class Compiled:
    schema: str
    prompt: str
    mode: str
    documents: tuple[str, ...] = ()  # module names
    context: str = ""  # the registry's key
    note: str = ""  # why documents ran as new text
    uncached: tuple[tuple[str, int], ...] = ()  # (reason, parts) that ran as new text: "short", "no_room"
    end: int = 0  # the prompt's last position + 1, counted before the layout
    prompt_tokens: int = 0
    spare: int = 0  # positions freed with the documents from the context's start


def chat_pml(turns: list[Turn], how: str, codec: TextCodec, registry: PositionRegistry,
             compacts: Compacts | None = None) -> Compiled:
    """``how``: auto | marked | transparent | plain; ``compacts``: asked once the documents are placed, whether
    to place them from the context's start instead (before any PML is written: a request is compiled once)."""
    mode = ("marked" if any(p.marked for t in turns for p in t.parts) else "transparent") if how == "auto" else how
    at = next((i for i, t in enumerate(turns) if t.role == "user" and any(_module(p, mode) for p in t.parts)),
              None) if mode != "plain" and not codec.roles_error else None
    asked = next((t.parts for t in reversed(turns) if t.role == "user"), ()) if at is None else turns[at].parts
    short = _short(asked) if mode == "transparent" else 0
    if at is None:
        context = sum(_module(p, mode) for t in turns if t.role == "system" for p in t.parts) if mode != "plain" else 0
        return _noted(plain_chat(turns), short, system=context)
    role = turns[at].role
    docs, lead, rest = _split(turns[at].parts, mode)
    room = _Room(turns[:at], role, codec, registry)
    tail = len(codec.role_ids(role, False)) + sum(_turn_tokens(codec, t) for t in turns[at + 1:])
    placed = room.settle(docs, mode == "transparent", lead, rest, tail, compacts)
    if placed is None:
        return _noted(plain_chat(turns, note=room.note), short, len(docs))
    after = "".join(_role(t) for t in turns[at + 1:])
    schema = f'<schema name="{room.name}">{room.before}<{role}>{room.body(placed)}</{role}></schema>'
    prompt = f'<prompt schema="{room.name}">{_xml(lead)}{_imports(placed)}{_xml(rest)}{after}</prompt>'
    return _noted(room.compiled(schema, prompt, mode, placed), short)


def completion_pml(prompt: str, how: str, codec: TextCodec, registry: PositionRegistry,
                   compacts: Compacts | None = None) -> Compiled:
    """Chunks (cut at :data:`SEPARATOR`) of :data:`MIN_MODULE_CHARS` or more are modules (``compacts``: as
    :func:`chat_pml`'s)."""
    parts = tuple(Part(c) for c in prompt.split(SEPARATOR))
    short = 0 if how == "plain" else _short(parts)
    if how == "plain" or not any(_module(p, "transparent") for p in parts):
        return _noted(plain_completion(prompt.replace(SEPARATOR, JOIN)), short)
    docs, lead, rest = _split(parts, "transparent")
    room = _Room((), None, codec, registry)
    placed = room.settle(docs, True, lead, rest, 0, compacts)
    if placed is None:
        return _noted(plain_completion(prompt.replace(SEPARATOR, JOIN), note=room.note), short, len(docs))
    schema = f'<schema name="{room.name}">{room.body(placed)}</schema>'
    text = f'<prompt schema="{room.name}">{_xml(lead)}{_imports(placed)}{_xml(rest)}</prompt>'
    return _noted(room.compiled(schema, text, "transparent", placed), short)


def plain_chat(turns: list[Turn], note: str = "") -> Compiled:
    body = "".join(_role(t) for t in turns)
    return Compiled(f'<schema name="{PLAIN_SCHEMA}"></schema>', f'<prompt schema="{PLAIN_SCHEMA}">{body}</prompt>',
                    "plain", note=note)


def plain_completion(prompt: str, note: str = "") -> Compiled:
    return Compiled(f'<schema name="{PLAIN_SCHEMA}"></schema>',
                    f'<prompt schema="{PLAIN_SCHEMA}">{_xml(prompt)}</prompt>', "plain", note=note)


def _short(parts: tuple[Part, ...]) -> int:
    """Parts that read as documents (every text part of a message but its last, the question) too short to be
    modules: a newcomer's retrieved snippets, which would otherwise run as new text without a word."""
    if len(parts) < 2:
        return 0
    return sum(0 < len(p.text.strip()) < MIN_MODULE_CHARS for p in parts[:-1])


def _noted(compiled: Compiled, short: int, no_room: int = 0, system: int = 0) -> Compiled:
    """``compiled`` with the parts that ran as new text, and why, in its note (``system``: document-sized parts of
    the system message, which is context, never documents)."""
    if not short and not no_room and not system:
        return compiled
    notes = [compiled.note] if compiled.note else []
    if system:
        notes.append(f"{system} part{'s' if system != 1 else ''} of the system message ran as new text, not as cached "
                     "documents: a system message is the documents' context, never a document; send the documents as "
                     f"text parts of a user message ({MIN_MODULE_CHARS} characters or more, or marked with "
                     "cache_control) to cache them")
    if short:
        notes.append(f"{short} text part{'s' if short != 1 else ''} under {MIN_MODULE_CHARS} characters ran as new "
                     f"text, not as cached documents: a part is kept as a module from {MIN_MODULE_CHARS} characters "
                     "(docs/api.md says why); mark a shorter one with cache_control to cache it")
    reasons = tuple((why, n) for why, n in (("system", system), ("short", short), ("no_room", no_room)) if n)
    return replace(compiled, note="; ".join(notes), uncached=reasons)


def clean(text: str) -> str:
    return _NOT_XML.sub(" ", text)


def document_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class _Room:
    """A request's documents after their context (``before`` and ``role``'s tag)."""

    def __init__(self, before: tuple[Turn, ...], role: str | None, codec: TextCodec, registry: PositionRegistry):
        self.turns, self.role, self.codec, self.registry = before, role, codec, registry
        self.before = "".join(_role(t) for t in before)
        self.context = hashlib.sha256(f"{self.before}<{role}>".encode("utf-8", "surrogatepass")).hexdigest()[:16]
        self.name = f"api_{self.context[:12]}"
        self.end = codec.max_positions - codec.max_positions // ROOM_SHARE
        self.texts: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self.first = 0
        self.note = ""
        self.lead = self.tail = 0  # tokens of the text before the documents, and after the last one

    def settle(self, docs: list[str], canonical: bool, lead: str, rest: str, tail: int,
               compacts: Compacts | None) -> dict[str, int] | None:
        """:meth:`place` (``lead`` before the documents, ``rest`` and ``tail`` more tokens after them), and once
        more from the context's start when ``compacts`` says so of the counts."""
        placed = self.place(docs, False, canonical)
        self.lead = _tokens(self.codec, lead)
        self.tail = tail + _tokens(self.codec, rest) + len(self.codec.generation_prompt)
        if placed is not None and compacts is not None and compacts(*self.counts(placed)):
            placed = self.place(docs, True, canonical)
        return placed

    def place(self, docs: list[str], compact: bool, canonical: bool = False) -> dict[str, int] | None:
        """{key: first position} in position order; None (and ``note``) when they do not fit. ``canonical``: new
        documents in key order, so one set gets one layout in any order."""
        self.texts = {document_key(d): d for d in docs}
        self.first = first = self._measure()
        sizes = [(k, self.registry.size(k)) for k in (sorted(self.texts) if canonical else self.texts)]
        placed = None if first >= self.end else self.registry.place(self.context, sizes, first, self.end, compact)
        if placed is None:
            need = sum(n for _, n in sizes)
            self.note = (f"the documents need {need} positions after {first} of context, more than the "
                         f"{max(0, self.end - first)} kept for documents; they ran as new text")
            return None
        self.sizes = dict(sizes)
        return dict(sorted(placed.items(), key=lambda kv: kv[1]))

    def body(self, placed: dict[str, int]) -> str:
        out, cursor = [], self.first
        for i, (key, start) in enumerate(placed.items()):
            out.append(_gap(f"g{i}", start - cursor))
            out.append(f'<module name="{_name(key)}">{_xml(self.texts[key])}</module>')
            cursor = start + self.sizes[key]
        if self.role is not None:  # the closing tag at `end`: one anonymous entry a context
            out.append(_gap("g_end", self.end - cursor))
        return "".join(out)

    def counts(self, placed: dict[str, int]) -> tuple[int, int, int]:
        """(end, prompt_tokens, spare) as the plan will count them: lead text, documents, then the rest from the
        last document's end."""
        docs = sum(self.sizes[key] for key in placed)
        last = max(start + self.sizes[key] for key, start in placed.items())
        lead_end = self.first + self.lead
        return max(lead_end, last + self.tail), lead_end + docs + self.tail, last - self.first - docs

    def compiled(self, schema: str, prompt: str, mode: str, placed: dict[str, int]) -> Compiled:
        end, prompt_tokens, spare = self.counts(placed)
        return Compiled(schema, prompt, mode, tuple(_name(k) for k in placed), self.context, end=end,
                        prompt_tokens=prompt_tokens, spare=spare)

    def _measure(self) -> int:
        """The context's first document position; new documents' sizes learnt."""
        for key, text in self.texts.items():
            if self.registry.size(key) is None:
                self.registry.learn(key, _tokens(self.codec, text))
        first = self.registry.first(self.context)
        if first is not None:
            return first
        opening = len(self.codec.role_ids(self.role, True)) if self.role is not None else 0
        return len(self.codec.bos) + sum(_turn_tokens(self.codec, t) for t in self.turns) + opening


def _tokens(codec: TextCodec, text: str) -> int:
    """Tokens the layout gives ``text`` written by :func:`_xml` (XML reads line ends as \\n)."""
    parsed = as_parsed(clean(text).replace("\r\n", "\n").replace("\r", "\n"))
    return len(codec.encode(parsed)) if parsed else 0


def _turn_tokens(codec: TextCodec, turn: Turn) -> int:
    tags = len(codec.role_ids(turn.role, True)) + len(codec.role_ids(turn.role, False))
    return tags + _tokens(codec, turn.text)


def _module(part: Part, mode: str) -> bool:
    if mode == "marked":
        return part.marked and bool(part.text.strip())
    return len(part.text.strip()) >= MIN_MODULE_CHARS


def _split(parts, mode: str) -> tuple[list[str], str, str]:
    """(documents, once each; the text before the first; every other text part)."""
    docs: list[str] = []
    lead: list[str] = []
    rest: list[str] = []
    for p in parts:
        if _module(p, mode) and p.text not in docs:
            docs.append(p.text)
        else:
            (rest if docs else lead).append(p.text)
    return docs, JOIN.join(lead), JOIN.join(rest)


def _role(turn: Turn) -> str:
    return f"<{turn.role}>{_xml(turn.text)}</{turn.role}>"


def _imports(placed: dict[str, int]) -> str:
    return "".join(f"<{_name(k)}/>" for k in placed)


def _gap(name: str, length: int) -> str:
    return f'<module name="{name}" cache="false"><param name="n" len="{length}"/></module>' if length > 0 else ""


def _name(key: str) -> str:
    return f"d_{key}"


def _xml(text: str) -> str:
    return escape(clean(text))
