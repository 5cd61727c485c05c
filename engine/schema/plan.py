"""Prompt planning: a parsed prompt and a layout become the token sequence every run uses.

A :class:`PromptPlan` is the prompt as :class:`Segment` s in the baseline's order, each taken
from the store (``cached``) or prefilled (``uncached``) at explicit positions. The placement rules
are docs/pml-spec.md section 6.1. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from engine.errors import ContextLengthError, Problem, Problems, named
from engine.schema.layout import ANONYMOUS, EntryName, Layout
from engine.schema.pml import Import, NewText, Prompt

CACHED, UNCACHED = "cached", "uncached"


@dataclass(frozen=True)
class Segment:
    """A run of tokens of the materialised prompt."""

    kind: str  # CACHED | UNCACHED
    source: str  # "anonymous" | "module" | "argument" | "text" | "template"
    owner: str  # module path, ANONYMOUS, or "" for prompt text
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    piece: int | None = None  # always set when cached
    offset: int = 0  # into the piece
    scaffold: str | None = None  # whose joint KV provides it

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Placed:
    """A segment where the prompt holds it: the rank of its first token and the routable module that owns it."""

    segment: Segment
    rank: int  # prompt rank (index in the baseline's token order) of its first token
    module: str | None  # see :func:`owning_module`

    @property
    def ranks(self) -> range:
        return range(self.rank, self.rank + len(self.segment))

    @property
    def cached(self) -> bool:
        return self.segment.kind == CACHED


def owning_module(layout: Layout, s: Segment) -> str | None:
    """The routable (top-level) module whose stored KV holds a segment's tokens; None for the prefilled tokens, the
    system text and scaffolds (a scaffold's joint KV is no one module's)."""
    if s.kind != CACHED or s.scaffold or s.owner == ANONYMOUS:
        return None
    return layout.modules[s.owner].top


@dataclass(frozen=True)
class PromptPlan:
    layout: Layout
    prompt: Prompt
    imported: tuple[str, ...]  # schema order
    arguments: tuple[tuple[str, str, str], ...]  # (module path, param, value)
    scaffolds: tuple[str, ...]
    segments: tuple[Segment, ...]

    def placed(self) -> Iterator[Placed]:
        """Every segment in prompt order, with its first token's rank and its owning module: the one walk over a
        plan that counts ranks."""
        rank = 0
        for s in self.segments:
            yield Placed(s, rank, owning_module(self.layout, s))
            rank += len(s)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def positions(self) -> list[int]:
        return [p for s in self.segments for p in s.positions]

    @property
    def cached_tokens(self) -> int:
        return sum(len(s) for s in self.segments if s.kind == CACHED)

    @property
    def uncached_tokens(self) -> int:
        return sum(len(s) for s in self.segments if s.kind == UNCACHED)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def max_position(self) -> int:
        return max(self.positions, default=-1)

    @property
    def room(self) -> int:
        """New tokens that fit in the model's context after this prompt."""
        return self.layout.codec.max_positions - max(self.max_position + 1, self.prompt_tokens)

    def entry_tokens(self) -> dict[EntryName, int]:
        """Tokens of each store entry a cached run of this plan reads."""
        every = self.layout.entry_tokens()
        used = {EntryName.anonymous()} | {EntryName.scaffold(s) for s in self.scaffolds}
        covered = {m for s in self.layout.schema.scaffolds if s.name in self.scaffolds for m in s.modules}
        used |= {EntryName.module(p) for p in self.imported if self.layout.modules[p].top not in covered}
        return {k: every[k] for k in used if k in every}

    def uncached(self) -> tuple[list[int], list[int]]:
        """(token ids, position ids) of the uncached segments, in order."""
        ids: list[int] = []
        pos: list[int] = []
        for s in self.segments:
            if s.kind == UNCACHED:
                ids += s.token_ids
                pos += s.positions
        return ids, pos


def plan_prompt(layout: Layout, prompt: Prompt, max_new_tokens: int = 0) -> PromptPlan:
    """Resolve and validate the prompt's imports, then lay out every token of both runs."""
    r = _Resolver(layout, prompt)
    r.resolve()
    if r.problems:
        raise r.problems.error()
    segments = _materialise(layout, prompt, r)
    plan = PromptPlan(layout=layout, prompt=prompt, imported=tuple(p for p in layout.modules if p in r.imported),
                      arguments=tuple((m, k, v) for (m, k), v in r.args.items()), scaffolds=tuple(r.scaffolds),
                      segments=tuple(segments))
    check_room(plan, max_new_tokens)
    return plan


