"""Sliding windows and ALiBi at position ids, not cache indices, over gapped caches (docs/architecture.md).

:func:`track_positions` passes a forward's :class:`Positions` to its attention as ``attn_positions`` (MPT and
Falcon read them from their cache) and extends the cache's record of key positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import ModelError

if TYPE_CHECKING:  # engine.model.load reads the family facts without torch
    import torch

# model_type -> label: the families tests/engine/test_families.py checks
TESTED_FAMILIES = {
    "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma3_text": "Gemma 3",
    "gemma2": "Gemma 2", "phi3": "Phi-3", "gpt_neox": "GPT-NeoX", "falcon": "Falcon", "mpt": "MPT",
}
# families whose own attention code is adapted here
OWN_ATTENTION = ("falcon", "mpt")
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")

@dataclass
class Positions:
    """Position ids of one forward's queries and, per layer, of the keys cached before it."""

    query: torch.Tensor  # [q] int64
    past: list[torch.Tensor]  # [layers] x [n_l] int64
    memo: dict = field(default_factory=dict)

    def keys(self, layer: int, kv: int) -> torch.Tensor:
        """Positions of the ``kv`` keys ``layer`` attends to: [kv] int64."""
        import torch

        past = self.past[layer] if layer < len(self.past) else self.past[-1]
        n = kv - self.query.shape[0]
        if n < 0 or past.shape[0] < n:
            raise ModelError(f"layer {layer} attends to {kv} keys but only {past.shape[0]} cached positions "
                             "are known; the cache was filled without recording its positions")
        return torch.cat([past[past.shape[0] - n:], self.query])

    def window_mask(self, layer: int, q: int, kv: int, window: int, device) -> torch.Tensor:
        """[1, 1, q, kv] bool: causal, and within ``window`` positions of the query."""
        import torch

        past = self.past[layer] if layer < len(self.past) else self.past[-1]
        key = ("window", id(past), kv, window, str(device))
        if key not in self.memo:
            kpos = self.keys(layer, kv).to(device)
            qpos = self.query.to(device)
            causal = torch.ones(q, kv, dtype=torch.bool, device=device).tril_(kv - q)
            self.memo[key] = (causal & ((qpos[:, None] - kpos[None, :]) < window))[None, None]
        return self.memo[key]


def attach(cache, positions: list[torch.Tensor] | torch.Tensor | None) -> None:
    """Record on ``cache`` the position ids of its keys (one tensor or one per layer)."""
    import torch

    if positions is None:
        return
    cache._pml_positions = [positions] if isinstance(positions, torch.Tensor) else list(positions)


def copied_positions(copies: list, n_layers: int) -> list[torch.Tensor]:
    """Per layer, the positions of the keys ``copies`` (engine.cache.assemble's spans: ``entry``, ``start``,
    ``end``) put in a buffer."""
    import torch

    shared: list[torch.Tensor] = []
    per_layer: list[list[torch.Tensor]] | None = None
    for span in copies:
        entry, a, b = span.entry, span.start, span.end
        kept = getattr(entry, "kept", None)
        if kept is None:
            shared.append(entry.positions[a:b])
            if per_layer is not None:
                for parts in per_layer:
                    parts.append(entry.positions[a:b])
            continue
        if per_layer is None:
            per_layer = [list(shared) for _ in range(n_layers)]
        for parts, k in zip(per_layer, kept):
            parts.append(entry.positions[k[(k >= a) & (k < b)]])
    if per_layer is None:
        return [torch.cat(shared) if shared else torch.zeros(0, dtype=torch.long)]
    return [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long) for parts in per_layer]


def needs_positions(model) -> bool:
    """Whether some layer reads position ids beyond RoPE (sliding window, ALiBi)."""
    cfg = model.config
    if cfg.model_type == "mpt" or (cfg.model_type == "falcon" and getattr(cfg, "alibi", False)):
        return True
    return sliding_window(cfg) is not None


def sliding_window(config) -> int | None:
    """The sliding window, None when no layer slides."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types and "sliding_attention" not in types:
        return None
    return int(window)


def sliding_layers(config) -> int:
    """How many layers attend within a sliding window."""
    if sliding_window(config) is None:
        return 0
    types = getattr(config, "layer_types", None)
    return sum(t == "sliding_attention" for t in types) if types else config.num_hidden_layers


def track_positions(model) -> None:
    """Hook ``model``'s forward to pass its attention query and key positions."""
    if getattr(model, "_pml_tracked", False):
        return
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
    model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)
    model._pml_tracked = True


