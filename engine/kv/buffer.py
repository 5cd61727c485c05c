"""A run's preallocated KV buffer, and the transformers cache that appends into it in place."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from engine.kv.dma import copy_into
from engine.kv.layerwise import LayerCopies


class KVBuffer:
    """One run's KV, ``[layers, 2, 1, kv_heads, capacity, head_dim]``; each layer has its own length.

    With ``layerwise``, copies from host memory are deferred and run layer by layer beside the forward
    (engine/kv/layerwise.py); ``data`` then waits for them, ``raw`` does not. ``base``: the workspace tensor
    this buffer is a view of (the same memory run after run: what a CUDA graph captures)."""

    def __init__(self, data: torch.Tensor, layerwise: bool = False, base: torch.Tensor | None = None):
        self.raw = data
        self.base = data if base is None else base
        self.lengths = [0] * data.shape[0]
        self.held: list[torch.Tensor] = []  # sources of DMA transfers into it, alive as long as this buffer
        self.copies = LayerCopies(data.shape[0], data.device, self.held) if layerwise else None

    @property
    def data(self) -> torch.Tensor:
        """The KV, every deferred copy done (as the current stream sees it)."""
        self.settle()
        return self.raw

    def settle(self) -> None:
        """Make the current stream wait for every deferred copy (launching them first)."""
        if self.copies is not None:
            self.copies.settle()

    def ready(self, layer: int) -> None:
        """Make the current stream wait for layer ``layer``'s deferred copies (launching them first)."""
        if self.copies is not None:
            self.copies.wait(layer)

    @property
    def capacity(self) -> int:
        return self.raw.shape[4]

    def _before_direct_write(self) -> None:
        """After the deferred copies launched (a partial forward, a scout), a write on the current stream may reuse
        their slots (a rebuilt buffer): it waits for them."""
        if self.copies is not None and self.copies.launched:
            self.copies.settle()

    @property
    def length(self) -> int:
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()

    def write(self, kv: torch.Tensor) -> None:
        """Append ``kv``: [layers, 2, kv_heads, n, head_dim]."""
        n = kv.shape[3]
        start = self.lengths[0]
        if all(x == start for x in self.lengths):
            if start + n > self.capacity:
                raise ValueError(f"KV buffer overflow: {start} + {n} > {self.capacity}")
            if self.copies is not None and self.copies.defers(kv):
                self.copies.add(None, self.raw[:, :, 0, :, start:start + n], kv)
            else:
                self._before_direct_write()
                copy_into(self.raw[:, :, 0, :, start:start + n], kv, self.held)
            self.lengths = [start + n] * len(self.lengths)
        else:
            for i in range(kv.shape[0]):
                self.write_layer(i, kv[i])

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views (keys, values) of the next ``n`` slots, or None."""
        start = self.lengths[0]
        if any(x != start for x in self.lengths):
            return None
        if start + n > self.capacity:
            raise ValueError(f"KV buffer overflow: {start} + {n} > {self.capacity}")
        self.lengths = [start + n] * len(self.lengths)
        self._before_direct_write()
        return self.raw[:, 0, 0, :, start:start + n], self.raw[:, 1, 0, :, start:start + n]

    def write_layer(self, i: int, kv: torch.Tensor) -> None:
        """Append ``kv`` ([2, kv_heads, n, head_dim]) to layer ``i``."""
        n = kv.shape[2]
        start = self.lengths[i]
        if start + n > self.capacity:
            raise ValueError(f"KV buffer overflow in layer {i}: {start} + {n} > {self.capacity}")
        if self.copies is not None and self.copies.defers(kv):
            self.copies.add(i, self.raw[i, :, 0, :, start:start + n], kv)
        else:
            self._before_direct_write()
            copy_into(self.raw[i, :, 0, :, start:start + n], kv, self.held)
        self.lengths[i] = start + n

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries written."""
        per_slot = 2 * self.raw.shape[3] * self.raw.shape[5] * self.raw.element_size()
        return sum(self.lengths) * per_slot

    def keep(self, layer: int, idx: torch.Tensor) -> None:
        """Keep in ``layer`` only the entries ``idx`` ([kv_heads, k])."""
        d = self.data[layer, :, 0]  # [2, kv_heads, capacity, head_dim]
        heads, k = idx.shape
        index = idx.to(d.device)[None, :, :, None].expand(2, heads, k, d.shape[-1])
        kept = torch.gather(d[:, :, : self.lengths[layer]], 2, index)  # a copy
        d[:, :, :k].copy_(kept)
        self.lengths[layer] = k

    def advance(self, n: int = 1, layer: int | None = None) -> None:
        """Count ``n`` tokens written in place into ``layer`` (None: every layer)."""
        if layer is None:
            self.lengths = [x + n for x in self.lengths]
        else:
            self.lengths[layer] += n

    def reset(self) -> None:
        """Empty every layer; the memory stays."""
        self.lengths = [0] * len(self.lengths)

    def cache(self) -> "BufferedCache":
        """A Cache appending into this buffer."""
        return BufferedCache(self)


