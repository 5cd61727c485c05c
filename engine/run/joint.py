"""The routed arm's recompute of the modules it keeps (docs/arms.md, routed): all of their tokens or the share the
question attends to most, and its runs kept in the prefix tree so that an identical request reads them back."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
import torch

from engine.cache.assemble import (buffer_ranks, module_ranges, precomputed_tokens, prefilled, ranked_copies,
                                   used_keys)
from engine.cache.encode import EncodedSchema
from engine.cache.prefix import PrefixCache
from engine.cache.store import ModuleStore
from engine.kv import Lease
from engine.model.attend import AttentionSpec, Focus
from engine.model.load import LoadedModel
from engine.run.attention import rank_mask
from engine.run.timing import Fill
from engine.run.types import Routing
from engine.schema.plan import PromptPlan

PER_MODULE = 0.5  # of the recompute budget, the part spread over the kept modules by size (an every-module question)
# A partial recompute takes at most this share of all the prompt's module tokens: a question that keeps (nearly) every
# module recomputes what share 0.2 did (the tune split's figure there), and the API still counts >= 70 % cached.
PROMPT_CAP = 0.2
MARK = 1 << 50  # a run's tree key starts with MARK | its hash: never a token id, never a (token, position) code
_POSITION_SHIFT = 24  # a code is token id + (position + 1) << 24: token ids stay under 2 ** 24


@dataclass(frozen=True)
class StoredRun:
    """What an earlier routed run left in the prefix tree: the key its visible tokens' KV lies under, its first
    token's logits (a repeat whose whole KV is still held prefills nothing) and its routing (a repeat reports the
    same choice)."""

    sequence: tuple[int, ...]  # MARK | hash, then each visible token's code, in its run's order
    last: tuple[int, int]  # (token id, position) of the prompt's last token
    routing: Routing  # the run's RoutedInfo (engine/arms/routed.py)
    logits: torch.Tensor | None = None  # [vocab] after the prompt's last token, on the CPU
    focus: Focus | None = None  # the run's decode-time focus, its owners in stored order


def module_ranks(plan: PromptPlan, modules: set[str]) -> dict[str, list[int]]:
    """{module: the prompt ranks of its cached tokens}, for the top-level ``modules``."""
    out: dict[str, list[int]] = {m: [] for m in modules}
    for at in plan.placed():
        if at.module in out:
            out[at.module] += at.ranks
    return out


def select_tokens(plan: PromptPlan, by_key: torch.Tensor | None, kept: tuple[str, ...], share: float,
                  sinks: int) -> tuple[int, ...] | None:
    """Ranks to recompute: each kept module's first ``sinks`` tokens, then the ``share`` of their tokens the question
    attends to most (``by_key``: per cached slot, in prompt order), PER_MODULE of it in every module by its size, and
    under 1 at most PROMPT_CAP of all module tokens; None when the scout read no score per token (compressed entries)."""
    cached = [r for at in plan.placed() if at.cached for r in at.ranks]
    if by_key is None or by_key.shape[0] != len(cached):
        return None
    score = dict(zip(cached, by_key.tolist()))
    best = lambda rs: sorted(rs, key=lambda r: (-score[r], r))  # noqa: E731
    per = module_ranks(plan, set(kept))
    picked = {r for rs in per.values() for r in rs[:sinks]}
    total = sum(len(rs) for rs in per.values())
    modules = sum(len(at.segment) for at in plan.placed() if at.module is not None)
    rate = share if share >= 1 or not total else min(share, PROMPT_CAP * modules / total)  # 1: the full recompute
    budget = round(rate * total)
    chosen: set[int] = set()
    for rs in per.values():
        chosen.update(best([r for r in rs if r not in picked])[: round(rate * PER_MODULE * len(rs))])
    rest = best([r for rs in per.values() for r in rs if r not in picked and r not in chosen])
    chosen.update(rest[: max(0, budget - len(chosen))])
    return tuple(sorted(picked | chosen))


def recompute_fill(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, buf: Lease,
                   redo: set[int], drop: set[int]) -> tuple[Fill, list[int]]:
    """Fill ``buf`` (emptied) to prefill ranks ``redo`` with the uncached tokens in prompt order, ranks ``drop``
    left out; and each buffer slot's rank."""
    ranges = module_ranges(plan, encoded, store)
    copies = ranked_copies(ranges, redo | drop)
    for span in copies:
        span.write_into(buf)
    ids, pos, ranks = prefilled(plan, redo)
    positions = plan.positions
    fill = Fill(ids, pos, [s.entry for s in copies], reused_tokens=sum(len(s) for s in copies),
                precomputed_tokens=precomputed_tokens(ranges, redo),  # ``drop`` too: the scout read its stored KV
                recomputed_positions=tuple(positions[r] for r in sorted(redo)),
                prefill=AttentionSpec(ranks=rank_mask(lm, copies, ranks)))
    slots = buffer_ranks(copies, lm.n_layers)[0].tolist() if copies else []
    return fill, slots + ranks


