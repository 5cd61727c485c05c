"""A model's KV pool, ``[layers, 2, 1, kv_heads, tokens, head_dim]`` within a byte budget, and the leases runs hold:
ranges of its token axis, sized once (:func:`lease_tokens`). A lease alone writes KV and its lengths (one per
layer); a forward writes at the slots its lengths give, counted after it (engine/run/forward.py). A released lease is
stale."""

from __future__ import annotations

import bisect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from engine.kv.dma import copy_into
from engine.kv.layerwise import LayerCopies


def lease_tokens(tokens: int, max_new_tokens: int) -> int:
    """The one capacity rule: ``tokens`` written before the first token, one per decode step, one spare."""
    return tokens + max_new_tokens + 1


class StaleLease(RuntimeError):
    """A lease used after its release."""


class PoolFull(RuntimeError):
    """No room for a lease, and none will come."""


class KVPool:
    """First-fit leases of one tensor's token axis; the tensor grows (doubling) as leases reach past it."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, budget_bytes: int,
                 layerwise: bool | None = None):
        self.shape = (layers, 2, 1, kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.token_bytes = layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.tokens = max(1, int(budget_bytes) // self.token_bytes)
        self.layerwise = self.device.type == "cuda" if layerwise is None else layerwise
        self.data: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, self.tokens)]  # sorted (start, end) ranges
        self.held: dict[int, Lease] = {}  # by start
        self.peak_tokens = 0

    @property
    def budget_bytes(self) -> int:
        return self.tokens * self.token_bytes

    @property
    def used_tokens(self) -> int:
        return sum(lease.capacity for lease in self.held.values())

    def lease(self, tokens: int) -> "Lease | None":
        """A lease of ``tokens`` slots; None while no range is free; PoolFull when none can be."""
        if tokens > self.tokens:
            raise PoolFull(f"a run needs KV for {tokens:,} tokens ({tokens * self.token_bytes / 2**20:,.0f} MiB) and "
                           f"the KV pool holds {self.tokens:,} ({self.budget_bytes / 2**20:,.0f} MiB); raise "
                           "--kv-budget-mb or ask for fewer tokens")
        at = next((i for i, (a, b) in enumerate(self._free) if b - a >= tokens), None)
        if at is None:
            return None
        a, b = self._free[at]
        self._free[at:at + 1] = [(a + tokens, b)] if b > a + tokens else []
        self._grow(a + tokens)
        lease = Lease(None, start=a, pool=self, layerwise=self.layerwise, capacity=tokens)
        self.held[a] = lease
        self.peak_tokens = max(self.peak_tokens, self.used_tokens)
        return lease

    def stats(self) -> dict:
        """Budget, slots leased, leases."""
        return {"budget_bytes": self.budget_bytes, "tokens": self.tokens, "used_tokens": self.used_tokens,
                "leases": len(self.held), "peak_tokens": self.peak_tokens, "token_bytes": self.token_bytes}

    def _grow(self, end: int) -> None:
        """Make the tensor hold slots up to ``end`` (the leases' KV copied over)."""
        size = 0 if self.data is None else self.data.shape[4]
        if end <= size:
            return
        for lease in self.held.values():
            lease.settle()  # deferred copies land in the old tensor first
        layers, two, one, heads, dim = self.shape
        # zeros, not empty: a graph or a padded batch reads masked slots, and 0 x NaN garbage is NaN
        grown = torch.zeros((layers, two, one, heads, min(self.tokens, max(end, 2 * size, 256)), dim), dtype=self.dtype,
                     device=self.device)
        used = max((x.start + x.capacity for x in self.held.values()), default=0)
        if used:
            grown[:, :, :, :, :used].copy_(self.data[:, :, :, :, :used])
        self.data = grown

    def _release(self, lease: "Lease") -> None:
        del self.held[lease.start]
        a, b = lease.start, lease.start + lease.capacity
        i = bisect.bisect(self._free, (a, b))
        if i < len(self._free) and self._free[i][0] == b:  # joins the next free range
            b = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == a:  # and the one before
            a = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (a, b))


