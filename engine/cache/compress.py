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

Those three choose before any question is known, from the module's own last tokens, and on the
needle set they drop the answer (bench/compression.py). ``question`` (after SnapKV, arXiv
2404.14469, and PyramidInfer's own use of the prompt's last tokens) stores full entries and
chooses at run time: the prompt's new tokens are prefilled over the full assembled cache (time to
first token and the first token unchanged), the attention their newest queries paid to each
module token is summed per KV head, max-pooled over ``pool_kernel`` neighbours (a wide window
keeps a whole multi-token answer), and each layer keeps its PyramidInfer share of module tokens
per head; the anonymous text and the new tokens are always kept. Decoding then runs over the
smaller buffer (:class:`QuestionRetention`).
"""

from __future__ import annotations

import math

import torch

from engine.cache.settings import METHODS, Compression  # noqa: F401  (re-exported)
from engine.kv import KVBuffer, LayeredKV, ModuleKV
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


class QuestionRetention:
    """``question`` retention for one run: watch the prefill, then thin the buffer before decoding.

    ``candidates`` marks the cached tokens that may be dropped (module tokens; the anonymous text,
    which holds the attention sinks, is always kept).
    """

    def __init__(self, comp: Compression, candidates: torch.Tensor):
        self.comp = comp
        self.candidates = candidates  # [cached tokens] bool
        self.capture = QueryCapture(comp.question_window)  # the prefill's scorer: its newest queries, for apply

    def apply(self, buf: KVBuffer) -> None:
        """Keep, per layer and KV head, the anonymous and new tokens plus the top-scored module tokens."""
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
    """Sorted cached indices kept per KV head ([kv_heads, non-candidates + keep]): every non-candidate
    token, and the ``keep`` candidates whose score, max-pooled over ``kernel`` neighbours, is highest."""
    scores = scores.float().masked_fill(~candidates, 0.0)
    pooled = torch.nn.functional.max_pool1d(scores[None], kernel, stride=1, padding=kernel // 2)[0]
    pooled = pooled.masked_fill(~candidates, float("-inf"))
    top = torch.topk(pooled, keep, dim=-1).indices  # [kv_heads, keep]
    fixed = torch.nonzero(~candidates).flatten().expand(scores.shape[0], -1)
    return torch.cat([fixed, top], 1).sort(-1).values
