"""KV containers, and the only file that touches transformers cache internals.

* :class:`ModuleKV` — one stored entry: ``kv`` is ``[layers, 2, kv_heads, seq, head_dim]``
  (index 0 = keys with RoPE applied at ``positions``, 1 = values).
* :class:`KVBuffer` — a preallocated ``[layers, 2, 1, kv_heads, capacity, head_dim]`` tensor
  (a view of the engine's :class:`KVWorkspace`). Assembly copies each module's KV into it once; prefill and decode then append in place
  through :class:`BufferedCache`, whose layers return views ``[:, :, :length]`` of the
  buffer, so no step ever copies the whole cache (transformers' DynamicCache concatenates
  on every step).
* :func:`forward_kv` — run the model over tokens at explicit positions with an optional
  past and return the new tokens' KV as a ModuleKV.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from . import attention as positional


@dataclass
class ModuleKV:
    """Stored KV of one module (or unit slice), every layer at full length."""

    kv: torch.Tensor  # [layers, 2, kv_heads, seq, head_dim]
    positions: torch.Tensor  # [seq] int64
    token_ids: torch.Tensor  # [seq] int64

    def __len__(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V tensors (positions and ids are bookkeeping, a few bytes per token)."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "ModuleKV":
        """This entry on ``device`` (and in ``dtype``); self when nothing changes."""
        dtype = dtype or self.kv.dtype
        if self.kv.device == torch.device(device) and self.kv.dtype == dtype:
            return self
        return ModuleKV(self.kv.to(device=device, dtype=dtype), self.positions, self.token_ids)

    def slice(self, idx: list[int] | slice) -> "ModuleKV":
        """Tokens ``idx`` of this entry, copied into their own storage."""
        if isinstance(idx, list):
            t = torch.tensor(idx, dtype=torch.long)
            return ModuleKV(self.kv.index_select(3, t.to(self.kv.device)).contiguous(), self.positions[t],
                            self.token_ids[t])
        return ModuleKV(self.kv[:, :, :, idx].contiguous(), self.positions[idx].clone(), self.token_ids[idx].clone())

    def write_into(self, buf: "KVBuffer", a: int, b: int) -> None:
        """Append tokens ``[a, b)`` of this entry to ``buf`` (one copy for all layers)."""
        buf.write(self.kv[:, :, :, a:b])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv.contiguous(), "positions": self.positions, "token_ids": self.token_ids}

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor]) -> "ModuleKV | LayeredKV":
        if "kv" in t:
            return ModuleKV(t["kv"], t["positions"], t["token_ids"])
        n = sum(1 for k in t if k.startswith("layer."))
        return LayeredKV([t[f"layer.{i}"] for i in range(n)], [t[f"kept.{i}"] for i in range(n)], t["positions"],
                         t["token_ids"])

    def __repr__(self) -> str:
        return (f"ModuleKV(tokens={len(self)}, positions={_short_positions(self.positions)}, kv={tuple(self.kv.shape)} "
                f"{str(self.kv.dtype).replace('torch.', '')} on {self.kv.device}, {self.nbytes:,} bytes)")


@dataclass
class LayeredKV:
    """A compressed entry: each layer keeps its own subset of the tokens (PyramidInfer-style).

    ``kept[l]`` are sorted token indices (into ``positions``) whose K/V layer ``l`` kept; RoPE was
    applied at encoding time, so the kept entries need no position bookkeeping at run time.
    """

    layers: list[torch.Tensor]  # [layers] x [2, kv_heads, kept_l, head_dim]
    kept: list[torch.Tensor]  # [layers] x [kept_l] int64, sorted
    positions: torch.Tensor  # [seq] int64: every token of the module
    token_ids: torch.Tensor  # [seq] int64

    def __len__(self) -> int:
        return self.positions.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "LayeredKV":
        dtype = dtype or self.dtype
        if self.device == torch.device(device) and self.dtype == dtype:
            return self
        return LayeredKV([t.to(device=device, dtype=dtype) for t in self.layers], self.kept, self.positions,
                         self.token_ids)

    def write_into(self, buf: "KVBuffer", a: int, b: int) -> None:
        """Append, layer by layer, the kept entries among tokens ``[a, b)`` (contiguous: kept is sorted)."""
        for i, (t, kept) in enumerate(zip(self.layers, self.kept)):
            lo = int(torch.searchsorted(kept, a))
            hi = int(torch.searchsorted(kept, b))
            buf.write_layer(i, t[:, :, lo:hi])

    def kept_tokens(self) -> int:
        return sum(int(k.shape[0]) for k in self.kept)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"positions": self.positions, "token_ids": self.token_ids}
        for i, (t, k) in enumerate(zip(self.layers, self.kept)):
            out[f"layer.{i}"] = t.contiguous()
            out[f"kept.{i}"] = k
        return out

    def __repr__(self) -> str:
        kept = [int(k.shape[0]) for k in self.kept]
        return (f"LayeredKV(tokens={len(self)}, kept per layer={kept[0]}..{kept[-1]} "
                f"({self.kept_tokens() / (len(kept) * max(1, len(self))):.0%}), "
                f"{str(self.dtype).replace('torch.', '')} on {self.device}, {self.nbytes:,} bytes)")


def _short_positions(positions: torch.Tensor) -> list:
    pos = positions.tolist()
    return pos if len(pos) <= 6 else pos[:3] + ["..."] + pos[-2:]


class KVBuffer:
    """KV for one run: a view ``[layers, 2, 1, kv_heads, capacity, head_dim]`` of a workspace.

    Each layer has its own fill length (compressed entries keep fewer tokens in deeper layers).
    """

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.lengths = [0] * data.shape[0]

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    @property
    def length(self) -> int:
        """Fill length of layer 0 (all layers, unless compressed entries were written)."""
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, kv: torch.Tensor) -> None:
        """Append ``kv`` ([layers, 2, kv_heads, n, head_dim], any device): one copy when layers are level."""
        n = kv.shape[3]
        start = self.lengths[0]
        if all(x == start for x in self.lengths):
            if start + n > self.capacity:
                raise ValueError(f"KV buffer overflow: {start} + {n} > {self.capacity}")
            self.data[:, :, 0, :, start:start + n].copy_(kv, non_blocking=True)
            self.lengths = [start + n] * len(self.lengths)
        else:
            for i in range(kv.shape[0]):
                self.write_layer(i, kv[i])

    def write_layer(self, i: int, kv: torch.Tensor) -> None:
        """Append ``kv`` ([2, kv_heads, n, head_dim]) to layer ``i``."""
        n = kv.shape[2]
        start = self.lengths[i]
        if start + n > self.capacity:
            raise ValueError(f"KV buffer overflow in layer {i}: {start} + {n} > {self.capacity}")
        self.data[i, :, 0, :, start:start + n].copy_(kv, non_blocking=True)
        self.lengths[i] = start + n

    def cache(self) -> "BufferedCache":
        """A transformers Cache whose layers append into this buffer, starting at the current lengths."""
        return BufferedCache(self)


class KVWorkspace:
    """One preallocated, pre-touched KV tensor reused by every run (runs are serialised).

    A fresh 190 MB allocation costs ~200 ms of page faults on these CPUs, more than the
    whole cached prefill; reusing touched memory makes the copy ~14 GB/s. It grows (to the
    next power of two) only when a run needs more capacity than any run before.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.shape = (layers, 2, 1, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.data: torch.Tensor | None = None

    def buffer(self, capacity: int) -> KVBuffer:
        """A fresh (empty) KVBuffer with room for ``capacity`` tokens."""
        if self.data is None or self.data.shape[4] < capacity:
            size = 1 << max(8, (capacity - 1).bit_length())
            layers, two, one, heads, _, dim = self.shape
            self.data = None  # free the old one first
            self.data = torch.zeros((layers, two, one, heads, size, dim), dtype=self.dtype, device=self.device)
        return KVBuffer(self.data[:, :, :, :, :capacity])

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


class _BufferedLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, buffer: KVBuffer, index: int):
        super().__init__()
        self.buffer = buffer
        self.k = buffer.data[index, 0]  # [1, kv_heads, capacity, head_dim]
        self.v = buffer.data[index, 1]
        self.length = buffer.lengths[index]
        self.dtype, self.device = buffer.data.dtype, buffer.data.device
        self.is_initialized = True
        self.keys, self.values = self.k[:, :, : self.length], self.v[:, :, : self.length]

    def lazy_initialization(self, key_states, value_states) -> None:  # buffer exists already
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.k.shape[2]:
            raise ValueError(f"KV buffer overflow: {end} > {self.k.shape[2]}")
        self.k[:, :, self.length:end].copy_(key_states)
        self.v[:, :, self.length:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self.k[:, :, :end], self.v[:, :, :end]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.k.shape[2]


class BufferedCache(Cache):
    """transformers Cache over a KVBuffer (see module docstring)."""

    def __init__(self, buffer: KVBuffer):
        super().__init__(layers=[_BufferedLayer(buffer, i) for i in range(buffer.data.shape[0])])
        self.buffer = buffer

    def sync_length(self) -> None:
        """Record in the buffer how far the layers have written."""
        self.buffer.lengths = [layer.length for layer in self.layers]


def forward_kv(model, token_ids: list[int], positions: list[int], past: ModuleKV | None = None) -> ModuleKV:
    """KV of ``token_ids`` at ``positions``, attending causally to ``past`` (if any) and to each other."""
    device = model.device
    cache = DynamicCache()
    if past is not None and len(past):
        # [layers] x (k, v): [1, kv_heads, seq, head_dim]
        cache = DynamicCache(ddp_cache_data=[(past.kv[i, 0].unsqueeze(0).to(device),
                                              past.kv[i, 1].unsqueeze(0).to(device))
                                             for i in range(past.kv.shape[0])])
        positional.attach(cache, past.positions)  # sliding windows and ALiBi read key positions, not indices
    n_past = cache.get_seq_length()
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    pos = torch.tensor([positions], dtype=torch.long, device=device)
    with torch.inference_mode():
        # use_cache=True: with gapped positions and no cache, transformers would assume packed sequences.
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    kv = torch.stack([torch.stack([layer.keys[0, :, n_past:], layer.values[0, :, n_past:]])
                      for layer in cache.layers])
    return ModuleKV(kv.contiguous(), torch.tensor(positions, dtype=torch.long),
                    torch.tensor(token_ids, dtype=torch.long))



# ----------------------------------------------------------------------------------------------
# Attention: the engine's attention function (per-layer cache lengths, position-aware windows,
# soft-capping) and attention scoring for compression
# ----------------------------------------------------------------------------------------------

ATTENTION = "pml_attention"  # no "sdpa" in the name: transformers would then refuse it to models without SDPA
_SCORER: contextvars.ContextVar["AttentionScorer | None"] = contextvars.ContextVar("pml_scorer", default=None)


class AttentionScorer:
    """Per layer, the recency-weighted attention the unit's most recent queries pay to its tokens.

    Used while encoding a unit for PyramidInfer-style compression: the last ``recent_frac`` of
    the unit's queries (weights growing linearly towards the newest) score each of the unit's
    keys; past (prefix) keys take part in the softmax but are not scored.
    """

    def __init__(self, n_new: int, recent_frac: float = 0.4):
        self.n_new = n_new
        self.recent = max(1, math.ceil(recent_frac * n_new))
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [n_new]

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        # query: [1, heads, n_new, dim]; key: [1, kv_heads, n_past + n_new, dim]
        b, h, q, d = query.shape
        kvh, kv = key.shape[1], key.shape[2]
        g = h // kvh
        r = min(self.recent, q)
        qr = query[:, :, q - r:].reshape(b, kvh, g * r, d)
        att = torch.matmul(qr.float(), key.float().transpose(-1, -2)) * (scaling or d ** -0.5)
        att = att.view(b, kvh, g, r, kv)
        # query i of the recent window sits at cache index kv - r + i and sees keys <= that index
        causal = torch.ones(r, kv, dtype=torch.bool, device=query.device).tril_(kv - r)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        w = torch.arange(1, r + 1, dtype=att.dtype, device=att.device)
        w = w / w.sum()
        per_key = torch.einsum("bkgrn,r->n", att, w) / (b * kvh * g)  # [kv]
        self.scores[layer] = per_key[kv - self.n_new:].cpu()


@contextlib.contextmanager
def scoring(scorer: AttentionScorer):
    """Within this block, forwards through the PML attention feed ``scorer``."""
    token = _SCORER.set(scorer)
    try:
        yield scorer
    finally:
        _SCORER.reset(token)


def _pml_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention, made exact for the engine's caches.

    * Caches whose layers hold different lengths (compressed entries): a layer shorter than the
      mask gets the bottom-right causal mask at its own length (batch 1, no padding: exact).
    * Sliding-window layers: the window is applied to position ids, not cache indices, when the
      model's positions are tracked (:mod:`engine.attention`), so gapped caches keep it.
    * Logit soft-capping (Gemma 2), which SDPA cannot compute: eager attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scorer = _SCORER.get()
    if scorer is not None:
        scorer.observe(module.layer_idx, query, key, kwargs.get("scaling"))
    q, kv = query.shape[-2], key.shape[-2]
    window, positions = kwargs.get("sliding_window"), positional.current()
    if window and positions is not None:
        attention_mask = positions.window_mask(module.layer_idx, q, kv, window, query.device)
    elif attention_mask is not None and attention_mask.shape[-1] != kv:
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)[None, None]
    softcap = kwargs.get("softcap")
    if softcap:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return positional.eager(query, key, value, attention_mask, scaling, softcap)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_pml_attention(model) -> str:
    """Route ``model``'s attention through the engine's; return the path in use.

    ``"pml"``: the attention function above runs in every layer (models that take transformers'
    attention interface, loaded with SDPA or eager attention). ``"own"``: the model's own attention
    code (MPT, Falcon), with ALiBi taken from position ids. Models that need positions for their
    attention (sliding windows, ALiBi) get their forward hooked to track them.
    """
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
