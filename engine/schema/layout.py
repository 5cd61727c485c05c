"""Layout: where every token of a schema sits in position space (docs/pml-spec.md section 2).

A pure function of schema and :class:`TextCodec`, no torch. Encoding and prompt planning both
read it, so they never disagree about what a unit contains.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable

from engine.errors import ContextLengthError, Problem, Problems
from engine.schema.pml import Module, Param, Role, Schema, Text, Union

ANONYMOUS = ""  # owner of text outside every module


class EntryName(str):
    """The unit a store entry holds, as text: ``(anonymous)``, a module path or ``scaffold:NAME``."""

    kind: str  # "anonymous" | "module" | "scaffold"

    def __new__(cls, text: str, kind: str):
        obj = super().__new__(cls, text)
        obj.kind = kind
        return obj

    @classmethod
    def anonymous(cls) -> "EntryName":
        return cls("(anonymous)", "anonymous")

    @classmethod
    def module(cls, path: str) -> "EntryName":
        return cls.anonymous() if path == ANONYMOUS else cls(path, "module")

    @classmethod
    def scaffold(cls, name: str) -> "EntryName":
        return cls(f"scaffold:{name}", "scaffold")

    def __repr__(self) -> str:
        return f"EntryName.{self.kind}({str(self)!r})"


@dataclass(frozen=True)
class TextCodec:
    """What the layout needs from a tokenizer and its chat template."""

    encode: Callable[[str], list[int]] = field(repr=False)
    role_open: dict[str, tuple[int, ...]]
    role_close: dict[str, tuple[int, ...]]
    generation_prompt: tuple[int, ...]
    bos: tuple[int, ...]
    placeholder: int
    max_positions: int
    fingerprint: str  # tokenizer + template, part of every cache key
    roles_error: str = ""  # why role tags cannot be used, if so

    def role_ids(self, role: str, opening: bool) -> tuple[int, ...]:
        if self.roles_error:
            raise ValueError(self.roles_error)
        return (self.role_open if opening else self.role_close)[role]


@dataclass(frozen=True)
class Piece:
    """Tokens at contiguous positions with one owner."""

    index: int
    kind: str  # "bos" | "role" | "text" | "param"
    owner: str  # module path, or ANONYMOUS
    token_ids: tuple[int, ...]
    start: int
    param: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ParamLayout:
    name: str
    module: str
    piece: int  # default tokens + placeholders
    start: int
    length: int
    default_tokens: int
    has_default: bool
    line: int


@dataclass(frozen=True)
class ModuleLayout:
    path: str
    name: str
    parent: str  # ANONYMOUS at top level
    top: str  # top-level ancestor: the encoding unit
    union: str | None
    start: int
    end: int  # span end, nested modules included
    pieces: tuple[int, ...]  # its own, nested modules excluded
    children: tuple[str, ...]  # nested modules not in a union
    unions: tuple[str, ...]
    params: tuple[ParamLayout, ...]
    cache: bool  # False under cache="false"
    line: int

    def importable(self) -> tuple[str, ...]:
        """Names a prompt may import inside this module."""
        return tuple(p.rsplit("/", 1)[-1] for p in self.children) + self._union_names

    _union_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class UnionLayout:
    id: str
    parent: str
    members: tuple[str, ...]
    default: str | None  # the scaffold member, stand-in context
    start: int
    end: int
    line: int


@dataclass(frozen=True)
class Layout:
    schema: Schema
    codec: TextCodec = field(repr=False)
    pieces: tuple[Piece, ...]
    modules: dict[str, ModuleLayout]
    unions: dict[str, UnionLayout]
    length: int  # positions used by the schema

    @property
    def name(self) -> str:
        return self.schema.name

    @property
    def fingerprint(self) -> str:
        """Hash of what the encoded KV depends on, besides model and mode."""
        h = hashlib.sha256(self.codec.fingerprint.encode())
        for p in self.pieces:
            h.update(json.dumps([p.kind, p.owner, p.start, p.token_ids, p.param]).encode())
        h.update(json.dumps([[s.name, s.modules] for s in self.schema.scaffolds]).encode())
        return h.hexdigest()[:16]

    def top_level(self) -> list[str]:
        return [p for p, m in self.modules.items() if m.parent == ANONYMOUS]

    def anonymous(self) -> list[Piece]:
        return [p for p in self.pieces if p.owner == ANONYMOUS]

    def rows(self) -> list[dict]:
        """One row per module."""
        out = []
        for m in self.modules.values():
            own = sum(len(self.pieces[i]) for i in m.pieces)
            out.append({"module": m.path, "start": m.start, "end": m.end, "tokens": own,
                        "params": ", ".join(f"{p.name}[{p.length}]" for p in m.params),
                        "union": bool(m.union), "cache": m.cache})
        return out

    def anonymous_tokens(self) -> int:
        return sum(len(p) for p in self.anonymous())

    def entry_tokens(self) -> dict[EntryName, int]:
        """Tokens of every store entry an encoding makes."""
        out = {EntryName.anonymous(): self.anonymous_tokens()}
        out.update({EntryName.module(m.path): sum(len(self.pieces[i]) for i in m.pieces) for m in self.modules.values() if m.cache})
        for sc in self.schema.scaffolds:
            out[EntryName.scaffold(sc.name)] = sum(len(self.pieces[i]) for i in self.scaffold_unit(sc.name)[1])
        return out

    # -- encoding units (shared by encode.py and plan.py) ---------------------------------------

    def unit_pieces(self, top: str, choice: dict[str, str]) -> list[int]:
        """Pieces of a top-level module's unit, unions resolved by ``choice``."""
        out: list[int] = []
        self._collect(top, choice, out)
        return sorted(out, key=lambda i: self.pieces[i].start)

    def _collect(self, path: str, choice: dict[str, str], out: list[int]) -> None:
        m = self.modules[path]
        if not m.cache:
            return
        out.extend(m.pieces)
        for child in m.children:
            self._collect(child, choice, out)
        for uid in m.unions:
            member = choice.get(uid, self.unions[uid].default)
            if member is not None:
                self._collect(member, choice, out)

    def variant_of(self, path: str) -> dict[str, str]:
        """The union choices that put module ``path`` in its unit."""
        choice: dict[str, str] = {}
        m = self.modules[path]
        while m.parent != ANONYMOUS:
            if m.union:
                choice[m.union] = m.path
            m = self.modules[m.parent]
        return choice

    def prefix_pieces(self, start: int) -> list[int]:
        """Anonymous pieces that end by ``start``."""
        return [p.index for p in self.anonymous() if p.end <= start]

    def scaffold_unit(self, name: str) -> tuple[list[int], list[int]]:
        """(anonymous prefix pieces, covered pieces) of a scaffold's joint unit."""
        sc = next(s for s in self.schema.scaffolds if s.name == name)
        covered: list[int] = []
        for mod in sc.modules:
            covered += self.unit_pieces(mod, {})
        first = min(self.modules[m].start for m in sc.modules)
        last = max(self.modules[m].end for m in sc.modules)
        covered += [p.index for p in self.anonymous() if p.start >= first and p.end <= last]
        covered.sort(key=lambda i: self.pieces[i].start)
        return self.prefix_pieces(first), covered


