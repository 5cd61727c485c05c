"""Attention that knows where every query and key sits: sliding windows and ALiBi at position ids.

The engine's caches hold modules at their layout positions, with gaps where a module was not
imported, so a key's cache index and its position id differ. RoPE needs nothing more (a key
carries its rotation). A sliding window and an ALiBi bias do: both are functions of the
distance between a query's and a key's *position ids*, and transformers derives both from
cache indices, which is right only for contiguous sequences.

For a model that needs positions (:func:`needs_positions`), :func:`track_positions` hooks its
forward. Before each forward, the positions of its queries (``position_ids``) and of every key
already in the cache are published for that forward (:class:`Positions`); the cache's key
positions are those :func:`attach` recorded on it (the runner does, for assembled caches), else
they are taken as contiguous before the queries. After the forward, the queries' positions are
appended to the cache's record, so decoding steps stay in step.

* :meth:`Positions.window_mask` — causal by cache index, and ``q_pos - k_pos < window``.
* :func:`eager` — attention with logit soft-capping (Gemma 2), which SDPA cannot compute.
* MPT and ALiBi Falcon compute attention in their own code; :func:`adopt_alibi` makes their
  ALiBi bias the stock bias read at the key positions instead of the key indices.

:func:`check_supported` refuses, with the reason and an alternative, the models whose cache the
engine cannot hold or whose attention it cannot reach.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import ModelError

if TYPE_CHECKING:  # torch is imported where it is used: engine.model.load reads the family facts without it
    import torch

# model_type -> label: the families tests/engine/test_families.py builds and checks (read there too).
TESTED_FAMILIES = {
    "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma3_text": "Gemma 3",
    "gemma2": "Gemma 2", "phi3": "Phi-3", "gpt_neox": "GPT-NeoX", "falcon": "Falcon", "mpt": "MPT",
}
# families whose attention is their own code, adapted here (no registered attention function)
OWN_ATTENTION = ("falcon", "mpt")
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")

_FORWARD: contextvars.ContextVar["Positions | None"] = contextvars.ContextVar("pml_positions", default=None)


@dataclass
class Positions:
    """Position ids of one forward's queries and of the keys cached before it, per layer."""

    query: torch.Tensor  # [q] int64
    past: list[torch.Tensor]  # [layers] x [n_l] int64 (one shared tensor when all layers are level)
    memo: dict = field(default_factory=dict)

    def keys(self, layer: int, kv: int) -> torch.Tensor:
        """Positions of the ``kv`` keys layer ``layer`` attends to in this forward: [kv] int64."""
        import torch

        past = self.past[layer] if layer < len(self.past) else self.past[-1]
        n = kv - self.query.shape[0]
        if n < 0 or past.shape[0] < n:
            raise ModelError(f"layer {layer} attends to {kv} keys but only {past.shape[0]} cached positions "
                             "are known; the cache was filled without recording its positions")
        # sliding-window caches (transformers' own) keep only their most recent keys
        return torch.cat([past[past.shape[0] - n:], self.query])

    def window_mask(self, layer: int, q: int, kv: int, window: int, device) -> torch.Tensor:
        """[1, 1, q, kv] bool: causal by cache index and within ``window`` positions of the query."""
        import torch

        past = self.past[layer] if layer < len(self.past) else self.past[-1]
        key = ("window", id(past), kv, window, str(device))
        if key not in self.memo:
            kpos = self.keys(layer, kv).to(device)
            qpos = self.query.to(device)
            causal = torch.ones(q, kv, dtype=torch.bool, device=device).tril_(kv - q)
            self.memo[key] = (causal & ((qpos[:, None] - kpos[None, :]) < window))[None, None]
        return self.memo[key]


def current() -> Positions | None:
    """The positions of the forward running now (None outside a tracked model's forward)."""
    return _FORWARD.get()


def attach(cache, positions: list[torch.Tensor] | torch.Tensor | None) -> None:
    """Record on ``cache`` the position ids of the keys it holds (one tensor, or one per layer)."""
    import torch

    if positions is None:
        return
    cache._pml_positions = [positions] if isinstance(positions, torch.Tensor) else list(positions)


