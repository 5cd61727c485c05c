"""What a run copies from the store into its buffer, as :class:`Span` s in buffer order.

No timing here: :func:`fetch_entries` runs before the clock starts, so a MissingEntry never does.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from engine.cache.compress import QuestionRetention
from engine.cache.encode import EncodedSchema
from engine.cache.store import ModuleStore
from engine.kv import StoredKV
from engine.schema.layout import ANONYMOUS
from engine.schema.plan import CACHED, PromptPlan


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of one store entry, appended to a run's buffer (buffer order is list order)."""

    entry: StoredKV = field(repr=False)
    start: int  # into the entry
    end: int
    rank: int | None = None  # prompt rank of the first token, the rest following; None where merged over gaps
    module: str | None = None  # the routable module owning the tokens (plan.owning_module); None: no one module's
    fresh: bool = False  # the entry was encoded for this request: its tokens are reused but were not stored before

    def __len__(self) -> int:
        return self.end - self.start

    def write_into(self, buf) -> None:
        self.entry.write_into(buf, self.start, self.end)


def precomputed_tokens(spans: list[Span], computed: set[int] = frozenset()) -> int:
    """Tokens of ``spans`` the store held before this request, less the (ranked) ``computed`` ones."""
    done = sorted(computed)  # counted by bisection: this runs inside TTFT
    return sum(len(s) - (bisect_left(done, s.rank + len(s)) - bisect_left(done, s.rank) if done else 0)
               for s in spans if not s.fresh)


def fresh_tokens(spans: list[Span]) -> int:
    """Tokens of ``spans`` whose entries this request encoded."""
    return sum(len(s) for s in spans if s.fresh)


def fetch_entries(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore) -> None:
    """Get every store entry a cached run of ``plan`` reads."""
    for key in used_keys(plan, encoded):
        store.get(key)


def used_keys(plan: PromptPlan, encoded: EncodedSchema) -> list[str]:
    """Store keys a cached run of ``plan`` reads."""
    return sorted({encoded.locate(s.piece, s.scaffold)[0] for s in plan.segments if s.kind == CACHED})


def token_place(plan: PromptPlan, k: int) -> dict:
    """Where prompt token ``k`` comes from: {"token", "source", "owner"}."""
    for at in plan.placed():
        if k in at.ranks:
            return {"token": k, "source": at.segment.source, "owner": at.segment.owner}
    return {"token": k, "source": "end", "owner": ""}


def question_retention(plan: PromptPlan, encoded: EncodedSchema) -> QuestionRetention | None:
    """The run-time retention of ``question`` compression, else None."""
    if not encoded.compression.at_run:
        return None
    anon = encoded.module_keys.get(ANONYMOUS)
    marks = [encoded.locate(s.piece, s.scaffold)[0] != anon for s in plan.segments if s.kind == CACHED
             for _ in range(len(s))]
    return QuestionRetention(encoded.compression, torch.tensor(marks, dtype=torch.bool))


def copy_list(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore) -> list[Span]:
    """The spans to copy, adjacent ones of one entry merged (their ranks may not follow: ``rank`` None)."""
    out: list[Span] = []
    for span in module_ranges(plan, encoded, store):
        last = out[-1] if out else None
        if last is not None and last.entry is span.entry and last.end == span.start:
            out[-1] = Span(last.entry, last.start, span.end, None, last.module, last.fresh)
        else:
            out.append(Span(span.entry, span.start, span.end, None, span.module, span.fresh))
    return out


def copy_list_ranked(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, skip: set[int]) -> list[Span]:
    """The spans to copy with their first token's rank, leaving out ranks ``skip``."""
    return ranked_copies(module_ranges(plan, encoded, store), skip)


def ranked_copies(ranges: list[Span], skip: set[int]) -> list[Span]:
    """``ranges`` (ranked) less the ranks ``skip``, adjacent spans merged where both their entry offsets and their
    ranks follow on."""
    out: list[Span] = []
    for seg in ranges:
        i, n = 0, len(seg)
        while i < n:
            if seg.rank + i in skip:
                i += 1
                continue
            j = i + 1
            while j < n and seg.rank + j not in skip:
                j += 1
            a, last = seg.start + i, out[-1] if out else None  # tokens i..j-1 of seg: one run
            if last is not None and last.entry is seg.entry and last.end == a and last.rank + len(last) == seg.rank + i:
                out[-1] = Span(last.entry, last.start, seg.start + j, last.rank, last.module, last.fresh)
            else:
                out.append(Span(seg.entry, a, seg.start + j, seg.rank + i, seg.module, seg.fresh))
            i = j
    return out


def prefilled(plan: PromptPlan, redo: set[int]) -> tuple[list[int], list[int], list[int]]:
    """(token ids, positions, ranks) of the uncached tokens and ranks ``redo``."""
    ids: list[int] = []
    pos: list[int] = []
    ranks: list[int] = []
    for at in plan.placed():
        for r, t, p in zip(at.ranks, at.segment.token_ids, at.segment.positions):
            if not at.cached or r in redo:
                ids.append(t)
                pos.append(p)
                ranks.append(r)
    return ids, pos, ranks


def buffer_ranks(copies: list[Span], n_layers: int) -> list[torch.Tensor]:
    """Per layer, the ranks of the buffer's entries in buffer order (``copies`` ranked)."""
    def at(layer: int) -> torch.Tensor:
        parts = [c.entry.kept_at(layer, c.start, c.end) + c.rank for c in copies]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    return [at(0)] * n_layers if all(c.entry.level for c in copies) else [at(layer) for layer in range(n_layers)]


def module_ranges(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore) -> list[Span]:
    """One span per cached segment, in prompt order, with its rank and owning module."""
    fresh = encoded.fresh_keys()
    out = []
    for at in plan.placed():
        if not at.cached:
            continue
        s = at.segment
        key, off = encoded.locate(s.piece, s.scaffold)
        out.append(Span(store.get(key), off + s.offset, off + s.offset + len(s), at.rank, at.module, key in fresh))
    return out


def slot_owners(ranges: list[Span], layer: int, index: dict[str, int]) -> torch.Tensor:
    """Each buffer slot's module index in ``layer`` (-1: no module's)."""
    parts = []
    for span in ranges:
        n = len(span) if span.entry.level else len(span.entry.kept_at(layer, span.start, span.end))
        parts.append(torch.full((n,), -1 if span.module is None else index[span.module], dtype=torch.long))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def module_slots(ranges: list[Span], n_layers: int) -> list[torch.Tensor]:
    """Per layer, which buffer slots hold a module's token."""
    index = {s.module: 0 for s in ranges if s.module is not None}
    if all(s.entry.level for s in ranges):
        shared = slot_owners(ranges, 0, index) >= 0
        return [shared] * n_layers
    return [slot_owners(ranges, layer, index) >= 0 for layer in range(n_layers)]
