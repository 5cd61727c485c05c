"""Multi-token forwards (prefill, module encoding, recompute) run a packed model's linear layers as large GEMMs over
weights laid out once for them; decode keeps the packed blocks. The kernel is chosen by capability check and a short
measurement (:func:`detect`); ``--prefill-kernel`` or ``PML_STUDIO_PREFILL_KERNEL`` asks for one. docs/models.md.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from engine.errors import ModelError
from engine.model import PREFILL_KERNELS as KERNELS
from engine.model import PrefillChoice
from engine.model.kernels import _cpu_flags, cpu_info
from engine.model.weights import PackedLinear

ENV = "PML_STUDIO_PREFILL_KERNEL"
GEMM_FROM = 16  # rows from which a forward's linears run as GEMMs (fewer: decode steps and batches keep the blocks)
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # the CPU's bf16 matrix units (oneDNN uses them)

_asked: list[str] = []  # the process's --prefill-kernel
_detected: dict[str, tuple[str, str]] = {}


def ask(kernel: str | None) -> None:
    """The kernel models loaded from now on use (None: the environment's, else auto)."""
    _asked[:] = [] if kernel is None else [check(kernel, "--prefill-kernel")]


def asked() -> str:
    return _asked[0] if _asked else check(os.environ.get(ENV) or "auto", ENV)


def check(kernel: str, where: str) -> str:
    if kernel not in KERNELS:
        raise ModelError(f"{where}: unknown prefill kernel '{kernel}'; use one of {', '.join(KERNELS)}")
    return kernel


def bf16_units() -> str:
    """Why this CPU has no bf16 matrix units ("" if it has them)."""
    flags = _cpu_flags()
    if not any(f in flags for f in BF16_FLAGS):
        return f"this CPU has no bf16 matrix units ({' / '.join(BF16_FLAGS)}; torch sees " \
               f"{torch.backends.cpu.get_cpu_capability()})"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "torch's oneDNN does not run bf16 here"
    return ""


def detect() -> tuple[str, str]:
    """(kernel, why) for auto: bf16 where the CPU has bf16 units and it measures faster than fp32, else fp32."""
    if "auto" not in _detected:
        lacking = bf16_units()
        if lacking:
            _detected["auto"] = ("gemm-fp32", f"{lacking}; fp32 GEMM (bf16 is emulated there, ~5x slower)")
        else:
            bf16, fp32 = _time_gemm(torch.bfloat16), _time_gemm(torch.float32)
            _detected["auto"] = ("gemm-bf16", f"bf16 matrix units: bf16 GEMM {fp32 / bf16:.1f}x fp32's") \
                if bf16 < fp32 else ("gemm-fp32", f"bf16 measured slower than fp32 ({bf16 / fp32:.1f}x its time)")
    return _detected["auto"]


def _time_gemm(dtype: torch.dtype, rows: int = 256, shape: tuple[int, int] = (2048, 896), calls: int = 3,
               linear=F.linear) -> float:
    x, w = torch.randn(rows, shape[1]).to(dtype), torch.randn(*shape).to(dtype)
    linear(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        linear(x, w)
    return time.perf_counter() - start


def use(model: torch.nn.Module, kernel: str = "auto") -> PrefillChoice:
    """Lay ``model``'s packed layers out for ``kernel`` (auto: :func:`detect`); what runs, and its bytes."""
    kernel = check(kernel, "prefill kernel")
    layers = _layers(model)
    for m in layers:
        m.prefill = None
    if not layers:
        return PrefillChoice()
    why = "asked for"
    if kernel == "auto":
        kernel, why = detect()
    elif kernel == "gemm-bf16" and bf16_units():
        why = f"asked for, though {bf16_units()}: slow here"
    if kernel == "blocks":
        return PrefillChoice("blocks", "asked for: every forward multiplies the packed blocks (today's path)")
    gemm = GEMMS[kernel]
    for m in layers:
        m.prefill = gemm(m)
    if kernel == "gemm-fp32":
        why += _fp32_why([m.prefill for m in layers])
    layout = ",".join(sorted({m.prefill.layout for m in layers} - {""}))
    if layout:
        why += f"; its copy laid out once ({layout})"
    return PrefillChoice(kernel, why, sum(m.prefill.nbytes for m in layers), layout)


def _fp32_why(gemms: list["Fp32Gemm"]) -> str:
    """The shapes oneDNN runs, and its speedup."""
    shapes = sorted({g.shape for g in gemms if g.onednn})
    if not shapes:
        return ""
    return "; through oneDNN at " + ", ".join(f"{a}x{b} ({fp32_library((a, b))[1]:.1f}x MKL's sgemm)"
                                               for a, b in shapes)


def _layers(model: torch.nn.Module) -> list[PackedLinear]:
    """The packed layers a prefill multiplies by many rows (the output matrix reads one row per forward)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [m for m in model.modules() if isinstance(m, PackedLinear) and m is not head]


class Gemm:
    """A packed layer's weight laid out for one GEMM kernel; called as ``gemm(x2, bias)``."""

    start = GEMM_FROM
    layout = ""

    def __init__(self, layer: PackedLinear):
        self.weight = self.lay_out(layer)

    def lay_out(self, layer: PackedLinear):
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Fp32Gemm(Gemm):
    """fp32 by MKL or oneDNN (:func:`fp32_library`)."""

    def lay_out(self, layer):
        w = layer.dense().contiguous()
        self.shape = tuple(w.shape)
        self.onednn = w.device.type == "cpu" and fp32_library(self.shape)[0] == "onednn"
        return w

    def __call__(self, x2, bias):
        bias = None if bias is None else bias.float()
        if self.onednn:
            return onednn_linear(x2.float().contiguous(), self.weight, bias)
        return F.linear(x2.float(), self.weight, bias)


FP32_ROWS = (32, 128)  # a question's rows over cached modules, and a longer prefill's


def fp32_library(shape: tuple[int, int]) -> tuple[str, float]:
    """("onednn" or "mkl", MKL's time / oneDNN's) for weight ``shape`` here (docs/models.md). oneDNN must win by
    5 %, so noise does not flip it."""
    key = f"fp32 {shape}"
    if key not in _detected:
        if not onednn_linear_runs():
            _detected[key] = ("mkl", 1.0)
        else:
            ratio = _remembered(shape, _measure_fp32)
            _detected[key] = ("onednn" if ratio > 1.05 else "mkl", ratio)
    return _detected[key]


def _measure_fp32(shape: tuple[int, int]) -> float:
    ratios = [_time_gemm(torch.float32, n, shape, 2) / _time_gemm(torch.float32, n, shape, 2, onednn_linear)
              for n in FP32_ROWS]
    return sum(ratios) / len(ratios)


REMEMBER_FROM = 1 << 20  # weights this large are measured once per CPU, torch and thread count


def _remembered(shape: tuple[int, int], measure) -> float:
    """``measure(shape)``, kept in the cache for the next load (:data:`REMEMBER_FROM`)."""
    if shape[0] * shape[1] < REMEMBER_FROM:
        return measure(shape)
    import json

    from engine.devices import cache_folder
    from engine.files import save_whole
    from engine.owned import check_own_file, create_private

    path = cache_folder("packed") / "fp32-library.json"
    cpu = cpu_info("model name") or "unknown CPU"
    key = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}|{shape[0]}x{shape[1]}"
    try:
        check_own_file(path, "fp32 GEMM measurements")
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known.get(key), (int, float)):
        known[key] = measure(shape)
        try:
            save_whole(path, lambda tmp: (create_private(tmp), tmp.write_text(json.dumps(known, indent=1))))
        except OSError:  # a full or read-only disk: measured again next time
            pass
    return float(known[key])


