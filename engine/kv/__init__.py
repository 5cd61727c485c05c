"""KV containers, and the only package that touches transformers cache internals.

* :mod:`.entries` — :class:`StoredKV`, the contract of a stored entry, and the float entries
  :class:`ModuleKV` (``kv``: ``[layers, 2, kv_heads, seq, head_dim]``, index 0 = keys with RoPE
  applied at ``positions``, 1 = values) and :class:`LayeredKV` (each layer keeps its own tokens).
* :mod:`.quant` — :class:`QuantKV` (int8 / int4 after KIVI) and the storage formats
  (:func:`to_storage`, :func:`storage_tag`, :func:`stored_bytes_per_token`, :func:`entry_from_tensors`).
* :mod:`.buffer` — a run's preallocated :class:`KVBuffer` (a view of the :class:`KVWorkspace`) and
  :class:`BufferedCache`, the transformers cache that appends into it in place.
* :mod:`.attend` — the engine's attention function (:func:`use_pml_attention`), repair's
  :class:`RankMask`, compression's scorers, and :func:`forward_kv`.

Everything is re-exported here: import from ``engine.kv``.
"""

from .attend import (ATTENTION, AttentionScorer, QueryCapture, RankMask, _pml_attention, attention_weights,
                     forward_kv, rank_masked, scoring, use_pml_attention)
from .buffer import BufferedCache, KVBuffer, KVWorkspace
from .entries import LayeredKV, ModuleKV, StoredKV
from .quant import QUANT_BITS, QUANT_GROUP, QuantKV, entry_from_tensors, storage_tag, stored_bytes_per_token, to_storage

__all__ = ["ATTENTION", "AttentionScorer", "BufferedCache", "KVBuffer", "KVWorkspace", "LayeredKV", "ModuleKV",
           "QUANT_BITS", "QUANT_GROUP", "QuantKV", "QueryCapture", "RankMask", "StoredKV", "attention_weights",
           "entry_from_tensors", "forward_kv", "rank_masked", "scoring", "storage_tag", "stored_bytes_per_token",
           "to_storage", "use_pml_attention"]
