"""Stored KV entries: the contract every entry keeps (:class:`StoredKV`), and the float entries."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.kv.pool import Lease


class StoredKV(abc.ABC):
    """The stored KV of one module or unit slice."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Tokens of the module, kept or not."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the K/V data."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the K/V data lives."""

    @property
    @abc.abstractmethod
    def precision(self) -> str:
        """'float16', 'int8', ... as the store records it."""

    @property
    @abc.abstractmethod
    def scheme(self) -> str:
        """How the stored values were made, in words."""

    @abc.abstractmethod
    def manifest(self) -> dict[str, str]:
        """Metadata that, with :meth:`tensors`, rebuilds this entry."""

    @abc.abstractmethod
    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "StoredKV":
        """This entry on ``device`` (and in ``dtype`` where it can)."""

    @abc.abstractmethod
    def write_into(self, buf: "Lease", a: int, b: int) -> None:
        """Append to ``buf`` the K/V each layer holds of tokens ``[a, b)``."""

    @abc.abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors the store saves."""

    @abc.abstractmethod
    def layer_view(self, layer: int, a: int, b: int) -> torch.Tensor:
        """Tokens ``[a, b)`` at ``layer``, float32 ``[2, kv_heads, b - a, head_dim]``; a token it dropped is zeros."""

    level = True  # every layer holds every token

    def kept_at(self, layer: int, a: int, b: int) -> torch.Tensor:
        """Offsets from ``a`` of the tokens of ``[a, b)`` that ``layer`` holds, in buffer order."""
        return torch.arange(b - a)


@dataclass
class ModuleKV(StoredKV):
    """An entry with every layer at full length."""

    kv: torch.Tensor  # [layers, 2, kv_heads, seq, head_dim]; keys with RoPE applied
    positions: torch.Tensor  # [seq] int64
    token_ids: torch.Tensor  # [seq] int64

    def __len__(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
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
        dtype = dtype or self.kv.dtype
        if self.kv.device == torch.device(device) and self.kv.dtype == dtype:
            return self
        return ModuleKV(self.kv.to(device=device, dtype=dtype), self.positions, self.token_ids)

    def slice(self, idx: list[int] | slice) -> "ModuleKV":
        """Tokens ``idx``, copied."""
        if isinstance(idx, list):
            t = torch.tensor(idx, dtype=torch.long)
            return ModuleKV(self.kv.index_select(3, t.to(self.kv.device)).contiguous(), self.positions[t],
                            self.token_ids[t])
        return ModuleKV(self.kv[:, :, :, idx].contiguous(), self.positions[idx].clone(), self.token_ids[idx].clone())

    def write_into(self, buf: "Lease", a: int, b: int) -> None:
        buf.write(self.kv[:, :, :, a:b])

    def layer_view(self, layer: int, a: int, b: int) -> torch.Tensor:
        return self.kv[layer, :, :, a:b].float()

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
        return (f"ModuleKV(tokens={len(self)}, positions={short_positions(self.positions)}, kv={tuple(self.kv.shape)} "
                f"{str(self.kv.dtype).replace('torch.', '')} on {self.kv.device}, {self.nbytes:,} bytes)")


@dataclass
class LayeredKV(StoredKV):
    """A compressed entry: each layer keeps its own tokens, RoPE already applied."""

    layers: list[torch.Tensor]  # [layers] x [2, kv_heads, kept_l, head_dim]
    kept: list[torch.Tensor]  # [layers] x [kept_l] int64, sorted
    positions: torch.Tensor  # [seq] int64
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

    def write_into(self, buf: "Lease", a: int, b: int) -> None:
        for i, (t, kept) in enumerate(zip(self.layers, self.kept)):
            lo = int(torch.searchsorted(kept, a))
            hi = int(torch.searchsorted(kept, b))
            buf.write_layer(i, t[:, :, lo:hi])

    def kept_tokens(self) -> int:
        return sum(int(k.shape[0]) for k in self.kept)

    level = False

    def kept_at(self, layer: int, a: int, b: int) -> torch.Tensor:
        kept = self.kept[layer]
        return kept[(kept >= a) & (kept < b)] - a

    def layer_view(self, layer: int, a: int, b: int) -> torch.Tensor:
        t, kept = self.layers[layer], self.kept[layer]  # t: [2, kv_heads, kept, head_dim]
        inside = (kept >= a) & (kept < b)
        full = torch.zeros(2, t.shape[1], b - a, t.shape[3], dtype=torch.float32, device=t.device)
        full[:, :, (kept[inside] - a).to(t.device)] = t[:, :, inside.to(t.device)].float()
        return full

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


def short_positions(positions: torch.Tensor) -> list:
    pos = positions.tolist()
    return pos if len(pos) <= 6 else pos[:3] + ["..."] + pos[-2:]
