"""The model layer: loading, positions, attention and weight precision; the defaults here import no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass

WEIGHTS = ("fp32", "bf16", "int8", "int4", "gguf")  # docs/models.md, "Weights and kernels"

PREFILL_KERNELS = ("auto", "gemm-bf16", "gemm-fp32", "gemm-int8", "blocks")  # engine/model/prefill.py
START_MODEL, START_NAME, START_WEIGHTS = "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "gguf"  # docs/models.md
SMALL_MODEL = "SmolLM2-135M-Instruct"  # the packaged model the tests name
MODEL_ENV = "PML_STUDIO_MODEL"


@dataclass(frozen=True)
class KernelUse:
    """Which kernels multiply a model's packed weights (weights.kernel_use): ``own`` of its ``packed`` layers (bf16
    copies aside) on the engine's kernels, the rest on torch's."""

    packed: int = 0
    own: int = 0
    built: bool = False  # whether the engine's kernels are (asked only where a layer is packed)


@dataclass(frozen=True)
class PrefillChoice:
    """What multiplies a model's multi-token forwards' linears (engine/model/prefill.py), why, and the bytes of the
    weights' copy laid out for it."""

    kernel: str = "dense"
    why: str = "the linear layers are the model's own dense matrices (no packed weights)"
    nbytes: int = 0
    layout: str = ""  # the copy's, where not the plain matrix (module KV is keyed by it)


def default_model() -> str:
    """The model of a run that names none."""
    return os.environ.get(MODEL_ENV) or START_MODEL


def default_weights(model: str | None) -> str:
    """The weights of a run that names none: gguf for the start model, else fp32."""
    return START_WEIGHTS if (model or default_model()) in (START_MODEL, START_NAME) else "fp32"