def copied_positions(copies: list, n_layers: int) -> list[torch.Tensor]:
    """Per layer, the positions of the keys ``copies`` ((entry, first, end) ranges) put in a buffer."""
    import torch

    shared: list[torch.Tensor] = []
    per_layer: list[list[torch.Tensor]] | None = None
    for entry, a, b in copies:
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
    """True when some layer's attention depends on position ids beyond RoPE (sliding window, ALiBi)."""
    cfg = model.config
    if cfg.model_type == "mpt" or (cfg.model_type == "falcon" and getattr(cfg, "alibi", False)):
        return True
    return sliding_window(cfg) is not None


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, None when no layer slides."""
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
    """Hook ``model``'s forward so its attention can read position ids of queries and keys."""
    if getattr(model, "_pml_tracked", False):
        return
    model._pml_tokens = []
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
    model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)
    model._pml_tracked = True


def check_supported(config, model_class=None) -> None:
    """Raise ModelError, with the reason and what to use instead, for models the engine cannot run."""
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
    """Make an MPT or ALiBi Falcon model take its ALiBi bias from key positions; False if it has none."""
    mtype = model.config.model_type
    if mtype == "mpt":
        base = model.base_model
        stock = base.build_mpt_alibi_tensor  # bound: (num_heads, sequence_length, alibi_bias_max, device)

        def build(num_heads, sequence_length, alibi_bias_max=8, device=None):
            pos = _FORWARD.get()
            if pos is None:
                return stock(num_heads, sequence_length, alibi_bias_max, device)
            kpos = pos.keys(0, pos.past[0].shape[0] + pos.query.shape[0])
            full = stock(num_heads, int(kpos.max()) + 1, alibi_bias_max, device)  # [heads, 1, L]
            return full[:, :, kpos.to(full.device)]

        base.build_mpt_alibi_tensor = build
        return True
    if mtype == "falcon" and getattr(model.config, "alibi", False):
        for module in model.modules():
            if hasattr(module, "query_key_value") and hasattr(module, "num_heads"):
                module.register_forward_pre_hook(_falcon_alibi, with_kwargs=True)
        return True
    return False


def eager(query, key, value, mask, scaling: float, softcap: float | None):
    """Attention with optional logit soft-capping; ``mask`` [1, 1, q, kv] bool or None (causal).

    query: [1, heads, q, dim]; key, value: [1, kv_heads, kv, dim]. Returns ([1, q, heads, dim], None).
    """
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


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

def _before_forward(model, args, kwargs):
    import torch

    ids = kwargs.get("input_ids", args[0] if args else None)
    x = ids if ids is not None else kwargs.get("inputs_embeds")
    pos_ids = kwargs.get("position_ids")
    if x is None or x.shape[0] != 1 or (pos_ids is not None and pos_ids.shape[0] != 1):
        model._pml_tokens.append(None)  # batches: transformers' index-based masks apply
        return None
    q = x.shape[1]
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
        query = torch.arange(start, start + q)
    model._pml_tokens.append(_FORWARD.set(Positions(query, past)))
    return None


def _after_forward(model, args, kwargs, output):
    import torch

    token = model._pml_tokens.pop() if model._pml_tokens else None
    if token is None:
        return None
    pos = _FORWARD.get()
    _FORWARD.reset(token)
    cache = kwargs.get("past_key_values")
    if cache is None and output is not None:
        cache = getattr(output, "past_key_values", None)
    if cache is None or output is None or pos is None:
        return None
    grown: dict[int, torch.Tensor] = {}
    cache._pml_positions = [grown.setdefault(id(p), torch.cat([p, pos.query])) for p in pos.past]
    return None


def _falcon_alibi(module, args, kwargs):
    """Falcon bakes ALiBi (from key indices) into the mask; rebuild it from the key positions."""
    import torch

    pos = _FORWARD.get()
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
