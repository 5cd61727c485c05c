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

import torch

from .config import METHODS, Compression  # noqa: F401  (re-exported)
from .kv import LayeredKV, ModuleKV


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
