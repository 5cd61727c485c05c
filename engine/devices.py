"""The cache folder, and what the machine has: CUDA, memory, running processes. No torch at import."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import StorageError


def cache_root() -> Path:
    """``$PML_STUDIO_CACHE``, else ``~/.cache/pml-studio``."""
    return Path(os.environ.get("PML_STUDIO_CACHE") or Path.home() / ".cache" / "pml-studio")


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
