"""Layer-wise compression of module KV, after PyramidInfer and SnapKV (docs/module-memory.md)."""

from __future__ import annotations

import math

import torch

from engine.cache.settings import METHODS, Compression  # noqa: F401  (re-exported)
from engine.kv import Lease, LayeredKV, ModuleKV
from engine.model.attend import QueryCapture, attention_weights

RETENTION_NOTE = ("pyramid, uniform and recent drop module tokens when a module is stored, before any question "
                  "is known, so they can drop the answer; question keeps the stored modules whole and drops "
                  "tokens from the run's cache only after the question was read, keeping what it attends to.")
METHOD_NOTES = {
    "pyramid": "query-agnostic: chosen at encoding by the module's own last tokens, fewer in deeper layers",
    "uniform": "query-agnostic: chosen at encoding by the module's own last tokens, the same share in every layer",
    "recent": "query-agnostic: the module's last tokens only, in every layer",
    "question": "question-aware: chosen after the prompt's new text is prefilled, by its attention (pooled over "
                "31 tokens), fewer in deeper layers; stored modules stay whole",
}


def compress(entry: ModuleKV, scores: list[torch.Tensor] | None, comp: Compression) -> LayeredKV:
    """Keep, per layer, the tokens ``comp`` chooses (``scores[l]``: [tokens])."""
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


class QuestionRetention:
    """``question`` retention: watch the prefill, then thin the buffer."""

    def __init__(self, comp: Compression, candidates: torch.Tensor):
        self.comp = comp
        self.candidates = candidates  # [cached tokens] bool
        self.capture = QueryCapture(comp.question_window)  # the prefill's scorer: its newest queries, for apply

    def apply(self, buf: Lease) -> None:
        """Thin each layer and KV head to the non-module and the top-scored module tokens."""
        n_cached = self.candidates.shape[0]
        m = int(self.candidates.sum())
        if m == 0 or not self.capture.queries:
            return
        for layer, ratio in enumerate(self.comp.layer_ratios(buf.data.shape[0])):
            length = buf.lengths[layer]
            keys = buf.data[layer, 0, :, :, :length]  # [1, kv_heads, length, head_dim]
            probs = attention_weights(self.capture.queries[layer], keys, self.capture.scaling[layer])
            scores = probs.sum((1, 2))[:, :n_cached]  # [kv_heads, cached]
            keep = min(m, max(1, math.floor(ratio * m)))
            idx = question_keep(scores, self.candidates.to(scores.device), keep, self.comp.pool_kernel)
            new = torch.arange(n_cached, length, device=idx.device).expand(idx.shape[0], -1)
            buf.keep(layer, torch.cat([idx, new], 1))


def question_keep(scores: torch.Tensor, candidates: torch.Tensor, keep: int, kernel: int) -> torch.Tensor:
    """Sorted indices kept per KV head: every non-candidate, and the ``keep`` best pooled candidates."""
    scores = scores.float().masked_fill(~candidates, 0.0)
    pooled = torch.nn.functional.max_pool1d(scores[None], kernel, stride=1, padding=kernel // 2)[0]
    pooled = pooled.masked_fill(~candidates, float("-inf"))
    top = torch.topk(pooled, keep, dim=-1).indices  # [kv_heads, keep]
    fixed = torch.nonzero(~candidates).flatten().expand(scores.shape[0], -1)
    return torch.cat([fixed, top], 1).sort(-1).values
