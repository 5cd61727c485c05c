"""Parts of an arm's attention spec built from its buffer, and refusals of models that cannot take them."""

from __future__ import annotations

import torch

from engine.cache.assemble import Span, buffer_ranks, module_slots
from engine.errors import EngineError
from engine.model.attend import ATTENTION, ApeScale, RankMask
from engine.model.load import LoadedModel
from engine.model.positions import needs_positions


def rank_mask(lm: LoadedModel, copies: list[Span], ranks: list[int]) -> RankMask:
    """The prompt-order mask of prefilled ``ranks`` over ``copies``."""
    return RankMask(buffer_ranks(copies, lm.n_layers), torch.tensor(ranks, dtype=torch.long))


def check_recompute(lm: LoadedModel, what: str, fix: str) -> None:
    """Refuse a prompt-order mask to a model whose attention it cannot drive."""
    if getattr(lm.model.config, "_attn_implementation", "") != ATTENTION:
        raise EngineError(f"{what} needs the model to run with SDPA attention (the loaded model uses "
                          f"'{lm.model.config._attn_implementation}'); {fix}")
    if needs_positions(lm.model):
        raise EngineError(f"{what} is not available for models with sliding-window or ALiBi attention yet "
                          f"(its prompt-order mask would replace their position-aware one); {fix}")


def ape_scale(lm: LoadedModel, ranges: list[Span], ape: tuple[float, float] | None) -> ApeScale | None:
    """APE (T, S) over the modules of ``ranges`` (buffer order); None for plain attention."""
    if ape is None or tuple(ape) == (1.0, 1.0):
        return None
    check_ape(lm)
    return ApeScale(module_slots(ranges, lm.n_layers), *ape)


def check_ape(lm: LoadedModel) -> None:
    """Refuse APE to a model whose attention it cannot drive."""
    fix = "set ape-t and ape-s to 1"
    if getattr(lm.model.config, "_attn_implementation", "") != ATTENTION:
        raise EngineError(f"APE needs the model to run with SDPA attention (the loaded model uses "
                          f"'{lm.model.config._attn_implementation}'); {fix}")
    if needs_positions(lm.model) or getattr(lm.model.config, "attn_logit_softcapping", None):
        raise EngineError(f"APE is not available for models with sliding-window, ALiBi or soft-capped attention "
                          f"yet ('{lm.model.config.model_type}'); {fix}")
