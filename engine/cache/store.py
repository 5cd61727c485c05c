"""ModuleStore: encoded module KV on one device, keyed by content, within a byte budget, persisted.

A key hashes everything the KV depends on, so schemas sharing a module in the same context share
one entry. Entries beyond the budget are evicted least recently used first; the disk format, its
checks and the prefix cache's entries are described in docs/module-memory.md.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from engine.devices import check_device
from engine.errors import EngineError, MissingEntry, StorageError
from engine.files import remove_killed_saves, save_whole
from engine.kv import entry_from_tensors
from engine.kv.pinned import PinState
from engine.owned import ForeignPathError, check_trusted, private_folder
from engine.limits import LIMITS

FORMAT = "pml-kv/2"  # pml-kv/1 plus "scheme" and quantized entries
READABLE = ("pml-kv/1", FORMAT)
PREFIX = "prefix:"  # prefix-cache nodes: memory only
HEADER_SUM = "header_sha256"  # of every other manifest field
STALE_TEMP_S = 3600  # older temporary files are a killed save's
STORE_FIX = "set PML_STUDIO_MODULES (or PML_STUDIO_CACHE) to a folder of yours"


class DiskStore:
    """Entries as ``ROOT/KEY.safetensors``; the safetensors header is the manifest."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        # refused if another account controls it; made at the first save (a read-only disk only stops saving), and
        # checked again at each write and read: another account may make a missing folder after the start
        check_trusted(self.root, "module store", STORE_FIX, missing_ok=True)
        self.writes = 0
        self.write_errors = 0
        self.corrupt = 0
        self.unreadable = 0  # files of an unknown format
        self.last_error = ""
        self.note = ""  # why the last unusable file is re-encoded
        self.removed_temps = remove_stale_temps(self.root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        return self.path(key).exists()

    def save(self, key: str, entry, meta: dict | None = None) -> bool:
        """Write ``entry`` atomically; False when the disk refuses."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        target = self.path(key)
        try:
            private_folder(self.root, "module store", STORE_FIX)  # made 0700, or refused if not the user's own
        except StorageError as err:
            self.write_errors += 1
            self.last_error = (f"the module store cannot write {target.name} in {self.root}: {err}; this run used it "
                               "from memory")
            return False
        if target.exists():
            return True
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in entry.tensors().items()}
        manifest = {"format": FORMAT, "crc32": str(_crc(tensors)), "bytes": str(entry.nbytes),
                    "dtype": entry.precision, "scheme": entry.scheme, "created": str(int(time.time())),
                    **entry.manifest()}
        manifest.update({k: str(v) for k, v in (meta or {}).items()})
        manifest[HEADER_SUM] = _header_sum(manifest)
        try:
            save_whole(target, lambda path: save_file(tensors, str(path), metadata=manifest))
        except (OSError, SafetensorError) as err:  # a full disk comes as either; the entry stays in memory
            self.write_errors += 1
            self.last_error = (f"the module store cannot write {target.name} in {self.root}: "
                               f"{getattr(err, 'strerror', None) or err}; this run used it from memory")
            return False
        self.writes += 1
        return True

    def load(self, key: str):
        """The entry under ``key``; None when absent or unusable (then deleted)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            check_trusted(self.root, "module store", STORE_FIX)
        except ForeignPathError as err:  # nothing read from it; the module is encoded again
            self.last_error = self.note = f"{err}; its modules are encoded again, not read"
            return None
        try:
            return _read_entry(path)
        except _Unreadable as err:
            self.unreadable += 1
            self._forget(key, str(err))
        except Exception as err:  # safetensors raises several types
            self.corrupt += 1
            self._forget(key, f"module file {path.name} could not be used ({_why(err)}); it will be re-encoded")
        return None

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def manifest(self, key: str) -> dict:
        from safetensors import safe_open

        with safe_open(str(self.path(key)), framework="pt") as f:
            return dict(f.metadata() or {})

    def _forget(self, key: str, why: str) -> None:
        self.last_error = self.note = why
        self.delete(key)


def remove_stale_temps(root: Path) -> list[Path]:
    """Remove killed saves' temporary files from ``root``; return those removed."""
    return remove_killed_saves(root, STALE_TEMP_S)


def _read_entry(path: Path):
    """The entry in the file at ``path``, its header and tensors checked."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") not in READABLE:
        raise _Unreadable(f"{path.name} has format {meta.get('format')!r}, which this version does not "
                          f"read ({', '.join(READABLE)}); it will be re-encoded")
    if HEADER_SUM in meta and meta[HEADER_SUM] != _header_sum(meta):
        raise _Damaged("its header's checksum does not match: a field was changed")
    if meta.get("crc32") != str(_crc(tensors)):
        raise _Damaged("its tensors' checksum does not match")
    return entry_from_tensors(tensors, meta)


class ModuleStore:
    """put / get / has / where / nbytes / evict / pin, on ``device``.

    ``page_locked``: the model computes on CUDA, so entries kept in CPU memory are page-locked for asynchronous
    copies (engine/kv/pinned.py; their bytes count against the budget as any entry's); ``pinning`` says whether
    that is on. (``pin`` / ``pinned`` are another thing: entries kept safe from eviction.)"""

    def __init__(self, device: str = "cpu", budget_bytes: int | None = None, disk: DiskStore | None = None,
                 page_locked: bool = False):
        check_device(device)
        self.device = device
        self.pinning = PinState.for_store(page_locked, device)
        self.budget_bytes = None if budget_bytes is None else _budget(budget_bytes)
        self.disk = disk
        self._entries: OrderedDict[str, object] = OrderedDict()
        self._pinned: set[str] = set()
        self._listeners: list = []
        self._lock = threading.RLock()
        self.evictions = 0
        self.disk_loads = 0
        self._unsaved: dict[str, str] = {}  # key -> why the disk refused it (it is kept in memory)

    # -- public API ---------------------------------------------------------------------------

    def put(self, key: str, entry, pinned: bool = False, meta: dict | None = None):
        """Store ``entry`` in memory and on disk; return the stored entry."""
        with self._lock:
            if key in self._entries:
                self._touch(key, pinned)
                return self._entries[key]
            self._make_room(entry.nbytes, key, meta)
            stored = self.pinning.pin(entry.to(self.device))
            self._entries[key] = stored
            self._touch(key, pinned)
        if self.disk is not None and not key.startswith(PREFIX):
            if self.disk.save(key, stored, meta):
                self._unsaved.pop(key, None)
            else:
                self._unsaved[key] = self.disk.last_error
        return stored

    def unsaved(self, key: str) -> str:
        """Why ``key``'s entry is in memory only (the disk refused it at its last put); '' when saved or not asked."""
        return self._unsaved.get(key, "")

    def get(self, key: str):
        """The entry for ``key``, from memory or disk, or :class:`MissingEntry`."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        entry = self.disk.load(key) if self.disk is not None and not key.startswith(PREFIX) else None
        if entry is None:
            raise MissingEntry(key)
        with self._lock:
            if key not in self._entries:
                self._make_room(entry.nbytes, key, None)
                self._entries[key] = self.pinning.pin(entry.to(self.device))
                self.disk_loads += 1
            return self._entries[key]

    def where(self, key: str) -> str | None:
        """'memory', 'disk' or None."""
        if key in self._entries:
            return "memory"
        if self.disk is not None and not key.startswith(PREFIX) and self.disk.has(key):
            return "disk"
        return None

    def has(self, key: str) -> bool:
        return self.where(key) is not None

    def __contains__(self, key: str) -> bool:
        """In memory."""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def nbytes(self, keys: list[str] | None = None) -> int:
        """Bytes in memory, of all entries or of ``keys``."""
        with self._lock:
            chosen = self._entries if keys is None else {k: self._entries[k] for k in set(keys) if k in self._entries}
            return sum(e.nbytes for e in chosen.values())

    def bytes_by_precision(self) -> dict[str, int]:
        """Bytes in memory per storage precision."""
        with self._lock:
            out: dict[str, int] = {}
            for e in self._entries.values():
                out[e.precision] = out.get(e.precision, 0) + e.nbytes
            return out

    def entry_bytes(self, key: str) -> int:
        """Bytes of one entry (0 when unknown)."""
        if key in self._entries:
            return self._entries[key].nbytes
        if self.disk is not None and self.disk.has(key):
            try:
                return int(self.disk.manifest(key).get("bytes", 0))
            except Exception:
                return 0
        return 0

    def check_fits(self, keys: list[str], what: str = "this prompt") -> None:
        """Raise StorageError when ``keys`` cannot be in memory together."""
        self.check_need(sum(self.entry_bytes(k) for k in set(keys)), what)

    def check_need(self, need: int, what: str = "this prompt") -> None:
        """Raise StorageError when ``need`` bytes exceed the budget."""
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise StorageError(f"{what} needs {_mb(need)} of module KV in memory at once, but the module memory "
                               f"budget is {_mb(self.budget_bytes)}; raise the budget (--budget-mb) or import fewer "
                               "modules")

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget, evicting at once."""
        budget_bytes = _budget(budget_bytes)
        with self._lock:
            self.budget_bytes = budget_bytes
            self._shrink_to(budget_bytes)

    @property
    def lock(self) -> threading.RLock:
        """The store's lock, shared by the prefix cache."""
        return self._lock

    def touch(self, keys: list[str]) -> None:
        """Mark ``keys`` used now, the last most recently."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def on_evict(self, listener) -> None:
        """Call ``listener(key)`` on each budget eviction."""
        self._listeners.append(listener)

    def pin(self, key: str, pinned: bool = True) -> None:
        with self._lock:
            (self._pinned.add if pinned else self._pinned.discard)(key)

    def pinned(self) -> set[str]:
        return set(self._pinned)

    def evict(self, key: str) -> bool:
        with self._lock:
            self._pinned.discard(key)
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.pinning.forget(entry)
            return entry is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pinned.clear()
            self.pinning.pinned_bytes = 0

    def stats(self) -> dict:
        d = self.disk
        with self._lock:
            prefix = [e.nbytes for k, e in self._entries.items() if k.startswith(PREFIX)]
        return {"device": self.device, "entries": len(self), "bytes": self.nbytes(), "budget_bytes": self.budget_bytes,
                "prefix_entries": len(prefix), "prefix_bytes": sum(prefix),
                "bytes_by_precision": self.bytes_by_precision(),
                "pinned": len(self._pinned), "page_locked": self.pinning.why,
                "page_locked_bytes": self.pinning.pinned_bytes, "evictions": self.evictions, "disk_loads": self.disk_loads,
                "persist": d is not None, "disk_writes": d.writes if d else 0,
                "disk_write_errors": d.write_errors if d else 0, "disk_corrupt": d.corrupt if d else 0,
                "disk_unreadable": d.unreadable if d else 0,
                "disk_error": d.last_error if d else "", "disk_note": d.note if d else ""}

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else _mb(self.budget_bytes)
        return f"ModuleStore(device={self.device}, entries={len(self)}, bytes={self.nbytes():,}, budget={budget})"

    # -- internal helpers ---------------------------------------------------------------------

    def _touch(self, key: str, pinned: bool) -> None:
        self._entries.move_to_end(key)
        if pinned:
            self._pinned.add(key)

    def _make_room(self, need: int, key: str, meta: dict | None) -> None:
        if self.budget_bytes is None:
            return
        if need > self.budget_bytes:
            name = (meta or {}).get("module", key)
            raise StorageError(f"module '{name}' needs {_mb(need)} but the module memory budget is "
                               f"{_mb(self.budget_bytes)}; raise the budget (--budget-mb) to at least {_mb(need)}")
        used = self._shrink_to(self.budget_bytes - need)
        if used + need > self.budget_bytes:
            raise StorageError(f"pinned modules fill the module memory budget ({_mb(self.budget_bytes)}); unpin "
                               f"some or raise the budget (--budget-mb) by {_mb(used + need - self.budget_bytes)}")


    def _shrink_to(self, limit: int) -> int:
        """Evict unpinned entries, oldest first, down to ``limit`` bytes; return the bytes left."""
        used = sum(e.nbytes for e in self._entries.values())
        while used > limit:
            victim = next((k for k in self._entries if k not in self._pinned), None)  # listeners evict too
            if victim is None:
                break
            self.pinning.forget(self._entries.pop(victim))
            self.evictions += 1
            for listener in self._listeners:
                listener(victim)
            used = sum(e.nbytes for e in self._entries.values())
        return used


def _budget(budget_bytes) -> int:
    """``budget_bytes`` checked as RunConfig checks it."""
    try:
        return LIMITS["budget_bytes"].check(budget_bytes)
    except EngineError as err:
        raise StorageError(str(err)) from None


def default_budget(device: str = "cpu") -> int:
    """Half of the memory available on ``device``."""
    from engine.devices import available_bytes

    avail = available_bytes(device) or 8 * 2**30
    return max(256 * 2**20, avail // 2)


class _Unreadable(ValueError):
    """A file of a format this version does not read."""


class _Damaged(ValueError):
    """A file that fails its checksums."""


def _header_sum(manifest: dict) -> str:
    """SHA-256 of the other manifest fields."""
    fields = {k: v for k, v in manifest.items() if k != HEADER_SUM}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _why(err: Exception) -> str:
    """Why a file could not be used, in a clause."""
    text = str(err).splitlines()[0] if str(err) else ""
    if isinstance(err, ValueError) and text:
        return text[:160]
    return f"{type(err).__name__}: {text[:120]}" if text else type(err).__name__


def _crc(tensors: dict) -> int:
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous().reshape(-1)
        crc = zlib.crc32(name.encode(), crc)
        if t.numel():
            crc = zlib.crc32(t.view(torch.uint8).numpy(), crc)
    return crc


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"

