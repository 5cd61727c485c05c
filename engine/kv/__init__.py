"""KV containers: stored entries, int8 / int4 storage, the KV pool and the leases runs hold in it.

A leaf like transformers' ``cache_utils`` (torch and transformers only); import from ``engine.kv``.
"""

from engine.kv.entries import LayeredKV, ModuleKV, StoredKV
from engine.kv.pool import KVPool, Lease, LeaseCache, PoolFull, StaleLease, lease_tokens
from engine.kv.quant import (QUANT_BITS, QUANT_GROUP, QuantKV, entry_from_tensors, storage_tag, stored_bytes_per_token,
                             to_storage)

__all__ = ["KVPool", "LayeredKV", "Lease", "LeaseCache", "ModuleKV", "PoolFull", "QUANT_BITS", "QUANT_GROUP", "QuantKV",
           "StaleLease", "StoredKV", "entry_from_tensors", "lease_tokens", "storage_tag", "stored_bytes_per_token",
           "to_storage"]
