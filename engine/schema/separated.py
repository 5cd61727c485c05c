"""The separator form LMCache's CacheBlend reads (docs/scale-out.md): the prompt's opening, then each imported module
tokenized alone (no BOS) with the separator's token ids before it, then the separator and the rest of the prompt.

CacheBlend stores and looks up the KV of each chunk between separators on its own, so a module's KV is found
whatever precedes it, and recomputes a share of tokens to repair the cross-attention. The studio renders the form;
running it needs vLLM with LMCache on a GPU. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from engine.schema.layout import ANONYMOUS
from engine.schema.plan import PromptPlan

SEPARATOR = " # # "  # LMCache's default LMCACHE_BLEND_SPECIAL_STR


@dataclass(frozen=True)
class SeparatedPrompt:
    """A prompt in the separator form: token ids, and where each module's chunk lies in them."""

    token_ids: tuple[int, ...]
    separator: str
    separator_ids: tuple[int, ...]
    chunks: tuple[tuple[str, int, int], ...]  # (module, start, end) into token_ids, in prompt order


def separated(encode: Callable[[str], list[int]], head: Sequence[int], chunks: Sequence[tuple[str, str]],
              tail: Sequence[int], separator: str = SEPARATOR) -> SeparatedPrompt:
    """``head``, then for each (name, text) of ``chunks`` the separator and the text encoded alone, then the
    separator and ``tail``. ``encode`` adds no special tokens (a TextCodec's)."""
    sep = tuple(encode(separator))
    ids, spans = list(head), []
    for name, text in chunks:
        ids += sep
        start = len(ids)
        ids += encode(text)
        spans.append((name, start, len(ids)))
    ids += sep
    ids += tail
    return SeparatedPrompt(tuple(ids), separator, sep, tuple(spans))


def separated_plan(plan: PromptPlan, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                   separator: str = SEPARATOR) -> SeparatedPrompt:
    """``plan`` in the separator form: the tokens before its first module as they are, each imported module's text
    (its tokens in the plan, decoded) encoded alone, the tokens after its last module as they are."""
    units = module_runs(plan)
    if not units:
        return separated(encode, plan.token_ids, (), (), separator)
    ids = plan.token_ids
    chunks = [(name, decode(ids[a:b])) for name, a, b in units]
    return separated(encode, ids[:units[0][1]], chunks, ids[units[-1][2]:], separator)


def module_runs(plan: PromptPlan) -> list[tuple[str, int, int]]:
    """(top module, start, end) of each run of the plan's tokens that one imported module owns, its arguments and
    uncached text included (not :func:`engine.schema.plan.owning_module`'s rule: the text is the module's)."""
    runs: list[tuple[str, int, int]] = []
    for at in plan.placed():
        owner = at.segment.owner
        top = plan.layout.modules[owner].top if owner != ANONYMOUS else None
        if top is not None and runs and runs[-1][0] == top and runs[-1][2] == at.rank:
            runs[-1] = (top, runs[-1][1], at.ranks.stop)
        elif top is not None:
            runs.append((top, at.rank, at.ranks.stop))
    return runs
