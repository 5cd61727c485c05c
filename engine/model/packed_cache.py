"""Packed weights kept on disk: a model's layers as ``quantize_weights`` packed them, saved once and read back at
the next load of the same model, weights setting and code.

Why: packing is the slow part of loading a model on packed weights. For Qwen2.5-Coder-0.5B on ``gguf`` weights
(the studio's default), ~7.5 s of an ~11 s load on this project's 2-core CPU went to unpacking the GGUF file's
blocks (gguf.file_blocks), checking them against the loaded weights and laying them out for the kernels; the
studio's first Compare and every ``pml-studio run`` paid it. Reading the packed tensors back (safetensors, ~0.4 GB)
takes a fraction of a second.

The file's name carries a key over everything the packed tensors depend on: the model's fingerprint (name,
folder, config and weight files' sizes and times), the weights setting, the kernels in use (their build and
whether they run) and the text of the code that packs (weights.py, gguf.py, kernels.py, the kernels' sources).
Any change gives a new key; the model's older files are removed when the new one is written. A file that cannot
be read back, or lacks a layer, is packed again and rewritten. Small models (under :data:`SAVE_FROM` linear
weights: the tests' random ones) pack in well under a second and are not saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

from engine.devices import cache_root

SAVE_FROM = 20_000_000  # linear weights: below this a model packs in well under a second here, so it is not saved
FORMAT = 1  # of the saved file: bumped when its layout changes


def folder() -> Path:
    return cache_root() / "packed"


def key(fingerprint: str, weights: str) -> str:
    """The key of ``weights`` packed for the model of ``fingerprint`` by this code and these kernels."""
    from engine.model import gguf, kernels, weights as packing

    h = hashlib.sha256(f"{FORMAT}|{fingerprint}|{weights}|{kernels.status()}".encode())
    for path in (Path(packing.__file__), Path(gguf.__file__), Path(kernels.__file__), *kernels.SOURCES):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def path_for(name: str, weights: str, fingerprint: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80] or "model"
    return folder() / f"{safe}.{weights}.{key(fingerprint, weights)}.safetensors"


def pack(model, weights: str, name: str, fingerprint: str, codes: Callable[[], dict | None]) -> tuple[int, str]:
    """Pack ``model``'s linear layers for ``weights`` (weights.quantize_weights) from its saved file when there is
    one, else by packing them (``codes()`` gives the GGUF blocks ``gguf`` needs) and saving the result; return
    (the linear weights' bytes, where they came from: "saved", "packed", or "loaded" for fp32's, left as loaded)."""
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
        except (KeyError, ValueError, RuntimeError) as err:  # a layer missing or of another shape: pack again
            print(f"pml-studio: packing again ({path.name} does not fit the model: {err})", file=sys.stderr)
    total = quantize_weights(model, weights, codes() if weights == "gguf" else None)
    _write(model, path)
    return total, "packed"


def _read(path: Path) -> dict | None:
    """The layers saved in ``path`` (weights.saved_layers' form), or None when it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            kinds = json.loads((f.metadata() or {})["kinds"])
            # copied into torch's own allocations: safetensors hands them out 8-byte aligned (40 mod 64 here), and
            # the kernels' AVX-512 loads across cache lines decoded ~30 % slower (bench/decode.py, gguf 30 vs 23 ms)
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as err:  # noqa: BLE001 (truncated, another format, unreadable: packed again and rewritten)
        print(f"pml-studio: packing again ({path.name} cannot be read: {err})", file=sys.stderr)
        return None
    saved: dict = {layer: (kind, {}) for layer, kind in kinds.items()}
    for full, tensor in tensors.items():
        layer, _, buffer = full.rpartition(".")
        if layer in saved:
            saved[layer][1][buffer] = tensor
    return saved


def _write(model, path: Path) -> None:
    """Save ``model``'s packed layers in ``path`` (whole or not at all) and remove the model's older files; a disk
    that refuses is reported and the model still runs."""
    from safetensors.torch import save_file

    from engine.model.weights import saved_layers

    layers = saved_layers(model)
    tensors = {f"{layer}.{buffer}": t.contiguous() for layer, (_, found) in layers.items() for buffer, t in found.items()}
    part = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(part), metadata={"kinds": json.dumps({k: kind for k, (kind, _) in layers.items()})})
        os.replace(part, path)
    except OSError as err:
        part.unlink(missing_ok=True)
        print(f"pml-studio: the packed weights were not saved ({err}); the next load packs them again",
              file=sys.stderr)
        return
    stem = path.name.rsplit(".", 2)[0]  # name.weights
    for old in path.parent.glob(f"{stem}.*.safetensors"):
        if old != path and old.name.count(".") == path.name.count("."):
            old.unlink(missing_ok=True)
