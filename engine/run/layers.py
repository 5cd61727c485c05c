"""The model's decoder layers, and a forward that stops after one of them."""

from __future__ import annotations

import torch

from engine.errors import EngineError
from engine.model.load import LoadedModel


def decoder_layers(model, what: str, fix: str) -> torch.nn.ModuleList:
    """The model's decoder layers, in call order."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise EngineError(f"{what} needs the decoder layers at `model.model.layers`, which "
                          f"'{model.config.model_type}' models do not have; {fix}")
    return layers


def run_until(lm: LoadedModel, last: int, what: str, fix: str, **inputs) -> None:
    """``lm.model(**inputs)`` through decoder layers ``0..last`` only."""
    handle = decoder_layers(lm.model, what, fix)[last].register_forward_hook(_stop)
    try:
        lm.model(**inputs)
    except _Enough:
        return
    finally:
        handle.remove()
    raise EngineError(f"{what} ran past layer {last}: the model's decoder layers are not called in order; {fix}")


class _Enough(Exception):
    """Ends a forward."""


def _stop(module, args, output):
    raise _Enough
