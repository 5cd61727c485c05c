"""int8 / int4 storage in KIVI's layout (keys per channel, values per token), and the storage formats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kv.entries import ModuleKV, StoredKV, short_positions

if TYPE_CHECKING:
    from engine.kv.pool import Lease

QUANT_BITS = {"int8": 8, "int4": 4}
QUANT_GROUP = {"int8": (128, 64), "int4": (64, 32)}  # (key tokens, value channels): docs/module-memory.md


@dataclass
class QuantKV(StoredKV):
    """An entry quantized after KIVI (arXiv 2402.02750): keys per channel (they have outliers), values per token."""

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
        """``entry`` in ``precision``."""
        bits = QUANT_BITS[precision]
        kv = entry.kv.float()
        k, v = kv[:, 0], kv[:, 1]  # [layers, kv_heads, seq, head_dim]
        layers, heads, n, dim = k.shape
        kg = min(key_group or QUANT_GROUP[precision][0], max(1, n))
        pad = -n % kg
        if pad:  # repeating the last token keeps min and max
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
        """Bytes of the codes, scales and minima."""
        return sum(t.numel() * t.element_size() for t in self._data())

    @property
    def device(self) -> torch.device:
        return self.kq.device

    @property
    def precision(self) -> str:
        return f"int{self.bits}"

    @property
    def scheme(self) -> str:
        return (f"kivi int{self.bits}: keys per channel in groups of {self.key_group} tokens, values per token "
                f"in groups of {self.value_group} channels, fp16 scale and minimum")

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "QuantKV":
        """This entry on ``device``; ``dtype`` is ignored."""
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

    def layer_view(self, layer: int, a: int, b: int) -> torch.Tensor:
        one = QuantKV(self.bits, self.key_group, self.value_group,
                      *(t[layer:layer + 1] for t in self._data()), self.positions, self.token_ids)
        return one.dequantize(a, b)[0]

    def write_into(self, buf: "Lease", a: int, b: int) -> None:
        """Dequantize tokens ``[a, b)`` straight into ``buf``."""
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
        return {"bits": str(self.bits), "key_group": str(self.key_group), "value_group": str(self.value_group)}

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor], meta: dict) -> "QuantKV":
        """The entry a file holds; ValueError when bits or groups misfit the shapes."""
        q = QuantKV(int(meta["bits"]), int(meta["key_group"]), int(meta["value_group"]), t["kq"], t["kscale"],
                    t["kmin"], t["vq"], t["vscale"], t["vmin"], t["positions"], t["token_ids"])
        layers, heads, n, dim = q.kscale.shape[:2] + q.kq.shape[2:3] + q.kscale.shape[3:]
        if q.bits not in QUANT_BITS.values() or q.key_group < 1 or q.value_group < 1 or dim % q.value_group:
            raise ValueError(f"bits {q.bits}, key_group {q.key_group} or value_group {q.value_group} is not possible")
        codes, keys = (layers, heads, n, dim * q.bits // 8), (layers, heads, -(-n // q.key_group), dim)
        values = (layers, heads, n, dim // q.value_group)
        want = {"kq": codes, "vq": codes, "kscale": keys, "kmin": keys, "vscale": values, "vmin": values,
                "positions": (n,), "token_ids": (n,)}
        wrong = [name for name, shape in want.items() if tuple(t[name].shape) != shape]
        if wrong:
            raise ValueError(f"the shapes of {', '.join(wrong)} do not fit bits {q.bits}, key_group {q.key_group} "
                             f"and value_group {q.value_group}")
        return q

    def __repr__(self) -> str:
        return (f"QuantKV(tokens={len(self)}, positions={short_positions(self.positions)}, int{self.bits} "
                f"k/{self.key_group} tokens v/{self.value_group} channels on {self.device}, {self.nbytes:,} bytes)")

    # -- internal helpers ---------------------------------------------------------------------

    def _data(self) -> list[torch.Tensor]:
        return [self.kq, self.kscale, self.kmin, self.vq, self.vscale, self.vmin]

    def _dequantize_into(self, kdst: torch.Tensor, vdst: torch.Tensor, a: int, b: int) -> None:
        # kdst, vdst: [layers, kv_heads, b - a, head_dim]
        kdst.copy_(_unpack(self.kq[:, :, a:b], self.bits))
        g = self.key_group
        head_end, tail_start = min(b, -(-a // g) * g), max(a, b // g * g)
        for s, e in ((a, head_end), (tail_start, b)) if head_end <= tail_start else ((a, b),):
            if e > s:  # a partial group
                i = s // g
                kdst[:, :, s - a:e - a].mul_(self.kscale[:, :, i:i + 1].to(kdst.dtype)).add_(
                    self.kmin[:, :, i:i + 1].to(kdst.dtype))
        if head_end < tail_start:  # whole groups
            layers, heads, _, dim = kdst.shape
            i, j = head_end // g, tail_start // g
            view = kdst[:, :, head_end - a:tail_start - a].view(layers, heads, j - i, g, dim)
            view.mul_(self.kscale[:, :, i:j, None].to(kdst.dtype)).add_(self.kmin[:, :, i:j, None].to(kdst.dtype))
        vdst.copy_(_unpack(self.vq[:, :, a:b], self.bits))
        layers, heads, n, dim = vdst.shape
        view = vdst.view(layers, heads, n, dim // self.value_group, self.value_group)
        view.mul_(self.vscale[:, :, a:b, :, None].to(vdst.dtype)).add_(self.vmin[:, :, a:b, :, None].to(vdst.dtype))


def to_storage(entry: ModuleKV, precision: str) -> "ModuleKV | QuantKV":
    """A full entry in a storage precision."""
    if precision in QUANT_BITS:
        return QuantKV.quantize(entry, precision)
    return entry.to(entry.device, getattr(torch, precision))


def storage_tag(precision: str) -> str:
    """The storage precision as cache keys see it."""
    if precision in QUANT_BITS:
        return f"{precision}:kivi:" + "/".join(map(str, QUANT_GROUP[precision]))
    return precision


def stored_bytes_per_token(layers: int, kv_heads: int, head_dim: int, precision: str) -> float:
    """Bytes per token of an entry stored in ``precision``, groups taken as full."""
    if precision not in QUANT_BITS:
        return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=getattr(torch, precision)).element_size()
    bits, (kg, vg) = QUANT_BITS[precision], QUANT_GROUP[precision]
    vg = vg if head_dim % vg == 0 else head_dim
    codes = 2 * head_dim * bits / 8
    scales = 4 * head_dim / kg + 4 * head_dim / vg  # fp16 scale + minimum per group
    return layers * kv_heads * (codes + scales)


def entry_from_tensors(t: dict[str, torch.Tensor], meta: dict | None = None):
    """The entry a saved file holds; ``meta`` is its manifest."""
    if "kq" in t:
        return QuantKV.from_tensors(t, meta or {})
    return ModuleKV.from_tensors(t)


def _range(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(minimum, scale) in fp16."""
    lo16 = lo.half()
    scale = ((hi - lo16.float()) / (2 ** bits - 1)).half()
    return lo16, scale


def _codes(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    s = scale.float()
    q = torch.where(s > 0, (x - lo.float()) / torch.where(s > 0, s, 1.0), 0.0)
    return q.round_().clamp_(0, 2 ** bits - 1).to(torch.uint8)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int4 codes two per byte, even channel low."""
    if bits == 8:
        return q.contiguous()
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def _unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return p
    return torch.stack([p & 0x0F, p >> 4], -1).flatten(-2)

