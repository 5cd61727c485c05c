"""How an API request names what is reusable: a request's messages (or completion prompt) → one PML schema + prompt.

Four ways, one per :class:`Compiled` ``mode``:

- **explicit**: the request gives PML itself (``pml.schema``, ``pml.prompt``); nothing is compiled.
- **marked**: content parts carrying ``cache_control`` (Anthropic's and OpenRouter's mark) are modules.
- **transparent**: with no marks, every content part of at least :data:`MIN_MODULE_CHARS` characters is a module;
  a ``/v1/completions`` prompt is cut into chunks at :data:`SEPARATOR` (LMCache's convention) first.
- **plain**: no modules (the arms that read none, or a request without long parts): every message is new text in
  the PML prompt, in the request's order, over an empty schema.

The modules come from the **document message**: the first user message holding a module part (a completions prompt
is one). The messages before it are the schema's anonymous text (system message, earlier turns: cached as the
prefix, exactly); the messages after it are new turns of the prompt. In the document message, the text parts
before its first module go before the documents and every other text part after them, in order; the documents
sit at the positions studio/api/positions.py keeps for them, so the same text gets the same KV in any order and
any subset (a gap module of ``cache="false"`` fills the positions in between), and the prompt imports them in
position order: a set of documents that recurs in another order is the same prompt, which the routed arm reads
back whole from the prefix tree (engine/arms/joint.py). In transparent mode, new documents are placed in the order
of their content hashes; explicit PML is never reordered (its order is the user's). A system message's parts are never
modules: it is the context the modules are encoded after (``contextual`` mode), cached whole as the prefix.

Everything here is pure apart from the registry and the layout function it is given (``Engine.layout``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable
from xml.sax.saxutils import escape

from .positions import PositionRegistry

MIN_MODULE_CHARS = 256  # a transparent module's shortest text (about 60 tokens): shorter parts are new text
SEPARATOR = " # # "  # between the chunks of a /v1/completions prompt (LMCache's blend_special_str)
ROOM_SHARE = 4  # documents end by the context's last quarter: the rest is left to the question and the answer
JOIN = "\n"  # between the text parts of one message
PLAIN_SCHEMA = "api_plain"
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")  # characters XML 1.0 cannot hold


@dataclass(frozen=True)
class Part:
    """One content part of a message (a string content is one part)."""

    text: str
    marked: bool = False  # it carries cache_control


@dataclass(frozen=True)
class Turn:
    role: str  # system | user | assistant
    parts: tuple[Part, ...]

    @property
    def text(self) -> str:
        return JOIN.join(p.text for p in self.parts)


@dataclass(frozen=True)
class Compiled:
    """A request as PML: what the engine runs, and how it was made."""

    schema: str
    prompt: str
    mode: str  # explicit | marked | transparent | plain
    documents: tuple[str, ...] = ()  # module names of the request's documents
    context: str = ""  # the registry's context key ('' without documents)
    note: str = ""  # why a request with documents runs without them (they do not fit the context)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def chat_pml(turns: list[Turn], how: str, layout: Callable, registry: PositionRegistry, max_positions: int,
             compact: bool = False) -> Compiled:
    """The chat request ``turns`` as PML. ``how``: "auto" (marked when a part is marked, else transparent),
    "marked", "transparent" or "plain". ``layout``: ``Engine.layout`` (to measure new documents); ``compact``:
    place this request's documents from their context's start (a new generation: their question did not fit)."""
    mode = ("marked" if any(p.marked for t in turns for p in t.parts) else "transparent") if how == "auto" else how
    at = next((i for i, t in enumerate(turns) if t.role == "user" and any(_module(p, mode) for p in t.parts)),
              None) if mode != "plain" else None
    if at is None:
        return plain_chat(turns)
    before = "".join(_role(t) for t in turns[:at])
    role = turns[at].role
    docs, lead, rest = _split(turns[at].parts, mode)
    room = _Room(before, role, layout, registry, max_positions)
    placed = room.place(docs, compact, canonical=mode == "transparent")
    if placed is None:
        return plain_chat(turns, note=room.note)
    after = "".join(_role(t) for t in turns[at + 1:])
    schema = f'<schema name="{room.name}">{before}<{role}>{room.body(placed)}</{role}></schema>'
    prompt = f'<prompt schema="{room.name}">{_xml(lead)}{_imports(placed)}{_xml(rest)}{after}</prompt>'
    return Compiled(schema, prompt, mode, tuple(_name(k) for k in placed), room.context)


def completion_pml(prompt: str, how: str, layout: Callable, registry: PositionRegistry, max_positions: int,
                   compact: bool = False) -> Compiled:
    """A ``/v1/completions`` prompt as PML: its chunks (cut at :data:`SEPARATOR`) of at least
    :data:`MIN_MODULE_CHARS` are modules ("auto" and "transparent"; "plain": none). The engine closes every
    prompt with the chat template's generation prompt, as it does for a PML prompt."""
    parts = tuple(Part(c) for c in prompt.split(SEPARATOR))
    if how == "plain" or not any(_module(p, "transparent") for p in parts):
        return plain_completion(prompt.replace(SEPARATOR, JOIN))
    docs, lead, rest = _split(parts, "transparent")
    room = _Room("", None, layout, registry, max_positions)
    placed = room.place(docs, compact, canonical=True)
    if placed is None:
        return plain_completion(prompt.replace(SEPARATOR, JOIN), note=room.note)
    schema = f'<schema name="{room.name}">{room.body(placed)}</schema>'
    text = f'<prompt schema="{room.name}">{_xml(lead)}{_imports(placed)}{_xml(rest)}</prompt>'
    return Compiled(schema, text, "transparent", tuple(_name(k) for k in placed), room.context)


