"""Which cached tokens a repaired run recomputes (link-token recompute, after EPIC).

Separately encoded units never attended to what precedes them in a prompt: a module encoded in
isolation has not seen the system text or the modules before it, the module text after a
filled param argument has seen placeholders instead of the argument, and anonymous template
text after a module (``<|im_end|>`` between turns) has seen no module at all. EPIC (arXiv
2410.15332) shows that recomputing the first few tokens at each such *link* — prefilled with
the new text, against the assembled cache — recovers most of the lost accuracy.

A **link** is where a run of cached tokens starts that continues a different encoding unit
than the token before it, or that follows prefilled (uncached) tokens. Units: the anonymous
text, each top-level module (its nested modules were encoded with it), each scaffold. The
first ``k`` tokens from every link are recomputed, except at links whose KV is exact already:

* the anonymous prefix (it starts the prompt and attends only to itself);
* the first module after that prefix when it was encoded seeing the prefix — ``contextual``
  mode, or a scaffold — and nothing else came before it.

In ``isolated`` mode the first module never saw the system text; ``first`` says whether it is
recomputed too (default :data:`REPAIR_FIRST_ISOLATED`, chosen by measurement: bench/fidelity.py).

Tokens are named by **rank**: their index in the materialised prompt (the baseline's order).
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.settings import CONTEXTUAL, canonical_mode
from engine.schema.layout import ANONYMOUS
from engine.schema.plan import CACHED, PromptPlan, Segment

# Recompute the first module's link tokens in isolated mode (it never saw the system text).
REPAIR_FIRST_ISOLATED = True


@dataclass(frozen=True)
class RepairSelection:
    """The cached tokens one repaired run recomputes."""

    k: int
    ranks: tuple[int, ...]  # indices into plan.token_ids, ascending
    positions: tuple[int, ...]  # their position ids, same order
    links: int  # link points that were repaired (exact ones not counted)

    def __len__(self) -> int:
        return len(self.ranks)


def select_repair(plan: PromptPlan, k: int, mode: str, first: bool | None = None) -> RepairSelection:
    """The first ``k`` cached tokens after every inexact link of ``plan`` (see the module docstring).

    ``mode`` is the encoding mode of the module entries; ``first`` (isolated mode only) overrides
    :data:`REPAIR_FIRST_ISOLATED`. ``k`` larger than every unit recomputes every inexact token.
    """
    first = REPAIR_FIRST_ISOLATED if first is None else first
    ranks: list[int] = []
    positions: list[int] = []
    links = 0
    rank = 0
    prev: tuple | None = None  # unit of the previous segment; None after prefilled tokens
    only_prefix = True  # nothing but the cached anonymous prefix so far
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
    """The encoding unit a cached segment's KV comes from."""
    if s.scaffold:
        return ("scaffold", s.scaffold)
    if s.owner == ANONYMOUS:
        return ("anonymous",)
    return ("module", plan.layout.modules[s.owner].top)


def _first_is_kept(unit: tuple, mode: str, first: bool) -> bool:
    """Whether the unit right after the anonymous prefix keeps its stored KV: it was encoded seeing
    that whole prefix (``contextual`` mode, a scaffold), or ``first`` is False in ``isolated`` mode."""
    if unit[0] == "scaffold" or canonical_mode(mode) == CONTEXTUAL:
        return True
    return not first
