"""What one forward attends to (:class:`AttentionSpec`, ``model(..., attn_spec=spec)``: transformers passes it
to the attention function), and the engine's attention function."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.cache_utils import DynamicCache

from engine.kv.entries import ModuleKV
from engine.model import positions as positional

ATTENTION = "pml_attention"  # no "sdpa" in it: transformers would refuse it to models without SDPA


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """What one forward attends to beyond the causal mask; all None is plain attention."""

    ranks: RankMask | None = None  # prompt-order mask (a recomputing prefill)
    keys: torch.Tensor | None = None  # [rows, 1, 1, keys] bool (runs decoded as one batch)
    ape: ApeScale | None = None
    focus: Focus | None = None  # routed decoding
    scorer: Scorer | None = None

    @property
    def plain(self) -> bool:
        """Nothing set: what the C++ decode step computes."""
        return all(v is None for v in (self.ranks, self.keys, self.ape, self.focus, self.scorer))


PLAIN = AttentionSpec()


class Scorer(Protocol):
    """Reads each layer's queries and keys."""

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None: ...


class RankMask:
    """Causal attention by prompt rank, for a prefill whose cache is not in prompt order."""

    def __init__(self, cached: list[torch.Tensor], new: torch.Tensor):
        self.cached = cached  # [layers] x [buffer entries] int64 ranks
        self.new = new  # [new tokens] int64 ranks
        self._made: dict[int, torch.Tensor] = {}

    def mask(self, layer: int, q: int, kv: int, device) -> torch.Tensor:
        """[1, 1, q, kv] bool mask (True = attend) for ``layer``."""
        cached = self.cached[layer]
        if q != self.new.shape[0] or kv != cached.shape[0] + q:
            raise ValueError(f"rank mask for {self.new.shape[0]} queries over {cached.shape[0]} cached keys "
                             f"used on {q} queries over {kv} keys in layer {layer}")
        made = self._made.get(id(cached))
        if made is None or made.device != torch.device(device):
            keys = torch.cat([cached, self.new])
            made = (keys[None, :] <= self.new[:, None])[None, None].to(device)
            self._made[id(cached)] = made
        return made


class ApeScale:
    """APE at query time (arXiv 2502.05431; docs/arms.md): temperature T inside the modules, scale S on them."""

    def __init__(self, context: list[torch.Tensor], temperature: float, scale: float):
        self.context = context  # [layers] x bool [cached slots]
        self.t, self.s = float(temperature), float(scale)

    def attend(self, layer: int, query, key, value, attention_mask, scaling: float | None) -> torch.Tensor:
        """Attention output [batch, queries, heads, dim]."""
        b, h, q, d = query.shape
        kv, g = key.shape[-2], h // key.shape[1]
        k = key.repeat_interleave(g, dim=1) if g > 1 else key
        v = value.repeat_interleave(g, dim=1) if g > 1 else value
        x = torch.matmul(query.float(), k.float().transpose(-1, -2)) * (scaling or d ** -0.5)  # [b, h, q, kv]
        if attention_mask is None:
            visible = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)
        elif attention_mask.dtype == torch.bool:
            visible = attention_mask[..., -q:, :kv]
        else:
            visible = attention_mask[..., -q:, :kv] > float("-inf")
        ctx = torch.zeros(kv, dtype=torch.bool, device=query.device)
        mark = self.context[layer]
        ctx[: min(kv, mark.shape[0])] = mark[:kv].to(query.device)
        inside = x / self.t
        lse = inside.masked_fill(~(ctx & visible), float("-inf")).logsumexp(-1, keepdim=True)
        shift = torch.where(torch.isfinite(lse), (self.s * self.t - 1.0) * lse, torch.zeros_like(lse))
        logits = torch.where(ctx, inside + shift, x).masked_fill(~visible, float("-inf"))
        out = torch.matmul(logits.softmax(-1).to(v.dtype), v)
        return out.transpose(1, 2).contiguous()


