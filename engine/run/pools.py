"""KV pools (engine/kv/pool.py): an Engine's own, and each model's default for runs no engine drives."""

from __future__ import annotations

import weakref

import torch

from engine.devices import available_bytes
from engine.kv.pool import KVPool
from engine.model.load import LoadedModel

CPU_SHARE, CUDA_SHARE = 4, 3  # the default budget: a quarter of the free memory (a third on a GPU), ...
MAX_DEFAULT_BYTES = 4 << 30  # ... at most 170,000 tokens of the default model's fp32 KV
MIN_BYTES = 16 << 20

_DEFAULT: "weakref.WeakKeyDictionary[torch.nn.Module, KVPool]" = weakref.WeakKeyDictionary()


def make_pool(lm: LoadedModel, budget_bytes: int | None = None) -> KVPool:
    """A KV pool for ``lm`` of ``budget_bytes`` (None: :func:`default_budget`)."""
    return KVPool(lm.n_layers, lm.kv_heads, lm.head_dim, lm.model.dtype, lm.device,
                  budget_bytes or default_budget(str(lm.device)))


def pool_of(lm: LoadedModel) -> KVPool:
    """``lm``'s default pool."""
    pool = _DEFAULT.get(lm.model)
    if pool is None or (pool.dtype, pool.device) != (lm.model.dtype, torch.device(lm.device)):
        pool = _DEFAULT[lm.model] = make_pool(lm)
    return pool


def default_budget(device: str) -> int:
    """A share of the memory free on ``device``."""
    free = available_bytes(device) or 8 << 30
    share = CUDA_SHARE if device.startswith("cuda") else CPU_SHARE
    return max(MIN_BYTES, min(MAX_DEFAULT_BYTES, free // share))