def check_supported(config, model_class=None) -> None:
    """ModelError, saying why and what to use, for models the engine cannot run."""
    mtype = getattr(config, "model_type", "?")
    tested = ", ".join(TESTED_FAMILIES.values())
    types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in types if t not in _ATTENTION_LAYERS})
    if other:
        raise ModelError(f"'{mtype}' models have {'/'.join(other)} layers, which keep state besides their KV cache; "
                         f"prompt modules can only be stored for pure attention layers. Use a model of a tested "
                         f"family: {tested}")
    if model_class is None or mtype in OWN_ATTENTION:
        return
    can_set = getattr(model_class, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise ModelError(f"'{mtype}' models compute attention in their own code (not through transformers' attention "
                         "interface), so the engine cannot make their cache honour the gapped position ids of "
                         f"modules. Use a model of a tested family: {tested}")


def adopt_alibi(model) -> bool:
    """Make an MPT or ALiBi Falcon model read its ALiBi bias at key positions; False if it has none."""
    mtype = model.config.model_type
    hook = {"mpt": _mpt_alibi, "falcon": _falcon_alibi if getattr(model.config, "alibi", False) else None}.get(mtype)
    if hook is None:
        return False
    for module in model.modules():
        if hasattr(module, "Wqkv" if mtype == "mpt" else "query_key_value") and hasattr(module, "head_dim"):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return True


def eager(query, key, value, mask, scaling: float, softcap: float | None):
    """Attention with logit soft-capping (which SDPA lacks): ([1, q, heads, dim], None); ``mask`` None is causal."""
    import torch

    q, kv = query.shape[-2], key.shape[-2]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)[None, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


# -- internal helpers --

def _before_forward(model, args, kwargs):
    """Pass a single-row forward its :class:`Positions`, in its arguments and on its cache (batches keep
    transformers' masks)."""
    import torch

    ids = kwargs.get("input_ids", args[0] if args else None)
    x = ids if ids is not None else kwargs.get("inputs_embeds")
    pos_ids = kwargs.get("position_ids")
    if x is None or x.shape[0] != 1 or (pos_ids is not None and pos_ids.shape[0] != 1):
        return None
    cache = kwargs.get("past_key_values")
    past = getattr(cache, "_pml_positions", None)
    if past is None:
        n = cache.get_seq_length() if cache is not None else 0
        start = int(pos_ids[0, 0]) if pos_ids is not None else n
        past = [torch.arange(start - n, start)]
    if pos_ids is not None:
        query = pos_ids[0].detach().to("cpu", torch.long)
    else:
        start = int(past[0][-1]) + 1 if past[0].numel() else 0
        query = torch.arange(start, start + x.shape[1])
    pos = Positions(query, past)
    if cache is not None:
        cache._pml_forward = pos
    return args, {**kwargs, "attn_positions": pos}


def _after_forward(model, args, kwargs, output):
    """Append the forward's query positions to its cache's record."""
    import torch

    pos, cache = kwargs.get("attn_positions"), kwargs.get("past_key_values")
    if cache is not None and hasattr(cache, "_pml_forward"):
        del cache._pml_forward
    if cache is None and output is not None:
        cache = getattr(output, "past_key_values", None)
    if cache is None or output is None or pos is None:
        return None
    grown: dict[int, torch.Tensor] = {}
    cache._pml_positions = [grown.setdefault(id(p), torch.cat([p, pos.query])) for p in pos.past]
    return None


def _mpt_alibi(module, args, kwargs):
    """MPT's ALiBi bias at the forward's key positions."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    pos = getattr(kwargs.get("past_key_values"), "_pml_forward", None)
    if pos is None or kwargs.get("position_bias") is None:
        return None
    device = kwargs["position_bias"].device
    memo = ("mpt", str(device))
    if memo not in pos.memo:
        kpos = pos.keys(0, pos.past[0].shape[0] + pos.query.shape[0])
        full = build_mpt_alibi_tensor(module.n_heads, int(kpos.max()) + 1, device=device)  # [heads, 1, L]
        pos.memo[memo] = full[:, :, kpos.to(device)]
    return args, {**kwargs, "position_bias": pos.memo[memo]}


def _falcon_alibi(module, args, kwargs):
    """Falcon's mask, its ALiBi bias rebuilt at the key positions."""
    import torch

    pos = getattr(kwargs.get("layer_past"), "_pml_forward", None)
    mask = kwargs.get("attention_mask")
    if pos is None or kwargs.get("alibi") is None or mask is None:
        return None
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    kv = mask.shape[-1]
    memo = ("falcon", kv, mask.dtype)
    if memo not in pos.memo:
        kpos = pos.keys(module.layer_idx or 0, kv)
        ones = torch.ones(1, int(kpos.max()) + 1, dtype=torch.long, device=mask.device)
        full = build_alibi_tensor(ones, module.num_heads, mask.dtype)  # [heads, 1, L]: bias at key position
        bias = full[:, :, kpos.to(mask.device)].view(1, module.num_heads, 1, kv) / math.sqrt(module.head_dim)
        pos.memo[memo] = bias.masked_fill(mask < -1, torch.finfo(mask.dtype).min)
    kwargs["attention_mask"] = pos.memo[memo]
    return args, kwargs