def check_room(plan: PromptPlan, max_new_tokens: int) -> None:
    """ContextLengthError when ``max_new_tokens`` do not fit after the prompt."""
    if max_new_tokens <= plan.room:
        return
    limit, prompt = plan.layout.codec.max_positions, plan.prompt
    need_pos = plan.max_position + 1 + max_new_tokens
    need_len = plan.prompt_tokens + max_new_tokens
    room = plan.room
    fix = (f"at most {room} new tokens fit after this prompt: lower max new tokens to {room} or less, or import "
           "fewer modules" if room >= 1 else "import fewer modules, shorten the text or lower max new tokens")
    raise ContextLengthError(
        f"{prompt.source}:{prompt.line}:1: error: the prompt needs {max(need_pos, need_len)} positions "
        f"({plan.prompt_tokens} prompt tokens, last position {plan.max_position}, {max_new_tokens} new tokens) "
        f"but the model's context is {limit}; hint: {fix}")


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

class _Resolver:
    def __init__(self, layout: Layout, prompt: Prompt):
        self.layout = layout
        self.prompt = prompt
        self.problems = Problems()
        self.imported: dict[str, Import] = {}
        self.union_imports: dict[str, str] = {}  # union id -> the member imported
        self.args: dict[tuple[str, str], str] = {}
        self.arg_ids: dict[tuple[str, str], tuple[int, ...]] = {}
        self.refused: set[tuple[str, str]] = set()  # reported once, not also as missing
        self.scaffolds: list[str] = []
        self.anchor: dict[int, str | None] = {}  # NewText index -> top-level import it follows

    def add(self, line: int, col: int, message: str, hint: str = "") -> None:
        self.problems.add(Problem(self.prompt.source, line, col, message, hint))

    def resolve(self) -> None:
        lay, prompt = self.layout, self.prompt
        if prompt.schema != lay.name:
            self.add(prompt.line, 1, f"the prompt is written for schema '{prompt.schema}' but the schema is "
                     f"'{lay.name}'", f"write <prompt schema=\"{lay.name}\">")
        top = {m.name: m.path for m in lay.modules.values() if m.parent == ANONYMOUS}
        last: str | None = None
        for i, item in enumerate(prompt.items):
            if isinstance(item, Import):
                path = self.import_(item, top, "the schema's top level")
                last = path or last
            elif isinstance(item, NewText):
                self.anchor[i] = last
                if item.role is not None and item.role not in lay.codec.role_open and not lay.codec.roles_error:
                    self.add(item.line, 1, f"unknown role <{item.role}>")
                if item.role is not None and lay.codec.roles_error:
                    self.add(item.line, 1, lay.codec.roles_error, "write the text without a role tag")
        self.check_missing_args()
        self.pick_scaffolds()

    def import_(self, item: Import, names: dict[str, str], where: str) -> str | None:
        path = names.get(item.name)
        if path is None:
            self.add(item.line, item.col, f"unknown module <{item.name}> at {where}", f"valid here: {named(names)}")
            return None
        if path in self.imported:
            self.add(item.line, item.col, f"module '{path}' is imported twice", "import each module once")
            return None
        mod = self.layout.modules[path]
        if mod.union:
            rival = self.union_imports.setdefault(mod.union, path)
            if rival != path:
                self.add(item.line, item.col, f"<{item.name}> and <{rival.rsplit('/', 1)[-1]}> are members of one "
                         "union; a prompt imports at most one", "keep one of them")
                return None
        self.imported[path] = item
        params = {p.name: p for p in mod.params}
        for key, value in item.args:
            p = params.get(key)
            if p is None:
                self.add(*item.arg_at(key), f"module '{path}' has no param '{key}'",
                         f"params of {path}: {named(params)}")
                continue
            ids = tuple(self.layout.codec.encode(value))
            n = len(ids)
            if n > p.length:
                self.refused.add((path, key))
                self.add(*item.arg_at(key, value=True), f"argument {key}=\"{value}\" of module '{path}' is {n} tokens but the "
                         f"param allows {p.length} (len=\"{p.length}\")",
                         f"shorten the argument to at most {p.length} tokens, or raise len in the schema")
                continue
            self.args[(path, key)] = value
            self.arg_ids[(path, key)] = ids
        child_names = {m.rsplit("/", 1)[-1]: m for m in mod.children}
        for uid in mod.unions:
            child_names.update({m.rsplit("/", 1)[-1]: m for m in self.layout.unions[uid].members})
        for child in item.children:
            self.import_(child, child_names, f"module '{path}'")
        return path

    def check_missing_args(self) -> None:
        for path, item in self.imported.items():
            for p in self.layout.modules[path].params:
                if (path, p.name) not in self.args and (path, p.name) not in self.refused and not p.has_default:
                    self.add(item.line, item.col, f"module '{path}' needs an argument for param '{p.name}' "
                             "(it has no default)", f"write <{item.name} {p.name}=\"...\"/>")

    def pick_scaffolds(self) -> None:
        used: set[str] = set()
        for sc in self.layout.schema.scaffolds:
            if all(m in self.imported for m in sc.modules) and not used & set(sc.modules):
                self.scaffolds.append(sc.name)
                used |= set(sc.modules)