class Focus:
    """Decode steps read the kept module the answer named last (docs/arms.md, routed); with ``ends``, until the
    answer ends that clause."""

    def __init__(self, owners: torch.Tensor, triggers: dict[int, int], ends: frozenset[int] = frozenset()):
        self.owners, self.triggers = owners, dict(triggers)  # owners: [cached slots] module index or -1
        self.ends = ends  # token ids holding . , ; ! ? or a newline
        self.focus: int | None = None
        self.step = 0
        self.changes: list[tuple[int, int]] = []  # (decode step, module)
        self._mask: torch.Tensor | None = None

    def fresh(self, owners: torch.Tensor | None = None) -> "Focus":
        """This focus as before the first decode step, over ``owners`` (default: its own)."""
        return Focus(self.owners if owners is None else owners, self.triggers, self.ends)

    def saw(self, input_ids: torch.Tensor) -> None:
        """A forward's input ids; a decode step's trigger moves the focus."""
        if input_ids.shape[-1] != 1:
            return
        self.step += 1
        token = int(input_ids.reshape(-1)[-1])
        module = -1 if token in self.ends and self.focus is not None else self.triggers.get(token)
        if module is not None and module != self.focus:  # -1: every kept module visible again
            self.focus, self._mask = (None if module < 0 else module), None
            self.changes.append((self.step, module))

    def restrict(self, layer: int, q: int, kv: int, attention_mask, device):
        """``attention_mask`` without the unfocused modules."""
        if self.focus is None or q != 1:
            return attention_mask
        visible = self.visible(kv, device)[None, None, None, :]
        if attention_mask is None:
            return visible
        if attention_mask.dtype == torch.bool:
            return attention_mask & visible
        return attention_mask.masked_fill(~visible, float("-inf"))

    def visible(self, kv: int, device) -> torch.Tensor:
        """[kv] bool: the keys a decode step reads (every one while nothing is focused)."""
        visible = torch.ones(kv, dtype=torch.bool, device=device)
        if self.focus is None:
            return visible
        if self._mask is None or self._mask.device != torch.device(device):
            self._mask = ((self.owners < 0) | (self.owners == self.focus)).to(device)
        n = min(kv, self._mask.shape[0])
        visible[:n] = self._mask[:n]
        return visible


class AttentionScorer:
    """Per layer, the recency-weighted attention a unit's last queries pay its keys."""

    def __init__(self, n_new: int, recent_frac: float = 0.4):
        self.n_new = n_new
        self.recent = max(1, math.ceil(recent_frac * n_new))
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [n_new]

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        r = min(self.recent, query.shape[2])
        att = attention_weights(query[:, :, -r:], key, scaling)  # [kv_heads, group, r, kv]
        w = torch.arange(1, r + 1, dtype=att.dtype, device=att.device)
        w = w / w.sum()
        per_key = torch.einsum("kgrn,r->n", att, w) / (att.shape[0] * att.shape[1])  # [kv]
        self.scores[layer] = per_key[key.shape[2] - self.n_new:].cpu()


class QueryCapture:
    """Per layer, the newest ``window`` queries of a prefill (question retention)."""

    def __init__(self, window: int):
        self.window = window
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [1, heads, <= window, dim]
        self.scaling: dict[int, float | None] = {}

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        if layer not in self.queries:
            self.queries[layer] = query[:, :, -self.window:].clone()
            self.scaling[layer] = scaling