class Lease:
    """A run's KV, ``[layers, 2, 1, kv_heads, capacity, head_dim]``, from slot ``start`` of its pool's tensor;
    ``layerwise``: host copies deferred to the forward (engine/kv/layerwise.py)."""

    def __init__(self, data: torch.Tensor | None, start: int = 0, pool: KVPool | None = None, layerwise: bool = False,
                 capacity: int | None = None):
        """``data``: a tensor of its own, else ``pool``'s slots from ``start``."""
        self.own, self.start, self.pool = data, start, pool
        self._capacity = data.shape[4] if data is not None else capacity
        layers = data.shape[0] if data is not None else pool.shape[0]
        device = data.device if data is not None else pool.device
        self._lengths = [0] * layers
        self.held: list[torch.Tensor] = []  # sources of DMA transfers into it
        self.copies = LayerCopies(layers, device, self.held) if layerwise else None
        self.live = True
        self._cache: LeaseCache | None = None

    @classmethod
    def private(cls, data: torch.Tensor) -> "Lease":
        """A lease over a tensor of its own (scratch KV)."""
        return cls(data)

    # -- reading --

    @property
    def base(self) -> torch.Tensor:
        """The tensor its slots are in (its pool's, as it is now)."""
        return self.own if self.own is not None else self.pool.data

    @property
    def raw(self) -> torch.Tensor:
        """Its slots, deferred copies or not."""
        return self.own if self.own is not None else self.pool.data[:, :, :, :, self.start:self.start + self._capacity]

    @property
    def lengths(self) -> tuple[int, ...]:
        self._check()
        return tuple(self._lengths)

    @property
    def length(self) -> int:
        """The first layer's length (every layer's, when level)."""
        self._check()
        return self._lengths[0]

    @property
    def level(self) -> bool:
        """Whether every layer holds as many entries."""
        return all(n == self._lengths[0] for n in self._lengths)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries written."""
        per_slot = 2 * self.raw.shape[3] * self.raw.shape[5] * self.raw.element_size()
        return sum(self._lengths) * per_slot

    @property
    def data(self) -> torch.Tensor:
        """The KV, every deferred copy done (as the current stream sees it)."""
        self._check()
        self.settle()
        return self.raw

    def kv(self) -> torch.Tensor:
        """The entries written, ``[layers, 2, kv_heads, length, head_dim]`` (a view; the layers level)."""
        return self.data[:, :, 0, :, : self.length]

    # -- writing: copies before a forward --

    def write(self, kv: torch.Tensor) -> None:
        """Append ``kv`` ([layers, 2, kv_heads, n, head_dim])."""
        self._check()
        n, start = kv.shape[3], self._lengths[0]
        if not self.level:
            for i in range(kv.shape[0]):
                self.write_layer(i, kv[i])
            return
        self._room(start + n)
        if self.copies is not None and self.copies.defers(kv):
            self.copies.add(None, self.raw[:, :, 0, :, start:start + n], kv)
        else:
            self._before_direct_write()
            copy_into(self.raw[:, :, 0, :, start:start + n], kv, self.held)
        self._lengths = [start + n] * len(self._lengths)

    def write_layer(self, i: int, kv: torch.Tensor) -> None:
        """Append ``kv`` ([2, kv_heads, n, head_dim]) to layer ``i``."""
        self._check()
        n, start = kv.shape[2], self._lengths[i]
        self._room(start + n, i)
        if self.copies is not None and self.copies.defers(kv):
            self.copies.add(i, self.raw[i, :, 0, :, start:start + n], kv)
        else:
            self._before_direct_write()
            copy_into(self.raw[i, :, 0, :, start:start + n], kv, self.held)
        self._lengths[i] = start + n

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views (keys, values) of the next ``n`` slots, counted as written; None unless level."""
        self._check()
        start = self._lengths[0]
        if not self.level:
            return None
        self._room(start + n)
        self._lengths = [start + n] * len(self._lengths)
        self._before_direct_write()
        return self.raw[:, 0, 0, :, start:start + n], self.raw[:, 1, 0, :, start:start + n]

    def overwrite(self, layer: int, kv: torch.Tensor) -> None:
        """Replace layer ``layer``'s first entries with ``kv`` ([2, kv_heads, n, head_dim])."""
        n = kv.shape[2]
        if n > self.lengths[layer]:
            raise ValueError(f"overwriting {n} entries of a layer holding {self._lengths[layer]}")
        self.data[layer, :, 0, :, :n].copy_(kv)

    def keep(self, layer: int, idx: torch.Tensor) -> None:
        """Keep in ``layer`` only the entries ``idx`` ([kv_heads, k])."""
        d = self.data[layer, :, 0]  # [2, kv_heads, capacity, head_dim]
        heads, k = idx.shape
        index = idx.to(d.device)[None, :, :, None].expand(2, heads, k, d.shape[-1])
        kept = torch.gather(d[:, :, : self._lengths[layer]], 2, index)  # a copy
        d[:, :, :k].copy_(kept)
        self._lengths[layer] = k

    def reset(self) -> None:
        """Empty every layer; the memory stays the lease's."""
        self._check()
        self._lengths = [0] * len(self._lengths)

    def advance(self, n: int) -> None:
        """Count the ``n`` slots a forward wrote in every layer (engine/run/forward.py, once per forward)."""
        self._check()
        self._room(self._lengths[0] + n)
        self._lengths = [x + n for x in self._lengths]

    # -- forwards --

    def cache(self) -> "LeaseCache":
        """The transformers Cache over this lease (each layer writes at its length)."""
        self._check()
        if self._cache is None:
            self._cache = LeaseCache(self)
        return self._cache

    def settle(self) -> None:
        """Make the current stream wait for every deferred copy (launching them first)."""
        if self.copies is not None:
            self.copies.settle()

    def ready(self, layer: int) -> None:
        """Make the current stream wait for layer ``layer``'s deferred copies (launching them first)."""
        if self.copies is not None:
            self.copies.wait(layer)

    # -- ownership --

    def release(self) -> None:
        """Give the range back; the lease is stale from now on (twice is harmless)."""
        if not self.live:
            return
        self.settle()  # its copies are done before its memory is another run's
        self.live = False
        self._cache = None
        if self.pool is not None:
            self.pool._release(self)

    def __repr__(self) -> str:
        state = "" if self.live else ", released"
        return f"Lease(start={self.start}, capacity={self.capacity}, lengths={self._lengths[:3]}...{state})"

    def _check(self) -> None:
        if not self.live:
            raise StaleLease(f"KV lease at {self.start} used after its release")

    def _room(self, end: int, layer: int | None = None) -> None:
        if end > self.capacity:
            where = "" if layer is None else f" in layer {layer}"
            raise ValueError(f"KV lease overflow{where}: {end} > {self.capacity}")

    def _before_direct_write(self) -> None:
        """A direct write after the deferred copies launched waits for them (it may reuse their slots)."""
        if self.copies is not None and self.copies.launched:
            self.copies.settle()