class KVWorkspace:
    """One pre-touched KV tensor reused by every run: page faults cost more than a prefill.

    ``layerwise``: its buffers copy host KV layer by layer beside the forward (default: on CUDA)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, layerwise: bool | None = None):
        self.shape = (layers, 2, 1, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.data: torch.Tensor | None = None
        self.layerwise = str(device).startswith("cuda") if layerwise is None else layerwise
        self._last: KVBuffer | None = None

    def buffer(self, capacity: int) -> KVBuffer:
        """An empty KVBuffer for ``capacity`` tokens."""
        if self._last is not None:
            self._last.settle()  # the last run's copies are done before its memory is reused
        if self.data is None or self.data.shape[4] < capacity:
            size = 1 << max(8, (capacity - 1).bit_length())
            layers, two, one, heads, _, dim = self.shape
            self.data = None  # free it first
            self.data = torch.zeros((layers, two, one, heads, size, dim), dtype=self.dtype, device=self.device)
        self._last = KVBuffer(self.data[:, :, :, :, :capacity], layerwise=self.layerwise, base=self.data)
        return self._last

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


class PreallocatedLayer(CacheLayerMixin):
    """A cache layer over layer ``index`` of a preallocated tensor, written in place."""

    is_sliding = False
    is_compileable = False

    def __init__(self, data: torch.Tensor, index: int):
        super().__init__()
        self.k, self.v = data[index, 0], data[index, 1]  # [rows, kv_heads, capacity, head_dim]
        self.dtype, self.device = data.dtype, data.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None


class _BufferedLayer(PreallocatedLayer):
    """Layer ``index`` of a KVBuffer; its length is the buffer's, advanced where tokens are written."""

    def __init__(self, buffer: KVBuffer, index: int):
        super().__init__(buffer.raw, index)
        self.buffer, self.index = buffer, index
        self.keys, self.values = self.k[:, :, : self.length], self.v[:, :, : self.length]

    @property
    def length(self) -> int:
        return self.buffer.lengths[self.index]

    def update(self, key_states, value_states, *args, **kwargs):
        self.buffer.ready(self.index)  # this layer's stored KV is in place before attention reads it
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.k.shape[2]:
            raise ValueError(f"KV buffer overflow: {end} > {self.k.shape[2]}")
        self.k[:, :, self.length:end].copy_(key_states)
        self.v[:, :, self.length:end].copy_(value_states)
        self.buffer.advance(n, self.index)
        self.keys, self.values = self.k[:, :, :end], self.v[:, :, :end]
        return self.keys, self.values

    def seen(self) -> None:
        """Follow the buffer's length after tokens were written outside :meth:`update`."""
        self.keys, self.values = self.k[:, :, : self.length], self.v[:, :, : self.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.k.shape[2]


class BufferedCache(Cache):
    """transformers Cache over a KVBuffer."""

    def __init__(self, buffer: KVBuffer):
        super().__init__(layers=[_BufferedLayer(buffer, i) for i in range(buffer.raw.shape[0])])
        self.buffer = buffer

    def step_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(buffer, [1] next slot) for the C++ decode step, or None."""
        n = self.layers[0].length
        if any(layer.length != n for layer in self.layers) or n >= self.buffer.capacity:
            return None
        return self.buffer.data, torch.tensor([n], dtype=torch.long)

    def advance(self, n: int = 1) -> None:
        """Count ``n`` tokens the C++ decode step or a CUDA graph's replay wrote into every layer."""
        self.buffer.advance(n)
        for layer in self.layers:
            layer.seen()