def plain_chat(turns: list[Turn], note: str = "") -> Compiled:
    """Every message as a new turn of the prompt, in order, over the empty schema."""
    body = "".join(_role(t) for t in turns)
    return Compiled(f'<schema name="{PLAIN_SCHEMA}"></schema>', f'<prompt schema="{PLAIN_SCHEMA}">{body}</prompt>',
                    "plain", note=note)


def plain_completion(prompt: str, note: str = "") -> Compiled:
    return Compiled(f'<schema name="{PLAIN_SCHEMA}"></schema>',
                    f'<prompt schema="{PLAIN_SCHEMA}">{_xml(prompt)}</prompt>', "plain", note=note)


def clean(text: str) -> str:
    """``text`` with the characters XML cannot hold (control characters, lone surrogates) made spaces."""
    return _NOT_XML.sub(" ", text)


def document_key(text: str) -> str:
    """A document's identity: a hash of its text (its module is named ``d_KEY``)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

class _Room:
    """The documents of one request in their context: measured, placed, written as the schema's body."""

    def __init__(self, before: str, role: str | None, layout: Callable, registry: PositionRegistry,
                 max_positions: int):
        """``before``: the schema's anonymous text before the document message (PML); ``role``: that message's
        role tag (None: a completions prompt, no tags)."""
        self.context = hashlib.sha256(f"{before}<{role}>".encode("utf-8", "surrogatepass")).hexdigest()[:16]
        self.name = f"api_{self.context[:12]}"
        self.before, self.role, self.layout, self.registry = before, role, layout, registry
        self.end = max_positions - max_positions // ROOM_SHARE
        self.texts: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self.first = 0
        self.note = ""

    def place(self, docs: list[str], compact: bool, canonical: bool = False) -> dict[str, int] | None:
        """{document key: first position}, in position order; None (and ``note``) when they do not fit.
        ``canonical``: new documents are placed in the order of their keys (content hashes), not the request's, so
        one set gets one layout whatever order it first came in (transparent mode: the order is not the user's)."""
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
        """Gap modules and documents at their positions (and a last gap up to ``end`` before a closing tag)."""
        out, cursor = [], self.first
        for i, (key, start) in enumerate(placed.items()):
            out.append(_gap(f"g{i}", start - cursor))
            out.append(f'<module name="{_name(key)}">{_xml(self.texts[key])}</module>')
            cursor = start + self.sizes[key]
        if self.role is not None:  # its closing tag then sits at `end`, whatever the documents: the anonymous
            out.append(_gap("g_end", self.end - cursor))  # entry stays one per context, not one per request
        return "".join(out)

    def _measure(self) -> int:
        """The context's first document position; every document's token count learned (one layout of the
        context and the documents not seen before, side by side)."""
        first = self.registry.first(self.context)
        new = [k for k in self.texts if self.registry.size(k) is None]
        if first is not None and not new:
            return first
        keys = new or list(self.texts)[:1]
        modules = "".join(f'<module name="{_name(k)}">{_xml(self.texts[k])}</module>' for k in keys)
        wrapped = modules if self.role is None else f"<{self.role}>{modules}</{self.role}>"
        lay = self.layout(f'<schema name="{self.name}">{self.before}{wrapped}</schema>')
        for k in keys:
            m = lay.modules[_name(k)]
            self.registry.learn(k, m.end - m.start)
        return lay.modules[_name(keys[0])].start if first is None else first


def _module(part: Part, mode: str) -> bool:
    if mode == "marked":
        return part.marked and bool(part.text.strip())
    return len(part.text.strip()) >= MIN_MODULE_CHARS


def _split(parts, mode: str) -> tuple[list[str], str, str]:
    """(documents in request order, once each; the text before the first; every other text part after)."""
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
