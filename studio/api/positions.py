"""The same document, after the same context, at the same positions in any request (docs/api.md)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_CONTEXTS = 64  # least recently used first out
MAX_SIZES = 8192


@dataclass
class Context:
    first: int  # after the context's text
    end: int  # documents end by it
    placed: dict[str, int] = field(default_factory=dict)  # document key -> first position
    next_free: int = 0
    generation: int = 0

    def __post_init__(self):
        self.next_free = self.next_free or self.first


class PositionRegistry:
    def __init__(self):
        self._contexts: OrderedDict[str, Context] = OrderedDict()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def size(self, key: str) -> int | None:
        with self._lock:
            n = self._sizes.get(key)
            if n is not None:
                self._sizes.move_to_end(key)
            return n

    def learn(self, key: str, tokens: int) -> None:
        with self._lock:
            self._sizes[key] = tokens
            self._sizes.move_to_end(key)
            while len(self._sizes) > MAX_SIZES:
                self._sizes.popitem(last=False)

    def first(self, context: str) -> int | None:
        with self._lock:
            ctx = self._contexts.get(context)
            return None if ctx is None else ctx.first

    def place(self, context: str, docs: list[tuple[str, int]], first: int, end: int,
              compact: bool = False) -> dict[str, int] | None:
        """{key: first position} of ``docs`` ((key, tokens)); ``compact`` (or a document that no longer fits)
        starts a new generation of the context. None when they cannot fit."""
        with self._lock:
            ctx = self._contexts.get(context)
            if ctx is None or (ctx.first, ctx.end) != (first, end):
                ctx = self._contexts[context] = Context(first, end)
            self._contexts.move_to_end(context)
            while len(self._contexts) > MAX_CONTEXTS:
                self._contexts.popitem(last=False)
            if compact or not _extend(ctx, docs):
                if sum(n for _, n in docs) > end - first:
                    return None
                ctx.placed, ctx.next_free, ctx.generation = {}, first, ctx.generation + 1
                _extend(ctx, docs)
            return {key: ctx.placed[key] for key, _ in docs}

    def generation(self, context: str) -> int:
        with self._lock:
            ctx = self._contexts.get(context)
            return 0 if ctx is None else ctx.generation


def _extend(ctx: Context, docs: list[tuple[str, int]]) -> bool:
    """False (nothing placed) when the new documents do not all fit."""
    new = [(k, n) for k, n in dict(docs).items() if k not in ctx.placed]
    if ctx.next_free + sum(n for _, n in new) > ctx.end:
        return False
    for key, n in new:
        ctx.placed[key] = ctx.next_free
        ctx.next_free += n
    return True
