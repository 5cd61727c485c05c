"""Each loaded model's KV pool (engine/kv/pool.py): made at its first use, its budget the engine's (``--kv-budget-mb``)
or a share of the memory free then."""

from __future__ import annotations

import weakref

import torch

from engine.devices import available_bytes
from engine.kv.pool import KVPool
from engine.model.load import LoadedModel

CPU_SHARE, CUDA_SHARE = 4, 3  # the default budget: a quarter of the free memory (a third on a GPU) ...
MAX_DEFAULT_BYTES = 4 << 30  # ... at most 4 GiB: 170,000 tokens of the default model's fp32 KV
MIN_BYTES = 16 << 20

_POOLS: "weakref.WeakKeyDictionary[torch.nn.Module, KVPool]" = weakref.WeakKeyDictionary()


def pool_of(lm: LoadedModel, budget_bytes: int | None = None) -> KVPool:
    """The KV pool of ``lm``; ``budget_bytes`` sizes it anew while it holds no lease (None: as it is)."""
    pool = _POOLS.get(lm.model)
    fits = pool is not None and (pool.dtype, pool.device) == (lm.model.dtype, torch.device(lm.device))
    if fits and (budget_bytes is None or pool.budget_bytes == budget_bytes // pool.token_bytes * pool.token_bytes
                 or pool.held):
        return pool
    pool = _POOLS[lm.model] = KVPool(lm.n_layers, lm.kv_heads, lm.head_dim, lm.model.dtype, lm.device,
                                     budget_bytes or default_budget(str(lm.device)))
    return pool


def default_budget(device: str) -> int:
    """A quarter of the memory free on ``device`` (a third of a GPU's), at most :data:`MAX_DEFAULT_BYTES`."""
    free = available_bytes(device) or 8 << 30
    share = CUDA_SHARE if device.startswith("cuda") else CPU_SHARE
    return max(MIN_BYTES, min(MAX_DEFAULT_BYTES, free // share))
