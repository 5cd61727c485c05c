"""Weight precision: a loaded model's linear layers (the output matrix included) kept in fp32, bf16, int8 or
int4, weight-only; the activations stay in the run's compute dtype.

A decode step reads every weight once, so its time is the weights' bytes over the memory bandwidth the
matrix-vector kernel reaches. Measured on this project's CPU (2 threads, research notes "Speed floor"):
fp32 streams at ~19 GB/s, bf16 ~13 GB/s, and torch's int8 weight-only kernel
(``torch._weight_int8pack_mm``, bf16 activations) ~25 GB/s — per weight ~5x less time than fp32; its int4
kernel (``torch._weight_int4pack_mm_for_cpu``, groups of 32 with scale and zero point, the layout of a
GGUF's Q4 blocks) reads half of that again. Both kernels take bf16 activations (int8 with fp32 ones was
4x slower than fp32 itself here), so a quantized layer casts its input to bf16 and its output back.

Where the engine's own kernels are built (engine/model/kernels.py: AVX-512 VNNI, fp32 in and out, activations
quantized per token to 15-16 bits) int8 and int4 layers use them instead of torch's; ``gguf`` needs them.

* :data:`WEIGHTS` — the settings; ``fp32`` leaves the model as loaded (the exactness tests run there); ``gguf``
  keeps a GGUF model's matrices as the file holds them (:data:`FILE_KINDS`: Q5_0, Q4_K, Q8_0 and Q6_K blocks'
  values and scales, so the weights are exactly fp32's, which the loader dequantized from them) and any other
  layer in int8.
* :func:`quantize_weights` — replace every ``nn.Linear`` by a :class:`PackedLinear` of that precision
  (a tied output matrix gets its own packed copy; the embedding lookup keeps the float table), and
  every gated MLP (``down(act(gate(x)) * up(x))``, Llama / Qwen2 / Mistral ...) by a :class:`PackedMLP`
  whose gate and up matrices are one packed matrix: one kernel call and one cast fewer per layer.

``int4`` keeps the attention projections (q, k, v, o: 9 % of the 0.5B model's weights) in int8. Measured on
Qwen2.5-Coder-0.5B over the seven sample prompts, against fp32 weights: all-int4 first-token KL 0.083, with
the attention projections in int8 0.035 (the output matrix in int8 instead: 0.064), for ~1 ms per token.
So ``int4`` is the precision llama.cpp's mixed files use too: the bulk (MLP, output matrix) in 4 bits, the
small sensitive matrices in 8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import ModelError
from engine.model import WEIGHTS, kernels

INT4_GROUP = 32  # weights per scale and zero point (a GGUF Q4_K block's group)
# From this many tokens in one call (a prefill) a packed layer dequantizes its weight and runs fp32's GEMM: the
# packed kernels are built for matrix-vector products and lose to it on long inputs. Measured on the 0.5B
# model's 9728x896 gate+up matrix, 2 threads: fp32 / int8 kernel / int4 kernel 21 / 39 / 35 ms at 200 tokens,
# 177 / 430 / 315 ms at 2,000; dequantizing it costs 15 ms (int8) and 25 ms (int4). So the break-even is
# ~200 tokens for int8 and ~350 for int4 (bench/decode.py's TTFT column shows the effect).
DENSE_FROM = {"int8": 256, "int4": 512}  # by kernel: a GGUF's blocks by the kernel that multiplies them (FILE_KINDS)
# a GGUF file's blocks as the engine's kernels take them: ggml's name -> (the kernel, the dtype of its scales).
# Q5_0 and Q4_K are 5- and 4-bit values with a scale and zero point per 32 (the int4 kernel); Q8_0 and Q6_K are
# int8 (Q6_K's 6-bit values less 32) with a scale per 32 and 16 (the int8 kernel's grouped scales). fp16 holds
# Q5_0's and Q8_0's scales exactly (the file's own fp16); Q4_K's and Q6_K's are fp16 x a 6- or 8-bit sub-scale,
# which only float32 holds.
FILE_KINDS = {"Q5_0": ("int4", torch.float16), "Q4_K": ("int4", torch.float32), "Q8_0": ("int8", torch.float16),
              "Q6_K": ("int8", torch.float32)}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # int8 under int4 (see the module docstring)
SAVED_BUFFERS = ("qweight", "scales", "scales_zeros", "fifth", "weight_bf16")  # a PackedLinear's, by kind


class PackedLinear(torch.nn.Module):
    """A linear layer whose weight is stored as ``kind`` (bf16, int8 per output channel, int4 per group of
    :data:`INT4_GROUP`, or one of :data:`FILE_KINDS`: a GGUF file's blocks, ``codes``); ``forward`` takes and
    returns the caller's dtype."""

    def __init__(self, linear: torch.nn.Linear, kind: str, codes=None, saved: dict | None = None):
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, linear.in_features, linear.out_features
        self.nibbles: torch.Tensor | None = None  # int4 values outside torch's kernel's tiles (_pack_int4)
        # the engine's kernels (engine/model/kernels.py) where built and the shape tiles; else torch's
        self.kernel = FILE_KINDS[kind][0] if kind in FILE_KINDS else kind  # int8 or int4 (else unused)
        self.own = kernels.fits(self.kernel, self.out_features, self.in_features)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                        requires_grad=False)
        self.register_buffer("fifth", None)  # Q5_0: the values' fifth bits (kernels.pack_int4)
        if saved is not None:  # this layer's buffers as an earlier load packed them (engine/model/packed_cache.py)
            self._restore(saved)
            return
        if kind in FILE_KINDS:  # a GGUF's blocks as the file holds them: codes = gguf.FileBlocks
            if not self.own or codes is None:
                raise ModelError(f"{kind} weights are a GGUF file's blocks, multiplied by the engine's kernels: "
                                 f"{kernels.status()}; use --weights int8")
            dtype = FILE_KINDS[kind][1]
            if self.kernel == "int4":
                nibbles, sz, self.fifth = kernels.pack_int4(codes.values, codes.scale, codes.zero, dtype)
                self.register_buffer("qweight", nibbles)
                self.register_buffer("scales_zeros", sz)
            else:
                self.register_buffer("qweight", kernels.pack_int8(codes.values.to(torch.int8)))
                self.register_buffer("scales", kernels.pack_group_scales(codes.scale, dtype))
            return
        w = linear.weight.detach().float()  # [out, in]
        if kind == "bf16":
            self.register_buffer("weight_bf16", w.to(torch.bfloat16))
        elif kind == "int8":
            scale = (w.abs().amax(1) / 127).clamp(min=1e-12)  # [out]
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("qweight", kernels.pack_int8(q) if self.own else q)
            self.register_buffer("scales", scale if self.own else scale.to(torch.bfloat16))
        elif kind == "int4":
            self._pack_int4(w)
        else:
            raise ModelError(f"unknown weight precision '{kind}'; use one of {', '.join(WEIGHTS)}")

    def _restore(self, saved: dict) -> None:
        need = {"bf16": ("weight_bf16",), "int8": ("qweight", "scales")}.get(self.kernel, ("qweight", "scales_zeros"))
        missing = [n for n in need if n not in saved]
        if missing:
            raise KeyError(f"saved {self.kind} layer without {', '.join(missing)}")
        for name in SAVED_BUFFERS:
            if name in saved:
                self.register_buffer(name, saved[name])
        self.nibbles = saved.get("nibbles")

    def saved(self) -> dict:
        """The tensors :meth:`_restore` takes back (the bias comes from the model's own layer)."""
        found = {n: b for n, b in self.named_buffers(recurse=False) if n in SAVED_BUFFERS}
        return found if self.nibbles is None else {**found, "nibbles": self.nibbles}

    def _pack_int4(self, w: torch.Tensor) -> None:
        out, inp = w.shape
        groups = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(out, inp)
        if self.own:
            nibbles, sz, _ = kernels.pack_int4(q, scale.squeeze(-1), low.squeeze(-1))
            self.register_buffer("qweight", nibbles)
            self.register_buffer("scales_zeros", sz)
            return
        self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # dequantizing reads the kernel's tiles (_int4_values); where they are not laid out as that expects, the
        # values are kept again, two per byte in rows (never for the 0.5B model: every int4 matrix is 64-row tiled)
        tiled = out % 64 == 0 and torch.equal(_int4_values(self.qweight, out, inp), q)
        self.nibbles = None if tiled else (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        # the kernel dequantizes (q - 8) * scale + zero: zero = low + 8 * scale; [groups, out, 2]
        sz = torch.stack([scale.squeeze(-1), (low + 8 * scale).squeeze(-1)], -1).transpose(0, 1)
        self.register_buffer("scales_zeros", sz.contiguous().to(torch.bfloat16))

    def dense(self) -> torch.Tensor:
        """The weight as the kernel sees it, dequantized to fp32: [out, in]."""
        if self.own and self.kernel == "int8":
            q = kernels.unpack_int8(self.qweight, self.in_features).float()
            if self.scales.dim() == 1:
                return q.mul_(self.scales[:, None])
            scale = kernels.unpack_group_scales(self.scales)  # [out, groups]
            return q.reshape(*scale.shape, -1).mul_(scale[..., None]).reshape(q.shape)
        if self.own:
            q, scale, zero = kernels.unpack_int4(self.qweight, self.scales_zeros, self.fifth)
            groups = q.reshape(self.out_features, -1, INT4_GROUP).float()
            return groups.mul_(scale[..., None]).add_(zero[..., None]).reshape(self.out_features, self.in_features)
        if self.kind == "int8":
            return self.qweight.float().mul_(self.scales.float()[:, None])
        if self.kind == "int4":
            out, inp = self.out_features, self.in_features
            q = (_int4_values(self.qweight, out, inp) if self.nibbles is None
                 else torch.stack([self.nibbles & 15, self.nibbles >> 4], -1)).reshape(out, inp // INT4_GROUP, INT4_GROUP)
            sz = self.scales_zeros.float().transpose(0, 1)  # [out, groups, 2]
            return q.float().sub_(8).mul_(sz[..., :1]).add_(sz[..., 1:]).reshape(out, inp)
        return self.weight_bf16.float()

    def matmul(self, x2: torch.Tensor, bias: bool = False) -> torch.Tensor:
        """``x2 @ W.T`` (plus the bias when ``bias``) for ``x2`` [tokens, in]: the engine's kernel (fp32 in and
        out), torch's packed kernel (bf16 in and out), or from :data:`DENSE_FROM` tokens on, fp32's GEMM over the
        dequantized weight (fp32 out)."""
        b = self.bias if bias else None
        if x2.shape[0] >= DENSE_FROM.get(self.kernel, 1 << 62) and x2.device.type == "cpu":
            return F.linear(x2.float(), self.dense(), None if b is None else b.float())
        if self.own:
            x2 = x2.float().contiguous()
            b = None if b is None else b.float()
            if self.kernel == "int8":
                return kernels.ops().int8_matmul(x2, self.qweight, self.scales, b)
            return kernels.ops().int4_matmul(x2, self.qweight, self.scales_zeros, self.fifth, b)
        x2 = x2.to(torch.bfloat16)
        if self.kind == "int8":
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        elif self.kind == "int4":
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, INT4_GROUP, self.scales_zeros)
        else:
            y = F.linear(x2, self.weight_bf16)
        return y if b is None else y.float() + b.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        y = self.matmul(x.reshape(-1, self.in_features), bias=True).to(dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        extra = () if self.nibbles is None else (self.nibbles,)
        return sum(b.numel() * b.element_size() for b in (*self.buffers(), *extra))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weights={self.kind}"


def _int4_values(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The 4-bit values (0..15, uint8 [out, in]) of torch's CPU int4 packing (``_convert_weight_to_int4pack_for_cpu``
    with one inner tile) for ``out`` a multiple of 64: tiles of 64 output rows, each stored as [in, 32] bytes
    whose low nibble is row r and high nibble row r + 32 (checked against the values at every packing)."""
    tiles = packed.reshape(out // 64, inp, 32)
    return torch.cat([tiles & 15, tiles >> 4], -1).transpose(1, 2).reshape(out, inp)


class PackedMLP(torch.nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, its gate and up matrices packed as one ``[2 * inter, hidden]``
    matrix of ``kind``: one kernel call per layer for both (the activation and the product stay in fp32)."""

    GATED = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP", "OlmoMLP",
             "Olmo2MLP", "GraniteMLP", "SmolLM3MLP")  # classes whose forward is exactly the formula above

    def __init__(self, mlp: torch.nn.Module, kind: str, codes: dict | None = None, name: str = "",
                 saved: dict | None = None):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.inter = gate.out_features
        self.act_fn = mlp.act_fn
        self.down_proj = _packed(mlp.down_proj, f"{name}.down_proj", kind, codes, saved)
        if saved is not None:  # as an earlier load packed it: the matrix's shape and bias, not its weights
            both = torch.nn.Linear(gate.in_features, 2 * self.inter, bias=gate.bias is not None, device="meta")
            both.bias = None if gate.bias is None else torch.nn.Parameter(torch.cat([gate.bias, up.bias]))
            saved_kind, tensors = saved[f"{name}.gate_up"]
            self.gate_up = PackedLinear(both, saved_kind, saved=tensors)
            return
        both = torch.nn.Linear(gate.in_features, 2 * self.inter, bias=gate.bias is not None)
        with torch.no_grad():
            both.weight.copy_(torch.cat([gate.weight, up.weight]))
            if gate.bias is not None:
                both.bias.copy_(torch.cat([gate.bias, up.bias]))
        pair = [file_codes(codes, f"{name}.{n}", getattr(mlp, n)) for n in ("gate_proj", "up_proj")] \
            if kind == "gguf" else [None]
        if None not in pair and pair[0].kind == pair[1].kind:  # both as the file holds them: one matrix of codes
            self.gate_up = PackedLinear(both, pair[0].kind, _stacked(*pair))
        else:
            self.gate_up = PackedLinear(both, "int8" if kind == "gguf" else kind)

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


def kernel_label(model: torch.nn.Module) -> str:
    """Which kernels multiply ``model``'s packed weights (one line for the Model tab and ``run --json``)."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.kind != "bf16"]
    own = sum(m.own for m in packed)
    if not packed:
        return "torch's dense matrix products"
    if own == len(packed):
        return kernels.status()
    if own == 0:
        return kernels.status() if kernels.ops() is None else \
            f"torch's kernels (no layer has a multiple of {kernels.ROW_TILE} rows, as the engine's need)"
    return f"{kernels.status()} for {own} of {len(packed)} layers, torch's for the rest (rows not a multiple of " \
           f"{kernels.ROW_TILE})"


def layer_kind(name: str, kind: str) -> str:
    """The precision of linear layer ``name`` (its attribute name) under weights ``kind``."""
    return "int8" if kind == "int4" and name in ATTENTION_PROJECTIONS else kind


def file_codes(codes: dict | None, name: str, linear: torch.nn.Linear):
    """Linear layer ``name``'s blocks from its GGUF file (a gguf.FileBlocks), when the engine's kernels take them
    and they give exactly the layer's loaded weight (the file's dequantized values); else None."""
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
    """Linear layer ``name`` (its qualified name) packed for weights ``kind``, or as ``saved`` holds it."""
    if saved is not None:
        saved_kind, tensors = saved[name]
        return PackedLinear(linear, saved_kind, saved=tensors)
    if kind != "gguf":
        return PackedLinear(linear, layer_kind(name.rsplit(".", 1)[-1], kind))
    taken = file_codes(codes, name, linear)
    return PackedLinear(linear, "int8") if taken is None else PackedLinear(linear, taken.kind, taken)


def quantize_weights(model: torch.nn.Module, kind: str, codes: dict | None = None, saved: dict | None = None) -> int:
    """Replace every linear layer of ``model`` by a :class:`PackedLinear` of ``kind`` and every gated MLP by a
    :class:`PackedMLP` (in place); return the bytes its linear weights take now. ``fp32`` changes nothing. CPU
    only: the packed kernels are torch's CPU ones (a CUDA model keeps its weights, ModelError says so).

    ``gguf``: each layer as its GGUF file holds it where the engine's kernels take that (``codes``, by module name,
    from gguf.file_blocks: the file's blocks, values and scales exact), int8 elsewhere.

    ``saved`` (:func:`saved_layers` of an earlier load of the same model and weights, engine/model/packed_cache.py):
    each layer's packed tensors taken as they are, nothing computed; KeyError, the model unchanged, when a layer
    is missing from it."""
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
    # packed now: each layer replaced as it is packed (its float weight freed at once); from ``saved``: all at the
    # end, so that a layer missing there leaves the model as it was
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
    """Every packed layer of ``model`` by qualified name: (its kind, its tensors), what ``quantize_weights(...,
    saved=)`` takes back."""
    return {name: (m.kind, m.saved()) for name, m in model.named_modules() if isinstance(m, PackedLinear)}