def run_key(plan: PromptPlan, encoded: EncodedSchema, settings: tuple) -> int:
    """The tree's first token for this prompt, these encodings and routed settings."""
    text = repr((plan.token_ids, plan.positions, used_keys(plan, encoded), settings)).encode()
    return MARK | int.from_bytes(hashlib.blake2b(text, digest_size=5).digest(), "big")


def recall(prefix: PrefixCache | None, key: int | None) -> tuple[StoredRun, list, bool] | None:
    """The run stored under ``key``, its KV slices (the marker's slot cut off) and whether they reach its last
    token, when at least all but that token are still in the tree."""
    run = None if prefix is None or key is None else prefix.recall(key)
    if run is None:
        return None
    match = prefix.match(run.sequence, limit=len(run.sequence) - (run.logits is None))
    if match.reused < len(run.sequence) - 1:
        return None
    pieces = [(e, a + (i == 0), b) for i, (e, a, b) in enumerate(match.pieces)]
    return run, [p for p in pieces if p[2] > p[1]], match.reused == len(run.sequence)


# what a repeat reads back, all known only after TTFT
def keep_run(prefix: PrefixCache, key: int, plan: PromptPlan, buf: Lease, slots: list[int], entries,
             routing: Routing, keep: list[str], positions=None, logits: torch.Tensor | None = None,
             focus: Focus | None = None) -> int:
    """Store the run's prompt KV (``slots``: each buffer slot's rank) under ``key`` in its order (a repeat sums as it
    did), the prompt's last token last, with ``logits`` and ``focus``; tokens stored. ``positions``: each rank's
    position id, when the run did not use the plan's."""
    if not all(e.level for e in entries) or not slots:
        return 0
    last = max(range(len(slots)), key=slots.__getitem__)
    order = [i for i in range(len(slots)) if i != last] + [last]
    ranks = [slots[i] for i in order]
    ids, positions = plan.token_ids, plan.positions if positions is None else positions
    kv = buf.data[:, :, 0, :, : len(slots)][:, :, :, torch.tensor(order, device=buf.data.device)]
    kv = torch.cat([torch.zeros_like(kv[:, :, :, :1]), kv], 3)
    sequence = (key, *(ids[r] + ((positions[r] + 1) << _POSITION_SHIFT) for r in ranks))
    stored = prefix.insert(sequence, kv, keep)
    if focus is not None:  # slots past the owners (the new tokens) belong to no module
        owners = torch.cat([focus.owners, focus.owners.new_full((len(slots) - len(focus.owners),), -1)])
        focus = focus.fresh(owners[torch.tensor(order)])
    prefix.remember(key, StoredRun(sequence, (ids[ranks[-1]], positions[ranks[-1]]), routing, logits, focus))
    return stored

