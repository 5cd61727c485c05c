"""Which cached tokens a repaired run recomputes (docs/arms.md, repair)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.settings import CONTEXTUAL, canonical_mode
from engine.schema.plan import Placed, PromptPlan

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
    prev: tuple | None = None  # None after prefilled tokens
    only_prefix = True
    budget = 0
    for at in plan.placed():
        if not at.cached:
            prev, only_prefix = None, False
            continue
        unit = _unit(at)
        if unit != prev:
            exact = only_prefix and (unit == ("anonymous",) or _first_is_kept(unit, mode, first))
            budget = 0 if exact else k
            links += not exact and k > 0
            only_prefix = only_prefix and unit == ("anonymous",)
        take = min(budget, len(at.segment))
        ranks += at.ranks[:take]
        positions += at.segment.positions[:take]
        budget -= take
        prev = unit
    return RepairSelection(k=k, ranks=tuple(ranks), positions=tuple(positions), links=links)


def _unit(at: Placed) -> tuple:
    """The unit a cached segment's KV was encoded in."""
    if at.segment.scaffold:
        return ("scaffold", at.segment.scaffold)
    return ("anonymous",) if at.module is None else ("module", at.module)


def _first_is_kept(unit: tuple, mode: str, first: bool) -> bool:
    """Whether the unit after the anonymous prefix saw it."""
    if unit[0] == "scaffold" or canonical_mode(mode) == CONTEXTUAL:
        return True
    return not first
