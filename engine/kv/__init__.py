"""KV containers, and the only package that touches transformers cache internals.

* :mod:`.entries` — :class:`StoredKV`, the contract of a stored entry, and the float entries
  :class:`ModuleKV` (``kv``: ``[layers, 2, kv_heads, seq, head_dim]``, index 0 = keys with RoPE
  applied at ``positions``, 1 = values) and :class:`LayeredKV` (each layer keeps its own tokens).
* :mod:`.quant` — :class:`QuantKV` (int8 / int4 after KIVI) and the storage formats
  (:func:`to_storage`, :func:`storage_tag`, :func:`stored_bytes_per_token`, :func:`entry_from_tensors`).
* :mod:`.buffer` — a run's preallocated :class:`KVBuffer` (a view of the :class:`KVWorkspace`) and
  :class:`BufferedCache`, the transformers cache that appends into it in place.
* :mod:`.batched` — :class:`BatchedKV` / :class:`BatchedCache`: several runs' KV decoded as one batch.

A leaf, like transformers' ``cache_utils``: it imports torch, transformers' cache classes and nothing else
of the engine. The attention function that reads these containers is in :mod:`engine.model.attend`.
Everything is re-exported here: import from ``engine.kv``.
"""

from engine.kv.batched import BatchedCache, BatchedKV
from engine.kv.buffer import BufferedCache, KVBuffer, KVWorkspace
from engine.kv.entries import LayeredKV, ModuleKV, StoredKV
from engine.kv.quant import (QUANT_BITS, QUANT_GROUP, QuantKV, entry_from_tensors, storage_tag, stored_bytes_per_token,
                             to_storage)

__all__ = ["BatchedCache", "BatchedKV", "BufferedCache", "KVBuffer", "KVWorkspace", "LayeredKV", "ModuleKV", "QUANT_BITS", "QUANT_GROUP", "QuantKV",
           "StoredKV", "entry_from_tensors", "storage_tag", "stored_bytes_per_token", "to_storage"]
