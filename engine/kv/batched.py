"""Several runs' KV decoded as one batch: each run's buffer a row, padded on the right, each row at its own
length, and the mask that hides the padding.

A comparison's arms decode the same number of tokens over caches of different lengths (the baseline's
prompt, the modular arm's modules and gaps). A decode step on a CPU is the time to read the weights once, so
stepping every arm in one forward costs little more than one arm (engine/arms/batch.py).

* :class:`BatchedKV` — ``[layers, 2, rows, kv_heads, capacity, head_dim]``, row ``b`` filled to
  ``lengths[b]``; every layer of a row has the same length (runs with thinned layers decode alone).
* :class:`BatchedCache` — the transformers Cache over it: a step writes each row's new key and value at
  that row's own length, and returns keys up to the longest row; :meth:`BatchedKV.key_mask` says which
  of them each row may attend to (engine/model/attend.py applies it).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from engine.kv.buffer import PreallocatedLayer


class BatchedKV:
    """The rows' KV, right-padded, with room for ``room`` more tokens in every row."""

    def __init__(self, kvs: list[torch.Tensor], room: int):
        layers, two, heads, _, dim = kvs[0].shape  # each [layers, 2, kv_heads, length, head_dim]
        lengths = [kv.shape[3] for kv in kvs]
        self.data = torch.zeros((layers, two, len(kvs), heads, max(lengths) + room, dim), dtype=kvs[0].dtype,
                                device=kvs[0].device)
        for row, kv in enumerate(kvs):
            self.data[:, :, row, :, : kv.shape[3]].copy_(kv)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.data.device)
        self.rows = torch.arange(len(kvs), device=self.data.device)
        self.longest = max(lengths)

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def key_mask(self) -> torch.Tensor:
        """[rows, 1, 1, longest + 1] bool: the keys each row attends to in the next step (its own length, and
        the slot that step writes)."""
        return (torch.arange(self.longest + 1, device=self.data.device)[None, :] <= self.lengths[:, None])[:, None,
                                                                                                          None]

    def advance(self) -> None:
        """Count the step every row just wrote."""
        if self.longest + 1 > self.capacity:
            raise ValueError(f"batched KV overflow: {self.longest + 1} > {self.capacity}")
        self.lengths += 1
        self.longest += 1

    def cache(self) -> "BatchedCache":
        return BatchedCache(self)


class _BatchedLayer(PreallocatedLayer):
    def __init__(self, batch: BatchedKV, index: int):
        super().__init__(batch.data, index)
        self.batch = batch

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] != 1:
            raise ValueError("a batched cache takes one new token per row and step")
        b = self.batch
        self.k[b.rows, :, b.lengths] = key_states[:, :, 0]
        self.v[b.rows, :, b.lengths] = value_states[:, :, 0]
        end = b.longest + 1
        return self.k[:, :, :end], self.v[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.longest + query_length, 0

    def get_seq_length(self) -> int:
        return self.batch.longest

    def get_max_length(self) -> int:
        return self.batch.capacity


class BatchedCache(Cache):
    """transformers Cache over a :class:`BatchedKV` (see the module docstring)."""

    def __init__(self, batch: BatchedKV):
        super().__init__(layers=[_BatchedLayer(batch, i) for i in range(batch.data.shape[0])])
        self.batch = batch

    def step_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows' KV, each row's length: where its next token goes) for the C++ decode step; the caller then
        calls :meth:`BatchedKV.advance`, as after a forward."""
        if self.batch.longest + 1 > self.batch.capacity:
            raise ValueError(f"batched KV overflow: {self.batch.longest + 1} > {self.batch.capacity}")
        return self.batch.data, self.batch.lengths

    def advance(self) -> None:  # the rows' lengths live in the BatchedKV (BatchedKV.advance counts the step)
        return None
