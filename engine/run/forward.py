"""Every forward over leased KV: a prefill of one lease, a decode step over one or several. Kernels write at the
slots the leases' lengths give; this module alone counts them, once per forward (gpt-fast's ``input_pos``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.kv.pool import Lease, RowsCache
from engine.model import graphs
from engine.model import step as cpp
from engine.model.attend import PLAIN, AttentionSpec
from engine.model.load import LoadedModel


@dataclass
class Row:
    """A sequence's part of a decode step."""

    lease: Lease
    token: int
    position: int
    spec: AttentionSpec = PLAIN


def prefill(lm: LoadedModel, lease: Lease, ids: Sequence[int], pos: Sequence[int], spec: AttentionSpec = PLAIN,
            graphable: bool = True) -> torch.Tensor:
    """Logits [vocab] after ``ids`` at ``pos``, their KV added to ``lease`` (a CUDA graph where one applies)."""
    cache = lease.cache()
    logits = graphs.forward(lm, cache, ids, pos, spec) if graphable else None
    if logits is not None:
        logits = logits[0]
    else:
        logits = lm.model(input_ids=torch.tensor([list(ids)], device=lm.device),
                          position_ids=torch.tensor([list(pos)], device=lm.device), past_key_values=cache,
                          use_cache=True, logits_to_keep=1, attn_spec=spec).logits[0, -1]
    lease.advance(len(ids))
    return logits


def step(lm: LoadedModel, rows: list[Row]) -> torch.Tensor:
    """Logits [rows, vocab] of one decode step of every row (several: each :func:`batchable`)."""
    for row in rows:
        if row.spec.focus is not None:
            row.spec.focus.saw(torch.tensor([[row.token]]))  # the focus follows the fed token
    ids, positions = [r.token for r in rows], [r.position for r in rows]
    fast = cpp.decoder(lm.model, lm.weights) if all(_focus_only(r.spec) for r in rows) else None
    if fast is not None and all(r.lease.level for r in rows):
        leases = [r.lease for r in rows]
        logits = fast(ids, positions, leases[0].base, torch.tensor([x.start for x in leases]),
                      torch.tensor([x.length for x in leases]), _visible(rows, "cpu"))
    elif len(rows) == 1:
        logits = _one(lm, rows[0])
    else:
        logits = _batched(lm, rows)
    for row in rows:
        row.lease.advance(1)
    return logits


def batchable(lm: LoadedModel, row: Row) -> bool:
    """Whether ``row`` may share a step: a level lease of a pool, attention changed by nothing but a focus."""
    from engine.model.positions import needs_positions

    spec = row.spec
    return (row.lease.pool is not None and row.lease.level and lm.attention == "pml" and not needs_positions(lm.model)
            and spec.ranks is None and spec.ape is None and spec.scorer is None and spec.keys is None)


def _focus_only(spec: AttentionSpec) -> bool:
    """Nothing but a focus changes its attention (the C++ step reads each row's visible keys)."""
    return dataclasses.replace(spec, focus=None).plain


def _visible(rows: list[Row], device) -> torch.Tensor | None:
    """[rows, longest + 1] bool: the keys each row reads, where a focus narrowed one; else None (every key)."""
    focused = [r.spec.focus is not None and r.spec.focus.focus is not None for r in rows]
    if not any(focused):
        return None
    keys = max(r.lease.length for r in rows) + 1
    out = torch.ones(len(rows), keys, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        if focused[i]:
            out[i] = row.spec.focus.visible(keys, device)
    return out


def _one(lm: LoadedModel, row: Row) -> torch.Tensor:
    cache = row.lease.cache()
    graphed = graphs.forward(lm, cache, [row.token], [row.position], row.spec)
    if graphed is not None:  # a CUDA graph's replay (engine/model/graphs.py)
        return graphed
    out = lm.model(input_ids=torch.tensor([[row.token]], device=lm.device),
                   position_ids=torch.tensor([[row.position]], device=lm.device), past_key_values=cache,
                   use_cache=True, logits_to_keep=1, attn_spec=row.spec)
    return out.logits[:, -1]


def _batched(lm: LoadedModel, rows: list[Row]) -> torch.Tensor:
    """One eager forward over several leases (:class:`RowsCache`), each focused row's keys masked."""
    cache = RowsCache([r.lease for r in rows])
    keys = cache.key_mask()  # [rows, 1, 1, keys]
    visible = _visible(rows, keys.device)
    if visible is not None:
        keys[:, 0, 0] &= visible
    out = lm.model(input_ids=torch.tensor([[r.token] for r in rows], device=lm.device),
                   position_ids=torch.tensor([[r.position] for r in rows], device=lm.device), past_key_values=cache,
                   use_cache=True, logits_to_keep=1, attn_spec=AttentionSpec(keys=keys))
    return out.logits[:, -1]
