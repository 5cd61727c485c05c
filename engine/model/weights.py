"""Weight precision: linear layers kept in bf16, int8, int4 or as a GGUF file's blocks, one :class:`PackedLinear`
subclass per layout (:func:`pack_linear`); :func:`quantize_weights` packs a model. Measured: docs/models.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.errors import ModelError
from engine.model import WEIGHTS, KernelUse, kernels
from engine.model.kernels import Kernel

INT4_GROUP = 32  # weights per scale and zero point
DENSE_FROM = {"int8": 256, "int4": 512}  # tokens from which fp32's GEMM over dense() wins, by kernel (docs/models.md)
# a GGUF block type -> (its kernel, the dtype that holds its scales exactly): docs/models.md
FILE_KINDS = {"Q5_0": ("int4", torch.float16), "Q4_K": ("int4", torch.float32), "Q8_0": ("int8", torch.float16),
              "Q6_K": ("int8", torch.float32)}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # int8 under int4 (docs/models.md)


class PackedLinear(torch.nn.Module):
    """A linear layer with a packed weight, one subclass per layout; :func:`pack_linear` builds the one a scheme
    takes. ``saved=`` restores :meth:`saved` tensors."""

    kernel = ""  # "int8" / "int4": :data:`DENSE_FROM`'s key
    own = False  # multiplied by the engine's kernels
    native: Kernel | None = None  # its product in the C++ decoder
    BUFFERS: tuple[str, ...] = ()  # what a saved layer must hold
    OPTIONAL: tuple[str, ...] = ()
    nibbles: torch.Tensor | None = None  # saved beside the buffers (TorchInt4Linear)
    prefill = None  # engine/model/prefill.py's Gemm: many rows' product from a copy laid out for it

    def __init__(self, linear: torch.nn.Linear, kind: str, codes=None, saved: dict | None = None):
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                        requires_grad=False)
        if saved is None:
            self.pack(linear.weight.detach().float(), codes)  # [out, in]
            return
        missing = [n for n in self.BUFFERS if n not in saved]
        if missing:
            raise KeyError(f"saved {kind} layer without {', '.join(missing)}")
        for name in (*self.BUFFERS, *self.OPTIONAL):
            self.register_buffer(name, saved.get(name))

    def pack(self, w: torch.Tensor, codes) -> None:
        """Register this layout's buffers for weight ``w`` [out, in] (or the file's ``codes``)."""
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """The weight as the kernel sees it: fp32 [out, in]."""
        raise NotImplementedError

    def product(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x2 @ W.T + bias`` by this layout's kernel."""
        raise NotImplementedError

    def matmul(self, x2: torch.Tensor, bias: bool = False) -> torch.Tensor:
        """``x2 @ W.T`` (+ bias) for ``x2`` [tokens, in]: by the prefill GEMM where laid out, else from
        :data:`DENSE_FROM` tokens on by fp32's GEMM over :meth:`dense` (today's path)."""
        b = self.bias if bias else None
        if self.prefill is not None and x2.shape[0] >= self.prefill.start:
            return self.prefill(x2, b)
        if x2.shape[0] >= DENSE_FROM.get(self.kernel, 1 << 62) and x2.device.type == "cpu":
            return F.linear(x2.float(), self.dense(), _float(b))
        return self.product(x2, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        y = self.matmul(x.reshape(-1, self.in_features), bias=True).to(dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def saved(self) -> dict:
        """The tensors ``saved=`` takes back (the bias is the model's)."""
        found = dict(self.named_buffers(recurse=False))
        return found if self.nibbles is None else {**found, "nibbles": self.nibbles}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved().values())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weights={self.kind}"


class Bf16Linear(PackedLinear):
    """A bf16 copy of the weight; torch's bf16 GEMM."""

    BUFFERS = ("weight_bf16",)

    def pack(self, w, codes):
        self.register_buffer("weight_bf16", w.to(torch.bfloat16))

    def dense(self):
        return self.weight_bf16.float()

    def product(self, x2, bias):
        y = F.linear(x2.to(torch.bfloat16), self.weight_bf16)
        return y if bias is None else y.float() + bias.float()


class TorchInt8Linear(PackedLinear):
    """int8 per row, bf16 scales; torch's kernel (bf16 in and out)."""

    kernel = "int8"
    BUFFERS = ("qweight", "scales")

    def pack(self, w, codes):
        q, scale = _int8_rows(w)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(torch.bfloat16))

    def dense(self):
        return self.qweight.float().mul_(self.scales.float()[:, None])

    def product(self, x2, bias):
        y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight, self.scales)
        return y if bias is None else y.float() + bias.float()