def onednn_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` by oneDNN (torch's compiler's op)."""
    return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")


class Bf16Gemm(Gemm):
    """bf16 by oneDNN from a copy in its blocked layout, which ``F.linear`` rebuilds at every call (docs/models.md)."""

    def lay_out(self, layer):
        own = getattr(layer, "weight_bf16", None)
        if own is not None:
            return own
        w = layer.dense().to(torch.bfloat16)
        if not onednn_bf16(w.device):
            return w
        self.layout = "onednn-blocked"
        return torch.ops.mkldnn._reorder_linear_weight(w)

    def __call__(self, x2, bias):
        x2 = x2.to(torch.bfloat16)
        y = onednn_linear(x2.contiguous(), self.weight) if self.layout else F.linear(x2, self.weight)
        y = y.float()
        return y if bias is None else y.add_(bias.float())


def onednn_linear_runs() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_bf16(device: torch.device) -> bool:
    ops = torch.ops.mkldnn
    return (device.type == "cpu" and onednn_linear_runs() and hasattr(ops, "_reorder_linear_weight")
            and ops._is_mkldnn_bf16_supported())


class Int8Gemm(Gemm):
    """fbgemm / oneDNN dynamic quantization: int8 weights per row, activations quantized per call."""

    def lay_out(self, layer):
        w = layer.dense()
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12).double()
        q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        self.rows, self.cols = w.shape
        return torch.ops.quantized.linear_prepack(q, None)

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols + 8 * self.rows

    def __call__(self, x2, bias):
        y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.weight, True)
        return y if bias is None else y.add_(bias.float())


GEMMS = {"gemm-fp32": Fp32Gemm, "gemm-bf16": Bf16Gemm, "gemm-int8": Int8Gemm}
