"""A decode step in one C++ call (csrc/decode_step.cpp) for Llama and Qwen2 models on packed weights, float32,
CPU, full attention; the arms' decode steps (engine/run/decode.py) call it when their attention spec is plain.
``PML_STUDIO_STEP=0`` turns it off (docs/models.md)."""

from __future__ import annotations

import os
import weakref

import torch

from engine.model import kernels
from engine.model.kernels import Kernel
from engine.model.weights import PackedLinear, PackedMLP

LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")  # classes whose forward is the C++ file's formula
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm")  # w * (x * rsqrt(mean(x^2) + eps))
PACKED = ("int8", "int4", "gguf")  # --weights settings that run the engine's kernels

# model -> (weights setting, decoder or None, why not)
_made: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


class StepDecoder:
    """The C++ decoder over a model's weights."""

    def __init__(self, model: torch.nn.Module):
        ops = kernels.ops()
        inner, cfg = model.model, model.config
        attn = inner.layers[0].self_attn
        self.rotary = inner.rotary_emb  # not the model: _made's weak key must be able to die
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        norm = inner.norm
        self.native = ops.Decoder(inner.embed_tokens.weight.detach(), self.heads, self.kv_heads, self.head_dim,
                                  float(attn.scaling), float(norm.variance_epsilon), norm.weight.detach(),
                                  _linear(ops, model.lm_head))
        for layer in inner.layers:
            qkv, o, gate_up, down = layer_products(layer)
            self.native.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                                  [_linear(ops, p) for p in qkv], _linear(ops, o), _linear(ops, gate_up),
                                  _linear(ops, down))
        self._probe = torch.zeros(1, dtype=torch.float32)

    def __call__(self, ids: list[int], positions: list[int], kv: torch.Tensor, starts: torch.Tensor,
                 lengths: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of one token per row, its K and V written into the pool ``kv`` at slot
        ``starts[row] + lengths[row]`` (``visible``: [rows, keys] bool, the keys each row reads)."""
        pos = torch.tensor(positions, dtype=torch.long)[:, None]
        cos, sin = self.rotary(self._probe, pos)  # [rows, 1, head_dim]
        return self.native.step(torch.tensor(ids, dtype=torch.long), cos[:, 0].contiguous(), sin[:, 0].contiguous(),
                                kv, starts, lengths, visible)


def layer_products(layer) -> tuple[list[dict], dict, dict, dict]:
    """A layer's weight products as the C++ decoder runs them: (q / k / v stacked, o, gate and up, down)."""
    a, mlp = layer.self_attn, layer.mlp
    gate_up = _parts(mlp.gate_up) if isinstance(mlp, PackedMLP) else _stacked([mlp.gate_proj, mlp.up_proj])[0]
    return _stacked([a.q_proj, a.k_proj, a.v_proj]), _parts(a.o_proj), gate_up, _parts(mlp.down_proj)


def decoder(model: torch.nn.Module, weights: str) -> StepDecoder | None:
    """``model``'s C++ decoder (made once), or None where it does not apply (:func:`why_not`)."""
    made = _made.get(model)
    if made is None or made[0] != weights:
        reason = _reason(model, weights)
        made = _made[model] = (weights, None if reason else StepDecoder(model), reason)
    return made[1]


def why_not(model: torch.nn.Module, weights: str) -> str:
    """Why the C++ step is off ("" if on)."""
    decoder(model, weights)
    return _made[model][2]


def _reason(model: torch.nn.Module, weights: str) -> str:
    if os.environ.get("PML_STUDIO_STEP", "1") == "0":
        return "turned off (PML_STUDIO_STEP=0)"
    if weights not in PACKED:
        return f"{weights} weights decode through transformers' modules (the exactness reference)"
    if kernels.ops() is None:
        return kernels.status()
    inner, cfg = getattr(model, "model", None), model.config
    layers = getattr(inner, "layers", None)
    if layers is None or not all(type(layer).__name__ in LAYERS for layer in layers):
        return f"'{cfg.model_type}' layers are not the Llama / Qwen2 formula the C++ decoder computes"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "the C++ decoder runs float32 models on CPU"
    if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"} \
            or getattr(cfg, "use_sliding_window", False):
        return "a layer attends through a sliding window"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"the MLP's activation is {getattr(cfg, 'hidden_act', '?')}, not silu"
    if not isinstance(getattr(inner, "embed_tokens", None), torch.nn.Embedding) \
            or type(inner.norm).__name__ not in NORMS:
        return "the embeddings or the final norm are not the formula's"
    eps = inner.norm.variance_epsilon
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        if any(type(n).__name__ not in NORMS or n.variance_epsilon != eps
               for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return "a layer's norm differs from the final norm's"
        if hasattr(a, "q_norm") or a.head_dim != inner.layers[0].self_attn.head_dim:
            return "the attention normalizes queries and keys"
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
        linears += [mlp.gate_up, mlp.down_proj] if isinstance(mlp, PackedMLP) else \
            [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(_kind(m) is not None for m in linears):
            return "a layer's weights are not on the engine's kernels or float32"
    if _kind(model.lm_head) is None:
        return "the output matrix is not on the engine's kernels or float32"
    return ""


def _kind(m) -> Kernel | None:
    """The C++ decoder's product for linear layer ``m``, None where it has none."""
    if isinstance(m, PackedLinear):
        return m.native
    if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32:
        return Kernel.DENSE
    return None


def _parts(m) -> dict:
    """The tensors the C++ decoder reads of linear layer ``m``, by argument name."""
    kind = _kind(m)
    bias = None if m.bias is None else m.bias.detach().float()
    if kind == Kernel.DENSE:
        return {"kind": kind, "w": m.weight.detach(), "bias": bias}
    if kind == Kernel.INT8:
        return {"kind": kind, "w": m.qweight, "scale": m.scales, "bias": bias}
    return {"kind": kind, "w": m.qweight, "scale": m.scales_zeros, "fifth": m.fifth, "bias": bias}


def _linear(ops, m):
    return ops.Linear(**(m if isinstance(m, dict) else _parts(m)))


def _stacked(mods: list) -> list[dict]:
    """``mods``' parts, neighbours of the same packing stacked into one matrix (outputs side by side)."""
    out: list[tuple[dict, int]] = []  # (parts, output rows)
    for m in mods:
        p, rows = _parts(m), m.out_features
        if out and _joins(out[-1][0], p):
            prev, before = out[-1]
            for name in ("w", "scale", "fifth"):
                if p.get(name) is not None:
                    prev[name] = torch.cat([prev[name], p[name]])
            if prev["bias"] is not None or p["bias"] is not None:
                prev["bias"] = torch.cat([torch.zeros(before) if prev["bias"] is None else prev["bias"],
                                          torch.zeros(rows) if p["bias"] is None else p["bias"]])
            out[-1] = (prev, before + rows)
        else:
            out.append((p, rows))
    return [p for p, _ in out]


def _joins(a: dict, b: dict) -> bool:
    """Whether two layers' packings stack along their output rows."""
    def same(x, y):
        return (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and x.shape[1:] == y.shape[1:]))
    return a["kind"] == b["kind"] and all(same(a.get(n), b.get(n)) for n in ("w", "scale", "fifth"))
