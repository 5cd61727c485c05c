"""Host-to-GPU copies of stored KV as one strided DMA transfer each (``cudaMemcpy2DAsync``).

Why: a run's buffer keeps each layer's keys as ``[kv_heads, capacity, head_dim]``, so a module's tokens land in
``2 × kv_heads`` separate rows per layer. torch's ``copy_`` into such a view allocates a contiguous temporary,
copies into it and launches a kernel to scatter it, all before the forward's first kernel is launched (measured:
bench/results/gpu-profile-llama-2-7b-random.json). Every such copy is rows of equal width at a fixed pitch on
both sides, which is exactly what one 2-D DMA transfer does: one runtime call, no temporary, no kernel.

:func:`copy_rows` does that where it applies (page-locked host source, CUDA destination, same dtype, both
sides rows at one pitch) and returns False elsewhere; the caller then uses ``copy_``.
"""

from __future__ import annotations

import ctypes
import math

import torch

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_runtime: list = []  # [the loaded CUDA runtime's cudaMemcpy2DAsync, or None], once looked up


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Enqueue ``dst.copy_(src)`` on the current stream as one 2-D transfer; False where it does not apply."""
    if dst.device.type != "cuda" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape:
        return False
    d, s = _rows(dst), _rows(src)
    if d is None or s is None or d[1:] != s[1:] or not src.is_pinned():
        return False
    fn = memcpy_2d()
    if fn is None:
        return False
    size = dst.element_size()
    (d_pitch, height, width), s_pitch = d, s[0]
    if height * width == 0:
        return True
    with torch.cuda.device(dst.device):
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        err = fn(dst.data_ptr(), d_pitch * size, src.data_ptr(), s_pitch * size, width * size, height,
                 _HOST_TO_DEVICE, stream)
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
    return True


def copy_into(dst: torch.Tensor, src: torch.Tensor, held: list) -> None:
    """``dst.copy_(src, non_blocking=True)``, as one DMA transfer where :func:`copy_rows` applies; that transfer's
    source goes into ``held``, which must outlive it (the DMA reads it after this returns)."""
    if copy_rows(dst, src):
        held.append(src)
    else:
        dst.copy_(src, non_blocking=True)


def available() -> str:
    """"on", or why host KV copies go through torch's ``copy_``."""
    if not torch.cuda.is_available():
        return "off: no CUDA device"
    return "on" if memcpy_2d() is not None else "off: the CUDA runtime torch loaded was not found in this process"


def memcpy_2d():
    """``cudaMemcpy2DAsync`` of the CUDA runtime torch loaded, or None."""
    if not _runtime:
        _runtime.append(_find())
    return _runtime[0]


def _find():
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return fn
    return None


def _rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(pitch, height, width) in elements when ``t`` is ``height`` rows of ``width`` contiguous elements, each
    ``pitch`` after the last (the last two dims form a row; the leading ones step by one pitch); else None."""
    if t.dim() < 2:
        return None
    shape, stride = t.shape, t.stride()
    if shape[-1] != 1 and stride[-1] != 1:
        return None
    if shape[-2] != 1 and stride[-2] != shape[-1]:
        return None
    width = shape[-1] * shape[-2]
    lead = [(n, st) for n, st in zip(shape[:-2], stride[:-2]) if n != 1]
    if not lead:
        return width, 1, width
    for (_, st_out), (n_in, st_in) in zip(lead, lead[1:]):
        if st_out != st_in * n_in:
            return None
    pitch = lead[-1][1]
    return (pitch, math.prod(n for n, _ in lead), width) if pitch >= width else None
