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

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache


@dataclass
class ModuleKV:
    """Stored KV of one module (or unit slice)."""

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

    def to(self, device: str | torch.device) -> "ModuleKV":
        """This entry on ``device`` (self when it is already there)."""
        if self.kv.device == torch.device(device):
            return self
        return ModuleKV(self.kv.to(device), self.positions, self.token_ids)

    def slice(self, idx: list[int] | slice) -> "ModuleKV":
        """Tokens ``idx`` of this entry, copied into their own storage."""
        if isinstance(idx, list):
            t = torch.tensor(idx, dtype=torch.long)
            return ModuleKV(self.kv.index_select(3, t.to(self.kv.device)).contiguous(), self.positions[t],
                            self.token_ids[t])
        return ModuleKV(self.kv[:, :, :, idx].contiguous(), self.positions[idx].clone(), self.token_ids[idx].clone())

    @staticmethod
    def concat(parts: list["ModuleKV"]) -> "ModuleKV":
        return ModuleKV(torch.cat([p.kv for p in parts], dim=3), torch.cat([p.positions for p in parts]),
                        torch.cat([p.token_ids for p in parts]))

    def __repr__(self) -> str:
        pos = self.positions.tolist()
        shown = pos if len(pos) <= 6 else pos[:3] + ["..."] + pos[-2:]
        return (f"ModuleKV(tokens={len(self)}, positions={shown}, kv={tuple(self.kv.shape)} "
                f"{str(self.kv.dtype).replace('torch.', '')} on {self.kv.device}, {self.nbytes:,} bytes)")


class KVBuffer:
    """KV for one run: a view ``[layers, 2, 1, kv_heads, capacity, head_dim]`` of a workspace."""

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, kv: torch.Tensor) -> None:
        """Append ``kv`` ([layers, 2, kv_heads, n, head_dim], any device) at the current length: one copy."""
        n = kv.shape[3]
        if self.length + n > self.capacity:
            raise ValueError(f"KV buffer overflow: {self.length} + {n} > {self.capacity}")
        self.data[:, :, 0, :, self.length:self.length + n].copy_(kv, non_blocking=True)
        self.length += n

    def cache(self) -> "BufferedCache":
        """A transformers Cache whose layers append into this buffer, starting at the current length."""
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
        self.length = buffer.length
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
        self.buffer.length = self.layers[0].length


def forward_kv(model, token_ids: list[int], positions: list[int], past: ModuleKV | None = None) -> ModuleKV:
    """KV of ``token_ids`` at ``positions``, attending causally to ``past`` (if any) and to each other."""
    device = model.device
    cache = DynamicCache()
    if past is not None and len(past):
        # [layers] x (k, v): [1, kv_heads, seq, head_dim]
        cache = DynamicCache(ddp_cache_data=[(past.kv[i, 0].unsqueeze(0).to(device),
                                              past.kv[i, 1].unsqueeze(0).to(device))
                                             for i in range(past.kv.shape[0])])
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

