"""The model layer: loading (load.py, gguf.py, sanity.py), positions and attention (positions.py, attend.py) and
weight precision (weights.py). Names here import no torch.

**One default everywhere**: a run that names no model — ``Engine()``, ``pml-studio run`` / ``info`` / ``api``, the
studio — runs :func:`default_model` (:data:`START_MODEL` unless ``$PML_STUDIO_MODEL`` names another), and a run
that names no weights runs :func:`default_weights` of its model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# weight precisions (engine/model/weights.py); gguf: each layer as the model's GGUF file holds it where it can
WEIGHTS = ("fp32", "bf16", "int8", "int4", "gguf")

# The model that answers, on its GGUF file's own blocks (the values fp32 runs; speeds in docs/models.md).
START_MODEL, START_NAME, START_WEIGHTS = "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "gguf"
SMALL_MODEL = "SmolLM2-135M-Instruct"  # the small packaged model (key "default"): what the tests name
MODEL_ENV = "PML_STUDIO_MODEL"  # another default model, for every front end and the processes they start


@dataclass(frozen=True)
class KernelUse:
    """Which kernels multiply a model's packed weights (weights.kernel_use): ``own`` of its ``packed`` layers (bf16
    copies aside) on the engine's kernels, the rest on torch's."""

    packed: int = 0
    own: int = 0
    built: bool = False  # whether the engine's kernels are (asked only where a layer is packed)


def default_model() -> str:
    """The model a run that names none loads: ``$PML_STUDIO_MODEL``, else :data:`START_MODEL`."""
    return os.environ.get(MODEL_ENV) or START_MODEL


def default_weights(model: str | None) -> str:
    """The weights a run of ``model`` (None: :func:`default_model`) keeps when it names none: the start model's
    own GGUF blocks, fp32 for every other model (weights.py packs what --weights asks)."""
    return START_WEIGHTS if (model or default_model()) in (START_MODEL, START_NAME) else "fp32"