class TorchInt4Linear(PackedLinear):
    """int4 per group of 32, bf16 scale and zero point; torch's kernel (bf16 in and out)."""

    kernel = "int4"
    BUFFERS = ("qweight", "scales_zeros")

    def __init__(self, linear, kind, codes=None, saved=None):
        super().__init__(linear, kind, codes, saved)
        if saved is not None:
            self.nibbles = saved.get("nibbles")

    def pack(self, w, codes):
        q, scale, low = _int4_groups(w)
        out, inp = w.shape
        self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # dense() reads whole row tiles (_int4_values); other packings keep the values twice
        tiled = out % int4_tile() == 0 and torch.equal(_int4_values(self.qweight, out, inp), q)
        self.nibbles = None if tiled else (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        # the kernel computes (q - 8) * scale + zero; [groups, out, 2]
        sz = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1)
        self.register_buffer("scales_zeros", sz.contiguous().to(torch.bfloat16))

    def dense(self):
        out, inp = self.out_features, self.in_features
        q = (_int4_values(self.qweight, out, inp) if self.nibbles is None
             else torch.stack([self.nibbles & 15, self.nibbles >> 4], -1))
        sz = self.scales_zeros.float().transpose(0, 1)  # [out, groups, 2]
        q = q.reshape(out, inp // INT4_GROUP, INT4_GROUP).float()
        return q.sub_(8).mul_(sz[..., :1]).add_(sz[..., 1:]).reshape(out, inp)

    def product(self, x2, bias):
        y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.qweight, INT4_GROUP, self.scales_zeros)
        return y if bias is None else y.float() + bias.float()


class Int8Linear(PackedLinear):
    """int8 per row, float32 scales; the engine's kernel (fp32 in and out)."""

    kernel, own, native = "int8", True, Kernel.INT8
    BUFFERS = ("qweight", "scales")

    def pack(self, w, codes):
        q, scale = _int8_rows(w)
        self.register_buffer("qweight", kernels.pack_int8(q))
        self.register_buffer("scales", scale)

    def dense(self):
        return kernels.unpack_int8(self.qweight, self.in_features).float().mul_(self.scales[:, None])

    def product(self, x2, bias):
        return kernels.ops().int8_matmul(x2.float().contiguous(), self.qweight, self.scales, _float(bias))


class FileInt8Linear(Int8Linear):
    """A GGUF's Q8_0 / Q6_K blocks: int8, a scale per row and group of 32 / 16."""

    def pack(self, w, codes):
        codes = _file_blocks(codes, self.kind)
        self.register_buffer("qweight", kernels.pack_int8(codes.values.to(torch.int8)))
        self.register_buffer("scales", kernels.pack_group_scales(codes.scale, FILE_KINDS[self.kind][1]))

    def dense(self):
        q = kernels.unpack_int8(self.qweight, self.in_features).float()
        scale = kernels.unpack_group_scales(self.scales)  # [out, groups]
        return q.reshape(*scale.shape, -1).mul_(scale[..., None]).reshape(q.shape)


