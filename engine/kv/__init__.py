"""KV containers: stored entries, int8 / int4 storage, a run's buffer, batched decoding.

A leaf like transformers' ``cache_utils`` (torch and transformers only); import from ``engine.kv``.
"""

from engine.kv.batched import BatchedCache, BatchedKV
from engine.kv.buffer import BufferedCache, KVBuffer, KVWorkspace
from engine.kv.entries import LayeredKV, ModuleKV, StoredKV
from engine.kv.quant import (QUANT_BITS, QUANT_GROUP, QuantKV, entry_from_tensors, storage_tag, stored_bytes_per_token,
                             to_storage)

__all__ = ["BatchedCache", "BatchedKV", "BufferedCache", "KVBuffer", "KVWorkspace", "LayeredKV", "ModuleKV", "QUANT_BITS", "QUANT_GROUP", "QuantKV",
           "StoredKV", "entry_from_tensors", "storage_tag", "stored_bytes_per_token", "to_storage"]
