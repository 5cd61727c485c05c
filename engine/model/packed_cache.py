"""A model's packed layers saved once and read back at its next load; the file's name keys everything they depend
on (model, weights, kernels, packing code). Measured: docs/models.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Callable

from engine.devices import cache_folder
from engine.files import remove_killed_saves, save_whole

SAVE_FROM = 20_000_000  # linear weights below which nothing is saved
FORMAT = 1  # the saved file's layout


def folder() -> Path:
    return cache_folder("packed")


def key(fingerprint: str, weights: str) -> str:
    """A key over the model, weights, kernels and packing code."""
    from engine.model import gguf, kernels, weights as packing

    h = hashlib.sha256(f"{FORMAT}|{fingerprint}|{weights}|{kernels.status()}".encode())
    for path in (Path(packing.__file__), Path(gguf.__file__), Path(kernels.__file__), *kernels.SOURCES):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def path_for(name: str, weights: str, fingerprint: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80] or "model"
    return folder() / f"{safe}.{weights}.{key(fingerprint, weights)}.safetensors"


def pack(model, weights: str, name: str, fingerprint: str, codes: Callable[[], dict | None]) -> tuple[int, str]:
    """``quantize_weights`` from the saved file, else packed (``codes()``: GGUF blocks) and saved: (bytes, how)."""
    import torch

    from engine.model.weights import quantize_weights

    if weights == "fp32":
        return quantize_weights(model, weights), "loaded"
    big = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) >= SAVE_FROM
    if not big or next(model.parameters()).device.type != "cpu":
        return quantize_weights(model, weights, codes() if weights == "gguf" else None), "packed"
    path = path_for(name, weights, fingerprint)
    saved = _read(path)
    if saved is not None:
        try:
            return quantize_weights(model, weights, saved=saved), "saved"
        except (KeyError, ValueError, RuntimeError) as err:  # a layer missing or reshaped
            print(f"pml-studio: packing again ({path.name} does not fit the model: {err})", file=sys.stderr)
    total = quantize_weights(model, weights, codes() if weights == "gguf" else None)
    _write(model, path)
    return total, "packed"


def _read(path: Path) -> dict | None:
    """``path``'s layers (weights.saved_layers' form), or None."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            kinds = json.loads((f.metadata() or {})["kinds"])
            # cloned: 8-byte-aligned tensors slow the kernels (docs/models.md)
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as err:  # noqa: BLE001 (unreadable: packed again)
        print(f"pml-studio: packing again ({path.name} cannot be read: {err})", file=sys.stderr)
        return None
    saved: dict = {layer: (kind, {}) for layer, kind in kinds.items()}
    for full, tensor in tensors.items():
        layer, _, buffer = full.rpartition(".")
        if layer in saved:
            saved[layer][1][buffer] = tensor
    return saved


def _write(model, path: Path) -> None:
    """Save ``model``'s packed layers whole (or say why not); remove its older files."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from engine.model.weights import saved_layers

    layers = saved_layers(model)
    tensors = {f"{layer}.{buffer}": t.contiguous() for layer, (_, found) in layers.items() for buffer, t in found.items()}
    kinds = {"kinds": json.dumps({k: kind for k, (kind, _) in layers.items()})}
    remove_killed_saves(path.parent)
    try:
        save_whole(path, lambda part: save_file(tensors, str(part), metadata=kinds))
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk as its own error
        print(f"pml-studio: the packed weights were not saved ({err}); the next load packs them again",
              file=sys.stderr)
        return
    stem = path.name.rsplit(".", 2)[0]  # name.weights
    for old in path.parent.glob(f"{stem}.*.safetensors"):
        if old != path and old.name.count(".") == path.name.count("."):
            old.unlink(missing_ok=True)
