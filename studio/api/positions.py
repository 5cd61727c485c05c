"""Fixed positions for the documents of API requests: the same text gets the same positions, whatever the order.

A module's stored KV is keyed by its tokens, its position ids and the anonymous text before it (engine/cache/
encode.py). For a document to be reused by a later request that holds it beside other documents, in another order
or a subset, it must therefore sit at the same positions every time. The registry gives each document, at its first
sight, the next free range of its **context** (the anonymous text before the documents: system message, earlier
turns, the role tag; a hash of its PML names it) and keeps it there; the PML schema of each request then places
its documents at those positions, with ``cache="false"`` gap modules (a param of the gap's length) in between
(studio/api/modes.py). The paper gives every module its own position range in the schema the same way.

A context's documents live in ``[first, end)``: ``end`` leaves the rest of the model's context to the question and
the answer. A document that no longer fits starts a new **generation** of that context: the request's documents
are placed again from ``first`` (the ones placed before are encoded again at their next sight). Contexts and
document sizes are kept for the most recent :data:`MAX_CONTEXTS` and :data:`MAX_SIZES`; nothing here is
persisted, so after a restart documents are placed anew (their stored KV is reused when they land where they were).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_CONTEXTS = 64  # contexts remembered (different system messages); the least recently used is forgotten
MAX_SIZES = 8192  # documents whose token count is remembered (a count costs one tokenization to learn again)


@dataclass
class Context:
    """The documents placed after one context's anonymous text."""

    first: int  # the first position after the context's text
    end: int  # documents end at or before this position
    placed: dict[str, int] = field(default_factory=dict)  # document key -> its first position
    next_free: int = 0
    generation: int = 0

    def __post_init__(self):
        self.next_free = self.next_free or self.first


class PositionRegistry:
    """Where each document of each context sits (thread-safe; the API's jobs run on one thread anyway)."""

    def __init__(self):
        self._contexts: OrderedDict[str, Context] = OrderedDict()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    # -- public API -----------------------------------------------------------------------------

    def size(self, key: str) -> int | None:
        """Tokens of document ``key`` (None until :meth:`learn` was told)."""
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
        """The first document position of ``context`` (None when the context is new)."""
        with self._lock:
            ctx = self._contexts.get(context)
            return None if ctx is None else ctx.first

    def place(self, context: str, docs: list[tuple[str, int]], first: int, end: int,
              compact: bool = False) -> dict[str, int] | None:
        """{key: first position} of ``docs`` ((key, tokens), in request order) after ``context``: positions kept
        from earlier requests, new documents at the next free range. ``compact`` (or a document that no longer
        fits) starts a new generation holding only these documents, from ``first``. None when they cannot fit
        between ``first`` and ``end`` even then."""
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
    """Place the documents ``ctx`` does not hold yet at its next free positions; False (nothing placed) when
    they do not all fit before ``ctx.end``."""
    new = [(k, n) for k, n in dict(docs).items() if k not in ctx.placed]
    if ctx.next_free + sum(n for _, n in new) > ctx.end:
        return False
    for key, n in new:
        ctx.placed[key] = ctx.next_free
        ctx.next_free += n
    return True
