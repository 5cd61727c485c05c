"""The engine's C++ kernels (csrc/), built once into ``$PML_STUDIO_CACHE/kernels``; where they cannot be,
:func:`ops` is None and :func:`status` says why. Layouts: csrc/packed_matmul.cpp; measured: docs/models.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import threading
from enum import IntEnum
from pathlib import Path

import torch

from engine.devices import cache_folder
from engine.files import remove_killed_saves
from engine.owned import ForeignPathError, check_own_file

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("packed_matmul.cpp", "decode_step.cpp")]
FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
ROW_TILE = 64  # output rows per kernel tile
GROUP = 32  # int4 columns per scale

_lock = threading.Lock()
_state: dict = {}


class Kernel(IntEnum):
    """csrc/decode_step.cpp's ``enum class Kernel``."""

    DENSE = 0
    INT8 = 1
    INT4 = 2


def status() -> str:
    """Whether the kernels run, and why not."""
    ops()
    return _state["status"]


def ops():
    """The compiled module, or None (see :func:`status`)."""
    with _lock:
        if "ops" not in _state:
            _state["ops"], _state["status"] = _build()
        return _state["ops"]


def fits(kind: str, rows: int, cols: int) -> bool:
    """Whether a ``kind`` weight of this shape runs on the kernels."""
    if kind not in ("int8", "int4") or rows % ROW_TILE or (kind == "int4" and cols % GROUP):
        return False
    return ops() is not None


def _build():
    if os.environ.get("PML_STUDIO_KERNELS", "1") == "0":
        return None, "torch's kernels (PML_STUDIO_KERNELS=0)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"torch's kernels (the engine's need x86-64 with AVX-512 VNNI; this CPU is {platform.machine()})"
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return None, f"torch's kernels (this CPU lacks {', '.join(missing)})"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return None, "torch's kernels (no C++ compiler to build the engine's: install g++)"
    from torch.utils.cpp_extension import verify_ninja_availability
    try:
        verify_ninja_availability()
    except RuntimeError:
        return None, "torch's kernels (ninja is missing: pip install ninja)"
    source = b"".join(p.read_bytes() for p in SOURCES)
    # a folder per source text, torch and environment: a changed source builds anew
    torch_home = str(Path(torch.__file__).resolve().parent)
    key = hashlib.sha256(source + torch.__version__.encode() + torch_home.encode() + " ".join(FLAGS).encode()
                         ).hexdigest()[:12]
    name = f"pml_packed_{key}"
    try:
        folder = cache_folder("kernels")
        built = folder / key / f"{name}.so"
        if os.path.lexists(built):
            return load_built(name, built), "the engine's AVX-512 VNNI kernels"
        module = _build_into(folder, key, name)
    except ForeignPathError as err:  # never load a library another account could have written
        print(f"pml-studio: warning: {err}", file=sys.stderr, flush=True)
        return None, f"torch's kernels (the engine's were refused: {err})"
    except Exception as e:  # a compiler error: torch's kernels instead
        lines = str(e).strip().splitlines() or ["?"]
        said = next((line for line in lines if "error" in line), lines[-1])
        return None, f"torch's kernels (building the engine's failed: {said.strip()[:300]})"
    return module, "the engine's AVX-512 VNNI kernels"


def load_built(name: str, path: Path):
    """The extension module ``name`` at ``path``, imported only if the file and every folder above it are the user's
    own (checked just before loading: its constructors run as the user)."""
    check_own_file(path, "compiled kernel library", f"remove {path.parent}; the studio builds it again")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_into(folder: Path, key: str, name: str):
    """Build the kernels in a private folder of this build's own, then move it into place as ``folder/key`` (another
    builder's, if it got there first, is kept); the loaded module."""
    from torch.utils.cpp_extension import load

    remove_killed_saves(folder)  # builds that a killed process left
    work = folder / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
    work.mkdir(mode=0o700)
    try:
        module = load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                      build_directory=str(work), verbose=False)
        if (folder / key).is_dir() and not (folder / key / f"{name}.so").exists():
            shutil.rmtree(folder / key, ignore_errors=True)  # a build an older version left unfinished
        try:
            os.rename(work, folder / key)
        except OSError:  # in place already
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return module


def cpu_info(field: str) -> str:
    """``field``'s first value in /proc/cpuinfo, or ""."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(cpu_info("flags").split())


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q`` [rows, cols] -> the int8 layout."""
    rows, cols = q.shape
    if cols % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return q.reshape(rows // 16, 16, -1, 2).permute(0, 2, 1, 3).contiguous()


def unpack_int8(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of :func:`pack_int8`."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)[:, :cols]


def pack_group_scales(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scales [rows, groups] -> [rows/16, groups, 16]."""
    rows, groups = scale.shape
    return scale.reshape(rows // 16, 16, groups).transpose(1, 2).contiguous().to(dtype)


def unpack_group_scales(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_group_scales`."""
    blocks, groups, _ = packed.shape
    return packed.float().transpose(1, 2).reshape(blocks * 16, groups)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.float16
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q`` [rows, cols] in 0..15 (0..31), ``scale``, ``zero`` [rows, cols / 32] -> (nibbles, sz, fifth bits)."""
    rows, cols = q.shape
    q = q.to(torch.uint8).reshape(rows // 16, 2, 8, cols // 4, 4)  # [block, half, row i, quad, column c]
    nibbles = ((q[:, 0] & 15) | ((q[:, 1] & 15) << 4)).permute(0, 2, 1, 3).reshape(rows // 16, cols // 4, 32)
    high = None
    if bool((q > 15).any()):
        import numpy as np

        bits = (q >> 4).permute(0, 3, 1, 2, 4).reshape(rows // 16, cols // 4, 64)
        packed = np.packbits(bits.contiguous().numpy(), axis=-1, bitorder="little")
        high = torch.from_numpy(np.ascontiguousarray(packed).view(np.int64)[..., 0])
    sz = torch.stack([scale, zero], 1).reshape(rows // 16, 16, 2, cols // GROUP).permute(0, 3, 2, 1)
    return nibbles.contiguous(), sz.contiguous().to(dtype), high


def unpack_int4(nibbles: torch.Tensor, sz: torch.Tensor, high: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4`: (q, scale, zero)."""
    blocks, quads = nibbles.shape[:2]
    b = nibbles.reshape(blocks, quads, 8, 4)
    q = torch.stack([b & 15, b >> 4], 1)  # [block, half, quad, row i, column c]
    if high is not None:
        bits = (high[..., None] >> torch.arange(64)) & 1  # [block, quad, 64]: half, row i, column c
        q = q + (bits.reshape(blocks, quads, 2, 8, 4).permute(0, 2, 1, 3, 4) << 4).to(torch.uint8)
    q = q.permute(0, 1, 3, 2, 4).reshape(blocks * 16, quads * 4)
    s = sz.float().permute(0, 3, 2, 1).reshape(blocks * 16, 2, -1)
    return q, s[:, 0], s[:, 1]
