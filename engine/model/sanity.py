"""Sanity ceilings of a model's shape: a damaged or crafted config (``llama.block_count = 4000000000``) is refused,
naming the field, before transformers allocates by it. Imports no torch or transformers at import time.
"""

from __future__ import annotations

from typing import Mapping

from engine.devices import available_bytes
from engine.errors import ModelError
from engine.model.positions import check_supported

# (config keys in every family's spelling, lowest, highest, what they count): far above any released model's
SHAPE_LIMITS: tuple[tuple[tuple[str, ...], int, int, str], ...] = (
    (("num_hidden_layers", "n_layer", "n_layers", "num_layers"), 1, 10_000, "number of layers"),
    (("hidden_size", "n_embd", "d_model"), 1, 1 << 18, "hidden size"),
    (("intermediate_size", "moe_intermediate_size", "d_ff", "ffn_hidden_size"), 1, 1 << 20, "feed-forward width"),
    (("num_attention_heads", "n_head", "n_heads", "num_heads", "num_key_value_heads", "num_kv_heads"), 1, 1 << 14,
     "number of attention heads"),
    (("head_dim", "kv_channels"), 1, 1 << 14, "head dimension"),
    (("vocab_size", "padded_vocab_size"), 1, 1 << 24, "vocabulary size"),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 0, 1 << 16, "number of experts"),
)
SHAPE_KEYS = tuple(key for keys, *_ in SHAPE_LIMITS for key in keys)
# sizes a config may state per layer (LFM2's KV heads, Gemma 3n's feed-forward widths)
PER_LAYER = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def check_shape(values: Mapping, source: str, fix: str, fields: Mapping[str, str] | None = None) -> None:
    """ModelError naming ``source``'s field (as ``fields`` spells it) and ``fix`` unless every size in ``values``
    is whole and within its limits."""
    high_layers = SHAPE_LIMITS[0][2]
    for keys, low, high, what in SHAPE_LIMITS:
        for key in keys:
            value = values.get(key)
            if value is None:
                continue
            per_layer = key in PER_LAYER and isinstance(value, (list, tuple)) and len(value) <= high_layers
            each, lowest = (value, 0) if per_layer else ([value], low)
            if not all(_whole(v) and lowest <= v <= high for v in each):
                field = (fields or {}).get(key, key)
                raise ModelError(f"{source}: {field} is {_shown(value)}, but the {what} of a model is a whole number "
                                 f"from {low} to {high:,}; the file is damaged or was made to exhaust memory, so "
                                 f"nothing was loaded. {fix}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    if _whole(value):
        return f"{value:,}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


CONFIG_FIX = "Fix the value in the model's config.json, or download the model again from its publisher."


def check_config(config, where: str, torch_dtype, device: str, fix: str = CONFIG_FIX) -> None:
    """Before a model is built: a family the engine runs, sane sizes, weights that fit."""
    check_supported(config, _causal_lm_class(config))
    text_cfg = text_config(config)
    check_shape({key: getattr(text_cfg, key, None) for key in SHAPE_KEYS}, f"model '{where}'", fix)
    _check_fits(config, where, torch_dtype, device)


def _check_fits(config, where: str, torch_dtype, device: str) -> None:
    """ModelError when the weights cannot fit in the available memory."""
    import torch

    text_cfg = text_config(config)
    try:
        h, n_layers = text_cfg.hidden_size, text_cfg.num_hidden_layers
        inter = getattr(text_cfg, "intermediate_size", None) or 4 * h
        inter = max(inter, default=4 * h) if isinstance(inter, (list, tuple)) else inter  # one per layer (Gemma 3n)
        vocab = text_cfg.vocab_size
    except AttributeError:
        return
    experts = max((getattr(text_cfg, k, None) or 0 for k in ("num_local_experts", "num_experts", "n_routed_experts")))
    ffn = 3 * h * (getattr(text_cfg, "moe_intermediate_size", None) or inter) * experts if experts > 1 else 3 * h * inter
    params = n_layers * (4 * h * h + ffn) + 2 * vocab * h
    need = params * torch.tensor([], dtype=torch_dtype).element_size()
    avail = available_bytes(device)
    if avail is not None and need > 0.9 * avail:
        raise ModelError(f"model '{where}' needs about {need / 2**30:.1f} GiB for its weights in "
                         f"{str(torch_dtype).replace('torch.', '')}, but only {avail / 2**30:.1f} GiB is available on "
                         f"{device}; pick a smaller model or a smaller dtype (float16/bfloat16)")


def short(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


def _causal_lm_class(config):
    """AutoModelForCausalLM's class for ``config``, or None."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