def attention_weights(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention of the last r tokens over ``key``: [kv_heads, group, r, kv]."""
    _, h, r, d = query.shape
    kvh, kv = key.shape[1], key.shape[2]
    g = h // kvh
    qr = query[0].reshape(kvh, g * r, d)
    att = torch.matmul(qr.float(), key[0].float().transpose(-1, -2)) * (scaling or d ** -0.5)
    att = att.view(kvh, g, r, kv)
    causal = torch.ones(r, kv, dtype=torch.bool, device=query.device).tril_(kv - r)
    return att.masked_fill(~causal, float("-inf")).softmax(-1)


def use_pml_attention(model) -> str:
    """Route ``model``'s attention through :func:`_pml_attention` (``"pml"``) or adapt its own (``"own"``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if positional.needs_positions(model):
        positional.track_positions(model)
    if model.config.model_type in positional.OWN_ATTENTION:
        positional.adopt_alibi(model)
        return "own"
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager", ATTENTION):
        return "own"
    AttentionInterface.register(ATTENTION, _pml_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return "pml"


def forward_kv(model, token_ids: list[int], positions: list[int], past: ModuleKV | None = None,
               spec: AttentionSpec = PLAIN) -> ModuleKV:
    """KV of ``token_ids`` at ``positions``, attending to ``past`` and causally to each other."""
    device = model.device
    cache = DynamicCache()
    if past is not None and len(past):
        # [layers] x (k, v): [1, kv_heads, seq, head_dim]
        cache = DynamicCache(ddp_cache_data=[(past.kv[i, 0].unsqueeze(0).to(device),
                                              past.kv[i, 1].unsqueeze(0).to(device))
                                             for i in range(past.kv.shape[0])])
        positional.attach(cache, past.positions)
    n_past = cache.get_seq_length()
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    pos = torch.tensor([positions], dtype=torch.long, device=device)
    with torch.inference_mode():
        # use_cache=True: gapped positions without a cache read as packed sequences
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1,
              attn_spec=spec)
    kv = torch.stack([torch.stack([layer.keys[0, :, n_past:], layer.values[0, :, n_past:]])
                      for layer in cache.layers])
    return ModuleKV(kv.contiguous(), torch.tensor(positions, dtype=torch.long),
                    torch.tensor(token_ids, dtype=torch.long))


# -- internal helpers --

_GQA_WITH_MASK = True  # False: transformers' SDPA path only
_SPECIAL_KWARGS = ("softcap", "position_bias", "cache", "output_attentions", "s_aux", "sinks", "dropout")


# transformers' AttentionInterface signature and the engine's two keywords
def _pml_attention(module, query, key, value, attention_mask, attn_spec: AttentionSpec = PLAIN,
                   attn_positions: positional.Positions | None = None, **kwargs):
    """transformers' attention over the engine's caches, as ``attn_spec`` asks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spec, layer, scaling = attn_spec, module.layer_idx, kwargs.get("scaling")
    if spec.scorer is not None:
        spec.scorer.observe(layer, query, key, scaling)
    mask = _mask(spec, layer, query, key, attention_mask, kwargs.get("sliding_window"), attn_positions)
    if spec.ape is not None:
        return spec.ape.attend(layer, query, key, value, mask, scaling), None
    if kwargs.get("softcap"):
        return positional.eager(query, key, value, mask, scaling or query.shape[-1] ** -0.5, kwargs["softcap"])
    special = any(kwargs.get(k) for k in _SPECIAL_KWARGS)
    if _GQA_WITH_MASK and query.shape[-2] == 1 and query.device.type == "cpu" and not special:
        return _decode_attention(query, key, value, mask, scaling), None
    if _GQA_WITH_MASK and not special and _grouped_masked_cpu(module, query, mask):
        # transformers would repeat K/V per head; CPU SDPA groups them
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def _mask(spec: AttentionSpec, layer: int, query, key, attention_mask, window, positions):
    """The mask a layer attends under (the causal one at its own length by default)."""
    q, kv = query.shape[-2], key.shape[-2]
    if spec.ranks is not None:
        attention_mask = spec.ranks.mask(layer, q, kv, query.device)
    elif spec.keys is not None:
        attention_mask = spec.keys[..., :kv]
    elif window and positions is not None:
        attention_mask = positions.window_mask(layer, q, kv, window, query.device)
    elif attention_mask is not None and attention_mask.shape[-1] != kv:
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)[None, None]
    if spec.focus is not None:
        attention_mask = spec.focus.restrict(layer, q, kv, attention_mask, query.device)
    return attention_mask


def _decode_attention(query, key, value, attention_mask, scaling: float | None) -> torch.Tensor:
    """One query per row in three ops (cheaper than SDPA's set-up on CPU)."""
    b, h, _, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    q = query.reshape(b, kvh, h // kvh, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scaling or d ** -0.5)
    if attention_mask is not None:
        mask = attention_mask[..., -1, :n].reshape(attention_mask.shape[0], 1, 1, n)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, 1, h, d)


def _grouped_masked_cpu(module, query, attention_mask) -> bool:
    """A grouped, masked, multi-token CPU call."""
    return (query.device.type == "cpu" and query.shape[-2] > 1 and attention_mask is not None
            and getattr(module, "num_key_value_groups", 1) > 1)
