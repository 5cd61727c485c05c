"""What the studio and ``pml-studio info`` say about a model's weight kernels (the engine gives the data)."""

from __future__ import annotations


def weight_kernels(use: dict, status: str, row_tile: int) -> str:
    """One line: which kernels multiply the packed weights (``status``: engine.public.kernel_status())."""
    packed, own = use.get("packed", 0), use.get("own", 0)
    if not packed:
        return "torch's dense matrix products"
    if own == packed:
        return status
    if own == 0:
        return f"torch's kernels (no layer has a multiple of {row_tile} rows, as the engine's need)" \
            if use.get("built") else status
    return f"{status} for {own} of {packed} layers, torch's for the rest (rows not a multiple of {row_tile})"


def info_words(info: dict) -> dict:
    use = info.get("weight_kernel_use") or {}
    if not use.get("packed"):
        return {"weight_kernels": weight_kernels(use, "", 0)}
    from engine.public import ROW_TILE, kernel_status

    return {"weight_kernels": weight_kernels(use, kernel_status(), ROW_TILE)}
