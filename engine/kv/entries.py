"""Stored KV entries: the contract every entry keeps (:class:`StoredKV`), and the float entries.

* :class:`ModuleKV` — one stored entry: ``kv`` is ``[layers, 2, kv_heads, seq, head_dim]``
  (index 0 = keys with RoPE applied at ``positions``, 1 = values).
* :class:`LayeredKV` — a compressed entry: each layer keeps its own subset of the tokens.

The quantized entry (:class:`engine.kv.quant.QuantKV`) keeps the same contract.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.kv.buffer import KVBuffer


class StoredKV(abc.ABC):
    """Base, abstract class for one stored entry: the KV of one module (or unit slice).

    Every entry also carries ``positions`` and ``token_ids`` (``[seq]`` int64: every token of the
    module, kept or not). The module store saves :meth:`tensors` with :attr:`precision`,
    :attr:`scheme` and :meth:`manifest` as metadata and counts :attr:`nbytes` against its budget;
    a run copies entries into its buffer with :meth:`write_into`.
    """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Tokens of the module this entry stores, whether or not every layer kept them."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the stored K/V data (positions and ids are bookkeeping, a few bytes per token)."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Device the K/V data lives on."""

    @property
    @abc.abstractmethod
    def precision(self) -> str:
        """Storage precision as the store records it: a torch dtype name ('float16') or 'int8' / 'int4'."""

    @property
    @abc.abstractmethod
    def scheme(self) -> str:
        """How the stored values were made, in words (recorded in the store's manifest)."""

    @abc.abstractmethod
    def manifest(self) -> dict[str, str]:
        """What a reader needs besides the tensors to rebuild this entry (string values; may be empty)."""

    @abc.abstractmethod
    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "StoredKV":
        """This entry on ``device`` (and in ``dtype`` where the type allows it); self when nothing changes."""

    @abc.abstractmethod
    def write_into(self, buf: "KVBuffer", a: int, b: int) -> None:
        """Append to ``buf`` the K/V of tokens ``[a, b)`` that each layer holds, in the buffer's dtype."""

    @abc.abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors that, with :meth:`manifest`, rebuild this entry (``engine.kv.entry_from_tensors``)."""


@dataclass
class ModuleKV(StoredKV):
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
        return (f"ModuleKV(tokens={len(self)}, positions={short_positions(self.positions)}, kv={tuple(self.kv.shape)} "
                f"{str(self.kv.dtype).replace('torch.', '')} on {self.kv.device}, {self.nbytes:,} bytes)")


@dataclass
class LayeredKV(StoredKV):
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


def short_positions(positions: torch.Tensor) -> list:
    pos = positions.tolist()
    return pos if len(pos) <= 6 else pos[:3] + ["..."] + pos[-2:]