class Int4Linear(PackedLinear):
    """int4 per group of 32, fp16 scale and zero point; the engine's kernel."""

    kernel, own, native = "int4", True, Kernel.INT4
    BUFFERS, OPTIONAL = ("qweight", "scales_zeros"), ("fifth",)

    def pack(self, w, codes):
        nibbles, sz, _ = kernels.pack_int4(*_int4_groups(w))
        self.register_buffer("qweight", nibbles)
        self.register_buffer("scales_zeros", sz)
        self.register_buffer("fifth", None)

    def dense(self):
        q, scale, zero = kernels.unpack_int4(self.qweight, self.scales_zeros, self.fifth)
        groups = q.reshape(self.out_features, -1, INT4_GROUP).float()
        return groups.mul_(scale[..., None]).add_(zero[..., None]).reshape(self.out_features, self.in_features)

    def product(self, x2, bias):
        x2 = x2.float().contiguous()
        return kernels.ops().int4_matmul(x2, self.qweight, self.scales_zeros, self.fifth, _float(bias))


class FileInt4Linear(Int4Linear):
    """A GGUF's Q5_0 / Q4_K blocks: 5- / 4-bit values, scale and zero point per 32."""

    def pack(self, w, codes):
        codes = _file_blocks(codes, self.kind)
        packed = kernels.pack_int4(codes.values, codes.scale, codes.zero, FILE_KINDS[self.kind][1])
        for name, tensor in zip(("qweight", "scales_zeros", "fifth"), packed):
            self.register_buffer(name, tensor)


ENGINE_SCHEMES = {"int8": Int8Linear, "int4": Int4Linear, "Q8_0": FileInt8Linear, "Q6_K": FileInt8Linear,
                  "Q5_0": FileInt4Linear, "Q4_K": FileInt4Linear}
TORCH_SCHEMES = {"bf16": Bf16Linear, "int8": TorchInt8Linear, "int4": TorchInt4Linear}


def scheme_class(kind: str, rows: int, cols: int) -> type[PackedLinear]:
    """The class keeping a ``rows`` x ``cols`` weight as ``kind``: the engine kernels' where they fit."""
    engine = ENGINE_SCHEMES.get(kind)
    if engine is not None and kernels.fits(engine.kernel, rows, cols):
        return engine
    if kind in TORCH_SCHEMES:
        return TORCH_SCHEMES[kind]
    if kind in FILE_KINDS:
        raise ModelError(f"{kind} weights are a GGUF file's blocks, multiplied by the engine's kernels: "
                         f"{kernels.status()}; use --weights int8")
    raise ModelError(f"unknown weight precision '{kind}'; use one of {', '.join(WEIGHTS)}")


def pack_linear(linear: torch.nn.Linear, kind: str, codes=None, saved: dict | None = None) -> PackedLinear:
    """``linear`` kept as ``kind`` by :func:`scheme_class`'s layout (``codes``: the GGUF file's blocks)."""
    return scheme_class(kind, linear.out_features, linear.in_features)(linear, kind, codes, saved)


def _file_blocks(codes, kind: str):
    if codes is None:
        raise ModelError(f"{kind} weights need the GGUF file's blocks (gguf.file_blocks); use --weights int8")
    return codes


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row) of ``w`` [out, in]."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q 0..15 [out, in], scale, zero [out, in / 32]): w ~ q * scale + zero."""
    out, inp = w.shape
    groups = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(out, inp)
    return q, scale.squeeze(-1), low.squeeze(-1)


