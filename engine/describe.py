"""A loaded model as ``pml-studio info --json`` and the Model tab describe it."""

from __future__ import annotations

from engine import config as cfg


def info_document(info: dict) -> dict:
    """The model's facts (``Engine.info()``) with the sentences ``info --json`` adds."""
    return {**info, "attention_path": attention_path(info), "decode_step": decode_step(info),
            "dtype_why": cfg.dtype_why(info["device"], info["dtype"]).value,
            "dtype_reason": dtype_reason(info["device"], info["dtype"], info.get("weights") or "fp32",
                                         info.get("prefill_kernel") or "")}


DTYPE_REASONS = {
    cfg.DtypeWhy.ASKED: "{dtype} as asked (the default on {device} is {default})",
    cfg.DtypeWhy.CPU_DEFAULT: "the default on CPU, so that runs exact in fp32 (a scaffold, one module at the start, "
                              "blend at 100 %) show as exact; bf16 is faster but adds its own first-token KL to "
                              "every comparison (measured: docs/models.md); choose bf16 for speed",
    cfg.DtypeWhy.GPU_DEFAULT: "the default on a GPU: bf16 halves the bytes each decode step reads (not measured on "
                              "this project's machines, which have no GPU)",
}


INEXACT_KERNELS = ("gemm-bf16", "gemm-int8")


def dtype_reason(device: str, dtype: str, weights: str = "fp32", kernel: str = "") -> str:
    """Why the model computes in ``dtype``; with fp32, what else rounds it (``weights``, a prefill ``kernel``)."""
    default = cfg.short_dtype(cfg.default_dtype(device))
    why = cfg.dtype_why(device, dtype)
    out = DTYPE_REASONS[why].format(dtype=cfg.short_dtype(dtype), device=device, default=default)
    rounding = [f"the linear weights are {weights}"] if weights != "fp32" else []
    rounding += [f"the prefill multiplies in {kernel.removeprefix('gemm-')} ({kernel})"] if kernel in INEXACT_KERNELS \
        else []
    if dtype == "float32" and rounding:
        out = ("the activations and the KV cache are fp32, but " + " and ".join(rounding) + ": runs that are exact in "
               "fp32 (a scaffold, one module at the start, blend at 100 %) match the baseline only to that rounding "
               "here; --weights fp32 with --prefill-kernel gemm-fp32 (or $PML_STUDIO_PREFILL_KERNEL) makes them exact, "
               "at a slower prefill")
    return out


def attention_path(info: dict) -> str:
    """Which attention code runs and how positions reach it."""
    if info["attention"] == "own":
        how = "ALiBi bias read at position ids" if info["position_encoding"] == "alibi" else "RoPE at position ids"
        return f"the model's own ({how})"
    window = f"; {info['sliding_layers']} sliding-window layers masked by position ids" if info["sliding_window"] else ""
    return f"registered PML attention{window}"


def decode_step(info: dict) -> str:
    """What runs a decode step, and why when it is not the engine's C++ decoder."""
    why = info["decode_fallback"]
    return "the engine's C++ decode step (one call per token)" if not why else f"transformers' modules: {why}"