def _materialise(layout: Layout, prompt: Prompt, r: _Resolver) -> list:
    seq, first_piece_of, last_piece_of = _schema_segments(layout, r)
    merged = _with_prompt_text(layout, prompt, r, seq, first_piece_of, last_piece_of)
    return _placed(merged)


def _schema_segments(layout: Layout, r: _Resolver) -> tuple[list[Segment], dict[str, int], dict[str, int]]:
    """The imported schema pieces in layout order, and each top-level import's first and last index."""
    imported = r.imported
    pieces = layout.pieces

    # Which scaffold provides each covered piece.
    scaffold_of: dict[int, str] = {}
    for name in r.scaffolds:
        for i in layout.scaffold_unit(name)[1]:
            scaffold_of[i] = name

    # 1. Schema pieces of the prompt, in layout order.
    seq: list[Segment] = []
    last_piece_of: dict[str, int] = {}  # top-level import -> its subtree's last index in seq
    first_piece_of: dict[str, int] = {}
    for piece in pieces:
        if piece.owner != ANONYMOUS and piece.owner not in imported:
            continue
        pos = tuple(range(piece.start, piece.end))
        if piece.owner == ANONYMOUS:
            seg = Segment(CACHED, "anonymous", ANONYMOUS, piece.token_ids, pos, piece.index, 0,
                          scaffold_of.get(piece.index))
        else:
            mod = layout.modules[piece.owner]
            if piece.kind == "param" and (piece.owner, piece.param) in r.args:
                ids = r.arg_ids[(piece.owner, piece.param)]
                seg = Segment(UNCACHED, "argument", piece.owner, ids, pos[: len(ids)], piece.index)
            elif piece.kind == "param":
                n = next(p.default_tokens for p in mod.params if p.name == piece.param)
                seg = Segment(CACHED if mod.cache else UNCACHED, "module", piece.owner, piece.token_ids[:n],
                              pos[:n], piece.index, 0, scaffold_of.get(piece.index))
            else:
                seg = Segment(CACHED if mod.cache else UNCACHED, "module", piece.owner, piece.token_ids, pos,
                              piece.index, 0, scaffold_of.get(piece.index))
            first_piece_of.setdefault(mod.top, len(seq))
            last_piece_of[mod.top] = len(seq)
        if len(seg):
            seq.append(seg)
    return seq, first_piece_of, last_piece_of


def _with_prompt_text(layout: Layout, prompt: Prompt, r: _Resolver, seq: list[Segment],
                      first_piece_of: dict[str, int], last_piece_of: dict[str, int]) -> list[Segment]:
    """``seq`` with the prompt's new text, and the generation prompt at the end."""
    imported = r.imported

    # 2. Insert prompt text: bare text after the import it follows, role text at the end.
    inserts: dict[int, list[Segment]] = {}  # insert before seq index
    tail: list[Segment] = []
    first_import = min(first_piece_of.values(), default=len(seq))
    for i, item in enumerate(prompt.items):
        if not isinstance(item, NewText):
            continue
        if item.role is not None:
            ids = (layout.codec.role_ids(item.role, True) + tuple(layout.codec.encode(item.text))
                   + layout.codec.role_ids(item.role, False))
            tail.append(Segment(UNCACHED, "text", "", ids, ()))
            continue
        ids = tuple(layout.codec.encode(item.text))
        anchor = r.anchor.get(i)
        at = last_piece_of[anchor] + 1 if anchor in last_piece_of else (first_import if imported else len(seq))
        inserts.setdefault(at, []).append(Segment(UNCACHED, "text", "", ids, ()))
    merged: list[Segment] = []
    for k in range(len(seq) + 1):
        merged += inserts.get(k, [])
        if k < len(seq):
            merged.append(seq[k])
    merged += tail
    if layout.codec.generation_prompt:
        merged.append(Segment(UNCACHED, "template", "", layout.codec.generation_prompt, ()))
    return merged


def _placed(merged: list[Segment]) -> list[Segment]:
    """Positions for new text and the uncached tail, each after the segment before it."""
    # 3. The tail: from the first uncached segment after which no cached module segment follows.
    last_cached_module = max((k for k, s in enumerate(merged) if s.kind == CACHED and s.source == "module"),
                             default=-1)
    tail_start = next((k for k, s in enumerate(merged) if k > last_cached_module and s.kind == UNCACHED),
                      len(merged))

    # 4. Positions for text and recomputed template tokens: continue after the previous segment.
    out: list[Segment] = []
    cursor = 0
    for k, s in enumerate(merged):
        in_tail = k >= tail_start
        if s.source in ("text", "template") or (in_tail and s.source == "anonymous"):
            s = Segment(UNCACHED, s.source, s.owner, s.token_ids, tuple(range(cursor, cursor + len(s))), s.piece,
                        s.offset, None)
        if s.positions:
            cursor = s.positions[-1] + 1
        out.append(s)
    return out
