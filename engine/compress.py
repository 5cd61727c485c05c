"""Layer-wise compression of stored module KV, after PyramidInfer (arXiv 2405.12532).

While a unit is encoded, the attention that its most recent queries (the last ~40 % of its
tokens, weighted towards the newest) pay to each of its tokens is collected per layer
(:class:`engine.kv.AttentionScorer`). Each stored entry then keeps, per layer, the recent
window plus the highest-scoring tokens, fewer with depth: layer ``l`` keeps a fraction
``r0 * gamma**l`` of the tokens, ``gamma`` chosen so that the mean over layers equals the
requested retention. Two controls keep the same bytes: ``uniform`` (the same fraction, by
score, in every layer) and ``recent`` (the last tokens only, every layer).

Kept entries keep the positions they were encoded at (RoPE is already applied), so a
compressed module is used exactly like a full one, with fewer keys per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import EngineError
from .kv import LayeredKV, ModuleKV

METHODS = ("pyramid", "uniform", "recent")


@dataclass(frozen=True)
class Compression:
    retention: float = 1.0  # mean fraction of each entry's tokens kept per layer
    method: str = "pyramid"
    recent_frac: float = 0.4  # queries whose attention scores the tokens
    window_frac: float = 0.1  # most recent tokens always kept

    def __post_init__(self):
        if not 0.0 < self.retention <= 1.0:
            raise EngineError(f"retention must be in (0, 1], got {self.retention}; e.g. 0.5 keeps half the KV")
        if self.method not in METHODS:
            raise EngineError(f"unknown compression method '{self.method}'; use one of {', '.join(METHODS)}")

    @property
    def active(self) -> bool:
        return self.retention < 1.0

    def key(self) -> str:
        """Part of every cache key: entries compressed differently never mix."""
        if not self.active:
            return "full"
        return f"{self.method}:{self.retention:.4f}:{self.recent_frac}:{self.window_frac}"

    def layer_ratios(self, n_layers: int) -> list[float]:
        """Fraction of tokens each layer keeps; their mean is the retention."""
        r = self.retention
        if self.method != "pyramid" or n_layers == 1 or r >= 1.0:
            return [r] * n_layers
        r0 = min(1.0, 1.5 * r)
        lo, hi = 0.0, 1.0
        for _ in range(60):  # mean(r0 * g**l) is increasing in g: bisect for mean == r
            g = (lo + hi) / 2
            mean = sum(r0 * g ** i for i in range(n_layers)) / n_layers
            lo, hi = (g, hi) if mean < r else (lo, g)
        return [r0 * lo ** i for i in range(n_layers)]


def compress(entry: ModuleKV, scores: list[torch.Tensor] | None, comp: Compression) -> LayeredKV:
    """Keep, per layer, the tokens ``comp`` chooses from a full entry (``scores[l]``: [tokens])."""
    n = len(entry)
    n_layers = entry.kv.shape[0]
    window = max(1, math.ceil(comp.window_frac * n))
    layers, kept = [], []
    for i, ratio in enumerate(comp.layer_ratios(n_layers)):
        k = min(n, max(1, math.floor(ratio * n)))
        if comp.method == "recent" or scores is None:
            keep = torch.arange(n - k, n)
        else:
            recent = torch.arange(max(0, n - min(window, k)), n)
            rest = k - recent.numel()
            older = scores[i][: n - recent.numel()].float()
            top = torch.topk(older, rest).indices if rest > 0 else torch.empty(0, dtype=torch.long)
            keep = torch.cat([top, recent]).sort().values
        kept.append(keep.to(torch.long))
        layers.append(entry.kv[i][:, :, keep.to(entry.kv.device)].contiguous())
    return LayeredKV(layers, kept, entry.positions, entry.token_ids)
