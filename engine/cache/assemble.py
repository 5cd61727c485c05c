"""What a run copies from the store into its buffer, as (entry, first, end[, rank | module]) ranges.

No timing here: :func:`fetch_entries` runs before the clock starts, so a MissingEntry never does.
"""

from __future__ import annotations

import torch

from engine.cache.compress import QuestionRetention
from engine.cache.encode import EncodedSchema
from engine.cache.store import ModuleStore
from engine.kv import LayeredKV
from engine.schema.layout import ANONYMOUS
from engine.schema.plan import CACHED, PromptPlan


def fetch_entries(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore) -> None:
    """Get every store entry a cached run of ``plan`` reads."""
    for key in used_keys(plan, encoded):
        store.get(key)


def used_keys(plan: PromptPlan, encoded: EncodedSchema) -> list[str]:
    """Store keys a cached run of ``plan`` reads."""
    return sorted({encoded.locate(s.piece, s.scaffold)[0] for s in plan.segments if s.kind == CACHED})


def token_place(plan: PromptPlan, k: int) -> dict:
    """Where prompt token ``k`` comes from: {"token", "source", "owner"}."""
    start = 0
    for seg in plan.segments:
        if k < start + len(seg):
            return {"token": k, "source": seg.source, "owner": seg.owner}
        start += len(seg)
    return {"token": k, "source": "end", "owner": ""}


def question_retention(plan: PromptPlan, encoded: EncodedSchema) -> QuestionRetention | None:
    """The run-time retention of ``question`` compression, else None."""
    if not encoded.compression.at_run:
        return None
    anon = encoded.module_keys.get(ANONYMOUS)
    marks = [encoded.locate(s.piece, s.scaffold)[0] != anon for s in plan.segments if s.kind == CACHED
             for _ in range(len(s))]
    return QuestionRetention(encoded.compression, torch.tensor(marks, dtype=torch.bool))


def copy_list(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore) -> list:
    """The ranges to copy, adjacent ones merged."""
    out: list = []
    for seg in plan.segments:
        if seg.kind != CACHED:
            continue
        key, off = encoded.locate(seg.piece, seg.scaffold)
        entry = store.get(key)
        a = off + seg.offset
        b = a + len(seg)
        if out and out[-1][0] is entry and out[-1][2] == a:
            out[-1] = (entry, out[-1][1], b)
        else:
            out.append((entry, a, b))
    return out


def copy_list_ranked(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, skip: set[int]) -> list:
    """The ranges to copy with their first token's rank, leaving out ranks ``skip``."""
    out: list = []
    rank = 0
    for seg in plan.segments:
        if seg.kind == CACHED:
            key, off = encoded.locate(seg.piece, seg.scaffold)
            entry = store.get(key)
            for i in range(len(seg)):
                if rank + i in skip:
                    continue
                a = off + seg.offset + i
                if out and out[-1][0] is entry and out[-1][2] == a and out[-1][3] + a - out[-1][1] == rank + i:
                    out[-1] = (entry, out[-1][1], a + 1, out[-1][3])
                else:
                    out.append((entry, a, a + 1, rank + i))
        rank += len(seg)
    return out


def prefilled(plan: PromptPlan, redo: set[int]) -> tuple[list[int], list[int], list[int]]:
    """(token ids, positions, ranks) of the uncached tokens and ranks ``redo``."""
    ids: list[int] = []
    pos: list[int] = []
    ranks: list[int] = []
    rank = 0
    for s in plan.segments:
        for i, (t, p) in enumerate(zip(s.token_ids, s.positions)):
            if s.kind != CACHED or rank + i in redo:
                ids.append(t)
                pos.append(p)
                ranks.append(rank + i)
        rank += len(s)
    return ids, pos, ranks


def buffer_ranks(copies: list, n_layers: int) -> list[torch.Tensor]:
    """Per layer, the ranks of the buffer's entries in buffer order."""
    every = [torch.arange(r, r + b - a) for _, a, b, r in copies]
    if not any(isinstance(entry, LayeredKV) for entry, *_ in copies):
        shared = torch.cat(every) if every else torch.zeros(0, dtype=torch.long)
        return [shared] * n_layers
    out = []
    for layer in range(n_layers):
        parts = []
        for (entry, a, b, r), full in zip(copies, every):
            if isinstance(entry, LayeredKV):
                kept = entry.kept[layer]
                kept = kept[(kept >= a) & (kept < b)]
                parts.append(kept - a + r)
            else:
                parts.append(full)
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
    return out


def module_ranges(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore) -> list:
    """The ranges per cached segment, with their top-level module or None."""
    out = []
    for s in plan.segments:
        if s.kind != CACHED:
            continue
        key, off = encoded.locate(s.piece, s.scaffold)
        unit = None if s.scaffold or s.owner == ANONYMOUS else plan.layout.modules[s.owner].top
        out.append((store.get(key), off + s.offset, off + s.offset + len(s), unit))
    return out


def slot_owners(ranges: list, layer: int, index: dict[str, int]) -> torch.Tensor:
    """Each buffer slot's module index in ``layer`` (-1: no module's)."""
    parts = []
    for entry, a, b, unit in ranges:
        n = b - a
        if isinstance(entry, LayeredKV):
            kept = entry.kept[layer]
            n = int(((kept >= a) & (kept < b)).sum())
        parts.append(torch.full((n,), -1 if unit is None else index[unit], dtype=torch.long))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def module_slots(ranges: list, n_layers: int) -> list[torch.Tensor]:
    """Per layer, which buffer slots hold a module's token."""
    index = {u: 0 for *_, u in ranges if u is not None}
    if not any(isinstance(e, LayeredKV) for e, *_ in ranges):
        shared = slot_owners(ranges, 0, index) >= 0
        return [shared] * n_layers
    return [slot_owners(ranges, layer, index) >= 0 for layer in range(n_layers)]
