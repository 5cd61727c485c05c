"""Several runs' KV decoded as one batch (``--decode together``, docs/cli.md): a padded row per run."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from engine.kv.buffer import PreallocatedLayer


class BatchedKV:
    """``[layers, 2, rows, kv_heads, capacity, head_dim]``, each row at its own length."""

    def __init__(self, kvs: list[torch.Tensor], room: int):
        layers, two, heads, _, dim = kvs[0].shape
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
        """[rows, 1, 1, longest + 1] bool: the keys each row attends to in the next step."""
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
    """transformers Cache over a :class:`BatchedKV`."""

    def __init__(self, batch: BatchedKV):
        super().__init__(layers=[_BatchedLayer(batch, i) for i in range(batch.data.shape[0])])
        self.batch = batch

    def step_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows' KV, each row's next slot) for the C++ decode step."""
        if self.batch.longest + 1 > self.batch.capacity:
            raise ValueError(f"batched KV overflow: {self.batch.longest + 1} > {self.batch.capacity}")
        return self.batch.data, self.batch.lengths
