"""Which cached tokens a repaired run recomputes (docs/arms.md, repair)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.settings import CONTEXTUAL, canonical_mode
from engine.schema.layout import ANONYMOUS
from engine.schema.plan import CACHED, PromptPlan, Segment

# isolated mode: repair the first module (bench/fidelity.py)
REPAIR_FIRST_ISOLATED = True


@dataclass(frozen=True)
class RepairSelection:
    """The cached tokens a repaired run recomputes."""

    k: int
    ranks: tuple[int, ...]  # prompt ranks, ascending
    positions: tuple[int, ...]
    links: int

    def __len__(self) -> int:
        return len(self.ranks)


def select_repair(plan: PromptPlan, k: int, mode: str, first: bool | None = None) -> RepairSelection:
    """The first ``k`` cached tokens after each inexact link."""
    first = REPAIR_FIRST_ISOLATED if first is None else first
    ranks: list[int] = []
    positions: list[int] = []
    links = 0
    rank = 0
    prev: tuple | None = None  # None after prefilled tokens
    only_prefix = True
    budget = 0
    for s in plan.segments:
        if s.kind != CACHED:
            prev, only_prefix = None, False
            rank += len(s)
            continue
        unit = _unit(plan, s)
        if unit != prev:
            exact = only_prefix and (unit == ("anonymous",) or _first_is_kept(unit, mode, first))
            budget = 0 if exact else k
            links += not exact and k > 0
            only_prefix = only_prefix and unit == ("anonymous",)
        take = min(budget, len(s))
        ranks += range(rank, rank + take)
        positions += s.positions[:take]
        budget -= take
        prev = unit
        rank += len(s)
    return RepairSelection(k=k, ranks=tuple(ranks), positions=tuple(positions), links=links)


def _unit(plan: PromptPlan, s: Segment) -> tuple:
    """The unit a segment's KV was encoded in."""
    if s.scaffold:
        return ("scaffold", s.scaffold)
    if s.owner == ANONYMOUS:
        return ("anonymous",)
    return ("module", plan.layout.modules[s.owner].top)


def _first_is_kept(unit: tuple, mode: str, first: bool) -> bool:
    """Whether the unit after the anonymous prefix saw it."""
    if unit[0] == "scaffold" or canonical_mode(mode) == CONTEXTUAL:
        return True
    return not first
