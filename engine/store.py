"""ModuleStore: encoded module KV kept on one device, keyed by content.

A key is a hash of everything the KV depends on (model, encoding mode, the unit's tokens and
positions, the past it attended to, which slice) — so two schemas that contain the same
module in the same context share one entry, and no module is ever held twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .kv import ModuleKV
from .models import check_device


class ModuleStore:
    """put / get / contains / nbytes / evict, on ``device`` (``cpu`` or ``cuda``)."""

    def __init__(self, device: str = "cpu"):
        check_device(device)
        self.device = device
        self._entries: OrderedDict[str, ModuleKV] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, entry: ModuleKV) -> ModuleKV:
        """Store ``entry`` under ``key`` on this store's device; an existing entry is kept, not replaced."""
        with self._lock:
            if key in self._entries:
                return self._entries[key]
            stored = entry.to(self.device)
            self._entries[key] = stored
            return stored

    def get(self, key: str) -> ModuleKV:
        with self._lock:
            entry = self._entries[key]
            self._entries.move_to_end(key)
            return entry

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def nbytes(self, keys: list[str] | None = None) -> int:
        """Bytes held, for all entries or for ``keys`` (each counted once)."""
        with self._lock:
            chosen = self._entries if keys is None else {k: self._entries[k] for k in set(keys) if k in self._entries}
            return sum(e.nbytes for e in chosen.values())

    def evict(self, key: str) -> bool:
        with self._lock:
            return self._entries.pop(key, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __repr__(self) -> str:
        return f"ModuleStore(device={self.device}, entries={len(self)}, bytes={self.nbytes():,})"
