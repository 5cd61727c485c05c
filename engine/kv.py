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
* :class:`RankMask` — for a repaired run (issue 12), attention by each token's rank in the
  prompt instead of its index in the buffer, for the one prefill forward (:func:`rank_masked`).
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

    @property
    def precision(self) -> str:
        return str(self.kv.dtype).replace("torch.", "")

    scheme = "dense"

    def manifest(self) -> dict[str, str]:
        return {}

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

    @property
    def precision(self) -> str:
        return str(self.dtype).replace("torch.", "")

    scheme = "layered: each layer keeps its own tokens"

    def manifest(self) -> dict[str, str]:
        return {}

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


# ----------------------------------------------------------------------------------------------
# Quantized storage (KIVI's layout: keys per channel, values per token)
# ----------------------------------------------------------------------------------------------

QUANT_BITS = {"int8": 8, "int4": 4}
# (tokens per key group, channels per value group); see QuantKV for the measurements behind them.
QUANT_GROUP = {"int8": (128, 64), "int4": (64, 32)}


@dataclass
class QuantKV:
    """A stored entry quantized after KIVI (arXiv 2402.02750): keys per channel, values per token.

    Keys: each (layer, head, channel) has, per group of ``key_group`` consecutive tokens, a scale
    and a minimum (keys have outlier channels, so the range follows the channel). Values: each
    (layer, head, token) has one per group of ``value_group`` channels. Codes are unsigned and
    ``bits`` wide (int4: two per byte along head_dim); ``x ~ code * scale + minimum`` with fp16
    scales and minima. Dequantized straight into a run's buffer by :meth:`write_into`.

    Group sizes (QUANT_GROUP; bench/quant_groups.py compares them on needle prompts): on
    SmolLM2-135M module KV, int8's relative error is ~0.3 % whatever the group, so keys use 128
    tokens (26.4 % of fp32 bytes for a 250-token module); int4's key error is 3.8 / 4.4 / 5.1 %
    for 32 / 64 / 128 tokens and its value error 8.2 / 9.6 % for 32 / 64 channels, and keys of
    64 tokens with values of 32 channels is the most precise choice that stays under 16 % of
    fp32 for modules of 64 tokens or more (15.1 %). Shorter modules pay relatively more scales.
    """

    bits: int
    key_group: int
    value_group: int
    kq: torch.Tensor  # [layers, kv_heads, seq, head_dim * bits / 8] uint8
    kscale: torch.Tensor  # [layers, kv_heads, ceil(seq / key_group), head_dim] fp16
    kmin: torch.Tensor  # same shape as kscale
    vq: torch.Tensor  # [layers, kv_heads, seq, head_dim * bits / 8] uint8
    vscale: torch.Tensor  # [layers, kv_heads, seq, head_dim / value_group] fp16
    vmin: torch.Tensor  # same shape as vscale
    positions: torch.Tensor  # [seq] int64
    token_ids: torch.Tensor  # [seq] int64

    @staticmethod
    def quantize(entry: ModuleKV, precision: str, key_group: int | None = None,
                 value_group: int | None = None) -> "QuantKV":
        """``entry`` in ``precision`` ('int8' or 'int4'); groups default to QUANT_GROUP."""
        bits = QUANT_BITS[precision]
        kv = entry.kv.float()
        k, v = kv[:, 0], kv[:, 1]  # [layers, kv_heads, seq, head_dim]
        layers, heads, n, dim = k.shape
        kg = min(key_group or QUANT_GROUP[precision][0], max(1, n))
        pad = -n % kg
        if pad:  # the last group repeats its last token, which changes neither its minimum nor its maximum
            k = torch.cat([k, k[:, :, -1:].expand(layers, heads, pad, dim)], 2)
        groups = k.view(layers, heads, -1, kg, dim)
        kmin, kscale = _range(groups.amin(3), groups.amax(3), bits)
        kq = _codes(groups, kmin[:, :, :, None], kscale[:, :, :, None], bits).view(layers, heads, -1, dim)[:, :, :n]
        vg = value_group or QUANT_GROUP[precision][1]
        vg = vg if dim % vg == 0 else dim
        vgroups = v.reshape(layers, heads, n, dim // vg, vg)
        vmin, vscale = _range(vgroups.amin(4), vgroups.amax(4), bits)
        vq = _codes(vgroups, vmin[..., None], vscale[..., None], bits).view(layers, heads, n, dim)
        return QuantKV(bits, kg, vg, _pack(kq, bits), kscale, kmin, _pack(vq, bits), vscale, vmin,
                       entry.positions, entry.token_ids)

    def __len__(self) -> int:
        return self.kq.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and of their scales and minima (positions and ids are bookkeeping)."""
        return sum(t.numel() * t.element_size() for t in self._data())

    @property
    def device(self) -> torch.device:
        return self.kq.device

    @property
    def precision(self) -> str:
        return f"int{self.bits}"

    @property
    def scheme(self) -> str:
        """How the codes were made (recorded in the manifest)."""
        return (f"kivi int{self.bits}: keys per channel in groups of {self.key_group} tokens, values per token "
                f"in groups of {self.value_group} channels, fp16 scale and minimum")

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "QuantKV":
        """This entry on ``device`` (its precision never changes: ``dtype`` is ignored)."""
        if self.device == torch.device(device):
            return self
        moved = [t.to(device) for t in self._data()]
        return QuantKV(self.bits, self.key_group, self.value_group, *moved, self.positions, self.token_ids)

    def dequantize(self, a: int = 0, b: int | None = None, dtype=torch.float32) -> torch.Tensor:
        """Tokens ``[a, b)`` as ``[layers, 2, kv_heads, n, head_dim]`` in ``dtype``."""
        b = len(self) if b is None else b
        layers, heads, _, packed = self.kq.shape
        out = torch.empty(layers, 2, heads, b - a, packed * 8 // self.bits, dtype=dtype, device=self.device)
        self._dequantize_into(out[:, 0], out[:, 1], a, b)
        return out

    def write_into(self, buf: "KVBuffer", a: int, b: int) -> None:
        """Dequantize tokens ``[a, b)`` straight into ``buf`` (no intermediate copy when its layers are level)."""
        views = buf.reserve(b - a)
        if views is None:
            buf.write(self.dequantize(a, b, buf.data.dtype))
        else:
            self._dequantize_into(*views, a, b)

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("kq", "kscale", "kmin", "vq", "vscale", "vmin")
        out = {name: t.contiguous() for name, t in zip(names, self._data())}
        out.update(positions=self.positions, token_ids=self.token_ids)
        return out

    def manifest(self) -> dict[str, str]:
        """What a reader needs besides the tensors."""
        return {"bits": str(self.bits), "key_group": str(self.key_group), "value_group": str(self.value_group)}

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor], meta: dict) -> "QuantKV":
        return QuantKV(int(meta["bits"]), int(meta["key_group"]), int(meta["value_group"]), t["kq"], t["kscale"],
                       t["kmin"], t["vq"], t["vscale"], t["vmin"], t["positions"], t["token_ids"])

    def __repr__(self) -> str:
        return (f"QuantKV(tokens={len(self)}, positions={_short_positions(self.positions)}, int{self.bits} "
                f"k/{self.key_group} tokens v/{self.value_group} channels on {self.device}, {self.nbytes:,} bytes)")

    # -- internal helpers ---------------------------------------------------------------------

    def _data(self) -> list[torch.Tensor]:
        return [self.kq, self.kscale, self.kmin, self.vq, self.vscale, self.vmin]

    def _dequantize_into(self, kdst: torch.Tensor, vdst: torch.Tensor, a: int, b: int) -> None:
        # kdst, vdst: [layers, kv_heads, b - a, head_dim] (views of a run buffer, or of a fresh tensor)
        kdst.copy_(_unpack(self.kq[:, :, a:b], self.bits))
        g = self.key_group
        head_end, tail_start = min(b, -(-a // g) * g), max(a, b // g * g)
        for s, e in ((a, head_end), (tail_start, b)) if head_end <= tail_start else ((a, b),):
            if e > s:  # a partial group: one scale for all its tokens
                i = s // g
                kdst[:, :, s - a:e - a].mul_(self.kscale[:, :, i:i + 1].to(kdst.dtype)).add_(
                    self.kmin[:, :, i:i + 1].to(kdst.dtype))
        if head_end < tail_start:  # whole groups in between
            layers, heads, _, dim = kdst.shape
            i, j = head_end // g, tail_start // g
            view = kdst[:, :, head_end - a:tail_start - a].view(layers, heads, j - i, g, dim)
            view.mul_(self.kscale[:, :, i:j, None].to(kdst.dtype)).add_(self.kmin[:, :, i:j, None].to(kdst.dtype))
        vdst.copy_(_unpack(self.vq[:, :, a:b], self.bits))
        layers, heads, n, dim = vdst.shape
        view = vdst.view(layers, heads, n, dim // self.value_group, self.value_group)
        view.mul_(self.vscale[:, :, a:b, :, None].to(vdst.dtype)).add_(self.vmin[:, :, a:b, :, None].to(vdst.dtype))


def to_storage(entry: ModuleKV, precision: str) -> "ModuleKV | QuantKV":
    """A full entry in a storage precision: a float dtype name, or 'int8' / 'int4'."""
    if precision in QUANT_BITS:
        return QuantKV.quantize(entry, precision)
    return entry.to(entry.device, getattr(torch, precision))


def storage_tag(precision: str) -> str:
    """The storage precision as it enters cache keys: entries quantized differently never mix."""
    if precision in QUANT_BITS:
        return f"{precision}:kivi:" + "/".join(map(str, QUANT_GROUP[precision]))
    return precision


def stored_bytes_per_token(layers: int, kv_heads: int, head_dim: int, precision: str) -> float:
    """Bytes per token of a stored entry in ``precision`` (quantized: codes + scales, groups taken as full)."""
    if precision not in QUANT_BITS:
        return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=getattr(torch, precision)).element_size()
    bits, (kg, vg) = QUANT_BITS[precision], QUANT_GROUP[precision]
    vg = vg if head_dim % vg == 0 else head_dim
    codes = 2 * head_dim * bits / 8
    scales = 4 * head_dim / kg + 4 * head_dim / vg  # fp16 scale + minimum per key group and per value group
    return layers * kv_heads * (codes + scales)


def entry_from_tensors(t: dict[str, torch.Tensor], meta: dict | None = None):
    """The entry a safetensors file holds (dense, layered or quantized; ``meta`` is its manifest)."""
    if "kq" in t:
        return QuantKV.from_tensors(t, meta or {})
    return ModuleKV.from_tensors(t)


def _range(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(minimum, scale) in fp16, as they will be read back."""
    lo16 = lo.half()
    scale = ((hi - lo16.float()) / (2 ** bits - 1)).half()
    return lo16, scale


def _codes(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    s = scale.float()
    q = torch.where(s > 0, (x - lo.float()) / torch.where(s > 0, s, 1.0), 0.0)
    return q.round_().clamp_(0, 2 ** bits - 1).to(torch.uint8)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int4 codes two per byte along the last dimension (even channel in the low nibble)."""
    if bits == 8:
        return q.contiguous()
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def _unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return p
    return torch.stack([p & 0x0F, p >> 4], -1).flatten(-2)


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

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views ``(keys, values)``, each ``[layers, kv_heads, n, head_dim]``, of the next ``n`` slots of every
        layer, counted as written; None when the layers are not level (write a tensor instead)."""
        start = self.lengths[0]
        if any(x != start for x in self.lengths):
            return None
        if start + n > self.capacity:
            raise ValueError(f"KV buffer overflow: {start} + {n} > {self.capacity}")
        self.lengths = [start + n] * len(self.lengths)
        return self.data[:, 0, 0, :, start:start + n], self.data[:, 1, 0, :, start:start + n]

    def write_layer(self, i: int, kv: torch.Tensor) -> None:
        """Append ``kv`` ([2, kv_heads, n, head_dim]) to layer ``i``."""
        n = kv.shape[2]
        start = self.lengths[i]
        if start + n > self.capacity:
            raise ValueError(f"KV buffer overflow in layer {i}: {start} + {n} > {self.capacity}")
        self.data[i, :, 0, :, start:start + n].copy_(kv, non_blocking=True)
        self.lengths[i] = start + n

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries written so far (every layer at its own length)."""
        per_slot = 2 * self.data.shape[3] * self.data.shape[5] * self.data.element_size()
        return sum(self.lengths) * per_slot

    def keep(self, layer: int, idx: torch.Tensor) -> None:
        """Keep in ``layer`` only the entries ``idx`` ([kv_heads, k] indices below its length, per head), in
        that order, moved to the front; the layer's length becomes k."""
        d = self.data[layer, :, 0]  # [2, kv_heads, capacity, head_dim]
        heads, k = idx.shape
        index = idx.to(d.device)[None, :, :, None].expand(2, heads, k, d.shape[-1])
        kept = torch.gather(d[:, :, : self.lengths[layer]], 2, index)  # a copy: safe to write back in place
        d[:, :, :k].copy_(kept)
        self.lengths[layer] = k

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
_SCORER: contextvars.ContextVar["AttentionScorer | QueryCapture | None"] = contextvars.ContextVar("pml_scorer",
                                                                                                 default=None)
_RANKS: contextvars.ContextVar["RankMask | None"] = contextvars.ContextVar("pml_ranks", default=None)


class RankMask:
    """Causal attention by rank for one forward whose cache is not in prompt order.

    A repaired run leaves the recomputed tokens out of the buffer and prefills them with the
    uncached tokens, appended after the buffer's entries; so a key's index in the buffer no
    longer says where it sits in the prompt. Each key and query carries its **rank** (its index
    in the materialised prompt, the baseline's order) and a query attends to every key of rank
    ≤ its own — exactly the baseline's causal mask whenever the KV is the baseline's.
    Compressed entries keep different tokens per layer, so buffer ranks may differ per layer.
    """

    def __init__(self, cached: list[torch.Tensor], new: torch.Tensor):
        self.cached = cached  # [layers] x [buffer entries of that layer] int64 ranks (shared when equal)
        self.new = new  # [new tokens] int64 ranks, in the order they are prefilled
        self._made: dict[int, torch.Tensor] = {}  # id(cached[layer]) -> mask

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


@contextlib.contextmanager
def rank_masked(mask: RankMask | None):
    """Within this block, forwards through the PML attention use ``mask`` (None: unchanged)."""
    if mask is None:
        yield None
        return
    token = _RANKS.set(mask)
    try:
        yield mask
    finally:
        _RANKS.reset(token)


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
        r = min(self.recent, query.shape[2])
        att = attention_weights(query[:, :, -r:], key, scaling)  # [kv_heads, group, r, kv]
        w = torch.arange(1, r + 1, dtype=att.dtype, device=att.device)
        w = w / w.sum()
        per_key = torch.einsum("kgrn,r->n", att, w) / (att.shape[0] * att.shape[1])  # [kv]
        self.scores[layer] = per_key[key.shape[2] - self.n_new:].cpu()


class QueryCapture:
    """Per layer, the newest ``window`` queries of the first forward it sees (a run's prefill).

    Only kept, not used, during the forward: scoring them against the cache happens after the
    first token is out, so time to first token is not touched (engine/compress.py).
    """

    def __init__(self, window: int):
        self.window = window
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [1, heads, <= window, dim], RoPE applied
        self.scaling: dict[int, float | None] = {}

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        if layer not in self.queries:
            self.queries[layer] = query[:, :, -self.window:].clone()
            self.scaling[layer] = scaling


def attention_weights(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Softmax attention of the newest queries over ``key``, per KV head and query group: [kv_heads, group, r, kv].

    ``query`` [1, heads, r, dim] are the last r tokens of the cache ``key`` [1, kv_heads, kv, dim]
    (query i sits at cache index kv - r + i and sees the keys up to it).
    """
    _, h, r, d = query.shape
    kvh, kv = key.shape[1], key.shape[2]
    g = h // kvh
    qr = query[0].reshape(kvh, g * r, d)
    att = torch.matmul(qr.float(), key[0].float().transpose(-1, -2)) * (scaling or d ** -0.5)
    att = att.view(kvh, g, r, kv)
    causal = torch.ones(r, kv, dtype=torch.bool, device=query.device).tril_(kv - r)
    return att.masked_fill(~causal, float("-inf")).softmax(-1)


@contextlib.contextmanager
def scoring(scorer: "AttentionScorer | QueryCapture"):
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
    * Inside :func:`rank_masked` (repair) the :class:`RankMask`'s mask replaces the causal one.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scorer = _SCORER.get()
    if scorer is not None:
        scorer.observe(module.layer_idx, query, key, kwargs.get("scaling"))
    q, kv = query.shape[-2], key.shape[-2]
    ranks = _RANKS.get()
    window, positions = kwargs.get("sliding_window"), positional.current()
    if ranks is not None:
        attention_mask = ranks.mask(module.layer_idx, q, kv, query.device)
    elif window and positions is not None:
        attention_mask = positions.window_mask(module.layer_idx, q, kv, window, query.device)
    elif attention_mask is not None and attention_mask.shape[-1] != kv:
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)[None, None]
    softcap = kwargs.get("softcap")
    if softcap:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return positional.eager(query, key, value, attention_mask, scaling, softcap)
    if _GQA_WITH_MASK and _grouped_masked_cpu(module, query, attention_mask, kwargs):
        # Several new tokens over a cache (the cached prefill): transformers repeats K/V for every query
        # head here (it keeps enable_gqa for unmasked calls, as CUDA's masked GQA falls back to slow
        # kernels); on CPU, SDPA handles grouped heads with a mask directly and skips that copy.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


_GQA_WITH_MASK = True  # False: always transformers' own SDPA path (for before/after measurements)
_SPECIAL_KWARGS = ("softcap", "position_bias", "cache", "output_attentions", "s_aux", "sinks", "dropout")


def _grouped_masked_cpu(module, query, attention_mask, kwargs) -> bool:
    """True for a grouped-query, masked, multi-token CPU call that uses none of SDPA's special options."""
    return (query.device.type == "cpu" and query.shape[-2] > 1 and attention_mask is not None
            and getattr(module, "num_key_value_groups", 1) > 1 and not any(kwargs.get(k) for k in _SPECIAL_KWARGS))


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