class PreallocatedLayer(CacheLayerMixin):
    """A cache layer over layer ``index`` of a preallocated tensor, written in place."""

    is_sliding = False
    is_compileable = False

    def __init__(self, data: torch.Tensor, index: int):
        super().__init__()
        self.k, self.v = data[index, 0], data[index, 1]  # [rows, kv_heads, slots, head_dim]
        self.dtype, self.device = data.dtype, data.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None


class _LeaseLayer(PreallocatedLayer):
    """Layer ``index`` of a lease: a forward's keys go at its length (views taken anew: the pool grows)."""

    def __init__(self, lease: Lease, index: int):
        super().__init__(lease.raw, index)
        self.lease, self.index = lease, index

    @property
    def k(self) -> torch.Tensor:
        return self.lease.raw[self.index, 0]

    @k.setter
    def k(self, value) -> None:
        pass

    @property
    def v(self) -> torch.Tensor:
        return self.lease.raw[self.index, 1]

    @v.setter
    def v(self, value) -> None:
        pass

    @property
    def length(self) -> int:
        return self.lease.lengths[self.index]

    @property
    def keys(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin sets it
        pass

    @property
    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.lease.ready(self.index)  # this layer's stored KV is in place before attention reads it
        start = self.length
        end = start + key_states.shape[-2]
        self.lease._room(end, self.index)
        k, v = self.k, self.v
        k[:, :, start:end].copy_(key_states)
        v[:, :, start:end].copy_(value_states)
        return k[:, :, :end], v[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.k.shape[2]


class LeaseCache(Cache):
    """transformers Cache over one :class:`Lease`."""

    def __init__(self, lease: Lease):
        super().__init__(layers=[_LeaseLayer(lease, i) for i in range(lease.raw.shape[0])])
        self.lease = lease


class _RowsLayer(PreallocatedLayer):
    """Layer ``index`` of several leases, a row each."""

    def __init__(self, rows: "RowsCache", index: int):
        super().__init__(rows.base, index)
        self.rows = rows

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] != 1:
            raise ValueError("a batched cache takes one new token per row and step")
        r = self.rows
        k, v = self.k[0], self.v[0]  # [kv_heads, pool slots, head_dim]
        k[:, r.slots] = key_states[:, :, 0].transpose(0, 1)
        v[:, r.slots] = value_states[:, :, 0].transpose(0, 1)
        keys = k[:, r.gather].unflatten(1, (len(r.leases), -1)).transpose(0, 1)
        values = v[:, r.gather].unflatten(1, (len(r.leases), -1)).transpose(0, 1)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows.longest + query_length, 0

    def get_seq_length(self) -> int:
        return self.rows.longest

    def get_max_length(self) -> int:
        return self.k.shape[2]


class RowsCache(Cache):
    """transformers Cache over level leases of one pool for one decode step; no slot outside a row's lease is read
    (a row's last key repeats past its end, masked)."""

    def __init__(self, leases: list[Lease]):
        base = leases[0].base
        if any(lease.base is not base for lease in leases):
            raise ValueError("a batched step reads leases of one pool")
        self.base, self.leases = base, leases
        lengths = torch.tensor([lease.length for lease in leases], dtype=torch.long)
        starts = torch.tensor([lease.start for lease in leases], dtype=torch.long)
        self.longest = int(lengths.max())
        span = torch.arange(self.longest + 1)
        self.row_lengths = lengths  # as the step starts
        self.slots = (starts + lengths).to(base.device)  # each row's new key
        self.gather = (starts[:, None] + torch.minimum(span[None, :], lengths[:, None])).flatten().to(base.device)
        super().__init__(layers=[_RowsLayer(self, i) for i in range(base.shape[0])])

    def key_mask(self) -> torch.Tensor:
        """[rows, 1, 1, longest + 1] bool: each row's keys."""
        span = torch.arange(self.longest + 1)
        return (span[None, :] <= self.row_lengths[:, None])[:, None, None].to(self.base.device)