def layout(schema: Schema, codec: TextCodec) -> Layout:
    """Lay the schema out in position space; raise PMLError / ContextLengthError on problems."""
    b = _Builder(schema, codec)
    if codec.bos:
        b.piece("bos", ANONYMOUS, codec.bos)
    b.nodes(schema.children, parent=ANONYMOUS, top=None, cache=True)
    if b.problems:
        raise b.problems.error()
    lay = Layout(schema=schema, codec=codec, pieces=tuple(b.pieces), modules=b.modules, unions=b.unions,
                 length=b.offset)
    if lay.length > codec.max_positions:
        culprit = next((m for m in lay.modules.values() if m.end > codec.max_positions), None)
        where = f"; module '{culprit.path}' (line {culprit.line}) reaches position {culprit.end}" if culprit else ""
        raise ContextLengthError(
            f"{schema.source}:1:1: error: schema '{schema.name}' needs {lay.length} positions but the model's "
            f"context is {codec.max_positions}{where}; hint: shorten or split the documents, or load a model with "
            "a longer context")
    return lay


class _Builder:
    def __init__(self, schema: Schema, codec: TextCodec):
        self.schema = schema
        self.codec = codec
        self.pieces: list[Piece] = []
        self.modules: dict[str, ModuleLayout] = {}
        self.unions: dict[str, UnionLayout] = {}
        self.problems = Problems()
        self.offset = 0

    def piece(self, kind: str, owner: str, ids, param: str | None = None) -> Piece | None:
        ids = tuple(ids)
        if not ids:
            return None
        p = Piece(index=len(self.pieces), kind=kind, owner=owner, token_ids=ids, start=self.offset, param=param)
        self.pieces.append(p)
        self.offset += len(ids)
        return p

    def nodes(self, nodes, parent: str, top: str | None, cache: bool) -> tuple[list[int], list[str], list[str],
                                                                           list[ParamLayout]]:
        """Lay out ``nodes``; return (own pieces, child module paths, union ids, params)."""
        own: list[int] = []
        children: list[str] = []
        unions: list[str] = []
        params: list[ParamLayout] = []
        prefix = f"{parent}/" if parent else ""
        for node in nodes:
            if isinstance(node, Text):
                p = self.piece("text", parent, self.codec.encode(node.text))
                if p:
                    own.append(p.index)
            elif isinstance(node, Param):
                params.append(self.param(node, parent))
                if params[-1].piece >= 0:
                    own.append(params[-1].piece)
            elif isinstance(node, Module):
                children.append(self.module(node, prefix + node.name, parent, top, None, cache))
            elif isinstance(node, Union):
                unions.append(self.union(node, parent, top, cache, len(self.unions)))
            elif isinstance(node, Role):
                try:
                    opening = self.codec.role_ids(node.role, True)
                    closing = self.codec.role_ids(node.role, False)
                except ValueError as err:
                    self.problems.add(Problem(self.schema.source, node.line, 1, str(err),
                                                 "remove the role tags, or load a chat model"))
                    opening = closing = ()
                p = self.piece("role", ANONYMOUS, opening)
                sub = self.nodes(node.children, parent, top, cache)
                own += ([p.index] if p else []) + sub[0]
                children += sub[1]
                unions += sub[2]
                q = self.piece("role", ANONYMOUS, closing)
                own += [q.index] if q else []
        return own, children, unions, params

    def module(self, node: Module, path: str, parent: str, top: str | None, union: str | None,
               cache: bool) -> str:
        start = self.offset
        cache = cache and node.cache
        self.modules[path] = None  # parents before children
        own, children, unions, params = self.nodes(node.children, path, top or path, cache)
        union_names = tuple(m.rsplit("/", 1)[-1] for u in unions for m in self.unions[u].members)
        self.modules[path] = ModuleLayout(
            path=path, name=node.name, parent=parent, top=top or path, union=union, start=start,
            end=self.offset, pieces=tuple(own), children=tuple(children), unions=tuple(unions),
            params=tuple(params), cache=cache, line=node.line, _union_names=union_names)
        return path

    def union(self, node: Union, parent: str, top: str | None, cache: bool, k: int) -> str:
        uid = f"{parent or '<top>'}#union{k}"
        start = self.offset
        end = start
        members = []
        prefix = f"{parent}/" if parent else ""
        for member in node.members:
            self.offset = start
            members.append(self.module(member, prefix + member.name, parent, top, uid, cache))
            end = max(end, self.offset)
        self.offset = end
        default = prefix + node.scaffold if node.scaffold else None
        self.unions[uid] = UnionLayout(id=uid, parent=parent, members=tuple(members), default=default,
                                       start=start, end=end, line=node.line)
        return uid

    def param(self, node: Param, module: str) -> ParamLayout:
        length = node.length
        limit = self.codec.max_positions
        if self.offset + length > limit:  # before any placeholder is made
            raise ContextLengthError(
                f"{self.schema.source}:1:1: error: schema '{self.schema.name}' needs at least {self.offset + length} "
                f"positions but the model's context is {limit}; module '{module}' (line {node.line}) reaches position "
                f"{self.offset + length} with param '{node.name}' (len={length}); hint: lower len to at most "
                f"{max(0, limit - self.offset)}, or shorten the text before it")
        default_ids: list[int] = []
        if node.default:
            default_ids = list(self.codec.encode(node.default))
            if len(default_ids) > length:
                self.problems.add(Problem(
                    self.schema.source, node.line, 1,
                    f"the default of param '{node.name}' is {len(default_ids)} tokens, more than its len={node.length}",
                    f"raise len to at least {len(default_ids)} or shorten the default"))
            default_ids = default_ids[:length]
        ids = default_ids + [self.codec.placeholder] * (length - len(default_ids))
        p = self.piece("param", module, ids, param=node.name)
        if p is None:  # refused at parse time
            return ParamLayout(name=node.name, module=module, piece=-1, start=self.offset, length=0,
                               default_tokens=0, has_default=node.default is not None, line=node.line)
        return ParamLayout(name=node.name, module=module, piece=p.index, start=p.start, length=length,
                           default_tokens=len(default_ids), has_default=node.default is not None, line=node.line)
