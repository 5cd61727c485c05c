"""The cache folder, and what the machine has: CUDA, memory, running processes. No torch at import."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import StorageError
from engine.owned import check_trusted, private_folder

CACHE_FIX = "set PML_STUDIO_CACHE to a folder of yours (or leave it unset for ~/.cache/pml-studio)"
CACHE_FOLDERS = ("models", "gguf", "kernels", "packed", "modules")  # what the engine keeps under the cache root


def cache_root() -> Path:
    """``$PML_STUDIO_CACHE``, else ``~/.cache/pml-studio``: made if missing, refused unless the user's own
    (engine/owned.py: models, compiled kernels and module KV are loaded from it)."""
    root = Path(os.environ.get("PML_STUDIO_CACHE") or Path.home() / ".cache" / "pml-studio")
    return private_folder(root, "cache folder", CACHE_FIX)


def cache_folder(name: str, make: bool = True) -> Path:
    """The cache root's folder ``name``, made if missing (unless ``make`` is False: checked where it exists), refused
    unless the user's own."""
    if make:
        return private_folder(cache_root() / name, f"cache folder '{name}'", CACHE_FIX)
    folder = cache_root() / name
    check_trusted(folder, f"cache folder '{name}'", CACHE_FIX, missing_ok=True)
    return folder


def check_cache() -> Path:
    """Check, at a start, the cache root and what the engine keeps in it: one ForeignPathError naming the first path
    another account controls; the root."""
    root = cache_root()
    for name in CACHE_FOLDERS:
        if os.path.lexists(root / name):
            cache_folder(name)
    return root


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs here, as any user."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's
        return True
    return True


def cuda_available() -> bool:
    """Whether torch sees a usable CUDA device."""
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def check_device(device: str) -> None:
    """Raise StorageError when ``device`` cannot be used here."""
    if device == "cpu":
        return
    if device.startswith("cuda"):
        if not cuda_available():
            raise StorageError("GPU storage needs a CUDA device, and none is available on this machine "
                               "(torch.cuda.is_available() is False); use --storage cpu")
        return
    raise StorageError(f"unknown storage '{device}'; use cpu or cuda")


def available_bytes(device: str) -> int | None:
    """Free memory on ``device`` in bytes, or None."""
    if device.startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info()
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
