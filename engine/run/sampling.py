"""The next token: greedy, or sampled with temperature and top-p."""

from __future__ import annotations

import math

import torch

from engine.errors import NonFiniteLogits
from engine.run.types import Sampling


def sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None, arm: str = "", at: int = 0) -> int:
    """The next token from ``logits`` [vocab] (``arm``, ``at``: for errors)."""
    if sampling.temperature <= 0:
        return _finite(logits, int(torch.argmax(logits)), arm, at)
    probs = torch.softmax(logits.float() / sampling.temperature, -1)
    if not bool(torch.isfinite(probs).all()):  # the logits overflowed: greedy is the limit
        return _finite(logits, int(torch.argmax(logits)), arm, at)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < sampling.top_p
        keep[0] = True  # a top-p below float32's smallest number would keep none
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def _finite(logits: torch.Tensor, tok: int, arm: str, at: int) -> int:
    """``tok``, the argmax, checked (argmax picks a NaN or inf)."""
    if not math.isfinite(float(logits[tok])):
        where = "the first token" if at == 0 else f"token {at + 1}"
        raise NonFiniteLogits(f"the model produced non-finite logits (NaN or inf) at {where} of the {arm or 'run'} "
                              "arm: its weights or rope settings are broken (a NaN in the checkpoint, a rope_theta "
                              "or rope_scaling that overflows); check the model's config.json and weights")
    return tok