def _int4_values(packed: torch.Tensor, out: int, inp: int, tile: int | None = None) -> torch.Tensor:
    """Values [out, in] of torch's CPU int4 packing: tiles of T rows (:func:`int4_tile`), [in, T/2] bytes each,
    rows r and r + T/2 in one byte."""
    tile = tile or int4_tile()
    tiles = packed.reshape(out // tile, inp, tile // 2)
    return torch.cat([tiles & 15, tiles >> 4], -1).transpose(1, 2).reshape(out, inp)


@functools.cache
def int4_tile() -> int:
    """Rows per tile of torch's CPU int4 packing on this CPU (its vector width decides it: 64 with AVX-512, 32 with
    AVX2), found by packing a probe once."""
    probe = torch.randint(0, 16, (64, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    for tile in (64, 32, 16, 8):
        if torch.equal(_int4_values(packed, 64, 64, tile), probe):
            return tile
    return 1 << 30  # an unknown layout: no matrix tiles, each keeps its values apart


class PackedMLP(torch.nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, gate and up packed as one [2 * inter, hidden] matrix."""

    GATED = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP", "OlmoMLP",
             "Olmo2MLP", "GraniteMLP", "SmolLM3MLP")  # classes whose forward is exactly the formula above

    def __init__(self, mlp: torch.nn.Module, kind: str, codes: dict | None = None, name: str = "",
                 saved: dict | None = None):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.inter = gate.out_features
        self.act_fn = mlp.act_fn
        self.down_proj = _packed(mlp.down_proj, f"{name}.down_proj", kind, codes, saved)
        if saved is not None:  # the matrix's shape and bias; its weights are saved
            both = torch.nn.Linear(gate.in_features, 2 * self.inter, bias=gate.bias is not None, device="meta")
            both.bias = None if gate.bias is None else torch.nn.Parameter(torch.cat([gate.bias, up.bias]))
            saved_kind, tensors = saved[f"{name}.gate_up"]
            self.gate_up = pack_linear(both, saved_kind, saved=tensors)
            return
        both = torch.nn.Linear(gate.in_features, 2 * self.inter, bias=gate.bias is not None)
        with torch.no_grad():
            both.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                both.bias.copy_(torch.cat([gate.bias, up.bias]))
        pair = [file_codes(codes, f"{name}.{n}", getattr(mlp, n)) for n in ("gate_proj", "up_proj")] \
            if kind == "gguf" else [None]
        if None not in pair and pair[0].kind == pair[1].kind:  # both as the file holds them: one matrix of codes
            self.gate_up = pack_linear(both, pair[0].kind, _stacked(*pair))
        else:
            self.gate_up = pack_linear(both, "int8" if kind == "gguf" else kind)

    @classmethod
    def fits(cls, module: torch.nn.Module) -> bool:
        return (type(module).__name__ in cls.GATED and hasattr(module, "act_fn")
                and all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj",
                                                                                         "down_proj"))
                and (module.gate_proj.bias is None) == (module.up_proj.bias is None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        gu = self.gate_up.matmul(x.reshape(-1, self.gate_up.in_features), bias=True).float()
        gate, up = gu.split(self.inter, -1)
        y = self.down_proj(self.act_fn(gate) * up)
        return y.to(dtype).reshape(*shape[:-1], self.down_proj.out_features)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down_proj.nbytes()


def _stacked(a, b):
    """Two layers' file blocks of one kind as one matrix's (gate over up)."""
    zero = None if a.zero is None else torch.cat([a.zero, b.zero])
    return type(a)(a.kind, torch.cat([a.values, b.values]), torch.cat([a.scale, b.scale]), zero)


def kernel_use(model: torch.nn.Module) -> KernelUse:
    """Which kernels multiply ``model``'s packed layers."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.kernel]
    return KernelUse(len(packed), sum(m.own for m in packed), bool(packed) and kernels.ops() is not None)


def layer_kind(name: str, kind: str) -> str:
    """The precision of layer ``name`` (attribute name) under weights ``kind``."""
    return "int8" if kind == "int4" and name in ATTENTION_PROJECTIONS else kind


def file_codes(codes: dict | None, name: str, linear: torch.nn.Linear):
    """Layer ``name``'s gguf.FileBlocks where the kernels take them and they give exactly its weight; else None."""
    found = (codes or {}).get(name)
    if (found is None or found.kind not in FILE_KINDS or found.values.shape != linear.weight.shape
            or not kernels.fits(FILE_KINDS[found.kind][0], linear.out_features, linear.in_features)):
        return None
    weight = found.values.float().reshape(*found.scale.shape, -1) * found.scale[..., None]  # as gguf-py computes
    if found.zero is not None:
        weight = weight + found.zero[..., None]
    return found if torch.equal(weight.reshape(found.values.shape), linear.weight.float()) else None


def _packed(linear: torch.nn.Linear, name: str, kind: str, codes: dict | None, saved: dict | None = None
            ) -> PackedLinear:
    """Layer ``name`` packed for weights ``kind``, or as ``saved`` holds it."""
    if saved is not None:
        saved_kind, tensors = saved[name]
        return pack_linear(linear, saved_kind, saved=tensors)
    if kind != "gguf":
        return pack_linear(linear, layer_kind(name.rsplit(".", 1)[-1], kind))
    taken = file_codes(codes, name, linear)
    return pack_linear(linear, "int8") if taken is None else pack_linear(linear, taken.kind, taken)


def quantize_weights(model: torch.nn.Module, kind: str, codes: dict | None = None, saved: dict | None = None) -> int:
    """Pack ``model``'s linear layers for ``kind`` in place (CPU only); their bytes now. ``gguf``: as ``codes``
    hold them where exact, else int8. ``saved`` (:func:`saved_layers`): KeyError, nothing changed, if one lacks."""
    if kind not in WEIGHTS:
        raise ModelError(f"unknown weight precision '{kind}'; use one of {', '.join(WEIGHTS)}")
    if kind == "fp32":
        return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                   if isinstance(m, torch.nn.Linear))
    if next(model.parameters()).device.type != "cpu":
        raise ModelError(f"{kind} weights use CPU kernels (the engine's or torch's); on a GPU use --dtype bfloat16 "
                         "instead")
    if kind == "gguf" and codes is None and saved is None:
        raise ModelError("gguf weights need the blocks of the model's GGUF file (engine.model.gguf.file_blocks); "
                         "load the model from a GGUF file, or use --weights int8")
    if kind == "int4":
        bad = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and layer_kind(n.rsplit(".", 1)[-1], kind) == "int4"
               and (m.in_features % INT4_GROUP or m.out_features % 16)]
        if bad:
            raise ModelError(f"int4 weights need every linear layer's input size to be a multiple of {INT4_GROUP} and "
                             f"its output size a multiple of 16 (torch's CPU kernel); {bad[0]} is not: use int8")
    # swapped as packed (frees each float weight); from ``saved`` at the end
    swaps = _packed_children(model, kind, codes, saved, swap=saved is None)
    if saved is not None:
        for parent, child_name, packed in swaps:
            setattr(parent, child_name, packed)
    return sum(packed.nbytes() for _, _, packed in swaps)


def _packed_children(module: torch.nn.Module, kind: str, codes: dict | None, saved: dict | None, swap: bool,
                     prefix: str = "") -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    swaps = []
    for child_name, child in list(module.named_children()):
        name = f"{prefix}{child_name}"
        if PackedMLP.fits(child):
            packed = PackedMLP(child, kind, codes, name, saved)
        elif isinstance(child, torch.nn.Linear):  # a tied output matrix gets its own copy
            packed = _packed(child, name, kind, codes, saved)
        else:
            swaps += _packed_children(child, kind, codes, saved, swap, f"{name}.")
            continue
        if swap:
            setattr(module, child_name, packed)
        swaps.append((module, child_name, packed))
    return swaps


def saved_layers(model: torch.nn.Module) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """name -> (kind, tensors) of ``model``'s packed layers: what ``quantize_weights(saved=)`` takes."""
    return {name: (m.kind, m.saved()) for name, m in model.named_modules() if isinstance(m, PackedLinear)}
