"""Loading models and tokenizers, offline: a packaged model, a GGUF file or a local transformers folder.

Anything else, a hub id included, is a :class:`ModelError`; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.devices import check_device
from engine.errors import ModelError, NonFiniteLogits
from engine.files import check_model_folder
from engine.model import KernelUse, PrefillChoice, default_model
from engine.model.chat import make_codec
from engine.model.gguf import ensure_gguf_file
from engine.model.packaged import PACKAGED, ensure_packaged, find_packaged, gguf_blocks
from engine.model.positions import TESTED_FAMILIES, check_supported, sliding_layers, sliding_window
from engine.model.sanity import CONFIG_FIX, check_config, check_shape, short, text_config
from engine.schema.layout import TextCodec


@dataclass
class LoadedModel:
    """A model ready for the engine, and the facts about it front ends show."""

    name: str
    model: object = field(repr=False)
    tokenizer: object = field(repr=False)
    codec: TextCodec = field(repr=False)
    device: str
    dtype: str
    n_params: int
    n_layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    max_positions: int
    eos_ids: tuple[int, ...]
    fingerprint: str
    architecture: str = ""  # transformers class, e.g. LlamaForCausalLM
    model_type: str = ""  # config.model_type, e.g. llama
    attention: str = "pml"  # "pml": the engine's attention in every layer; "own": the model's code
    sliding_window: int | None = None
    sliding_layers: int = 0
    weights: str = "fp32"  # how the linear layers' weights are kept (engine/model/weights.py)
    weight_bytes: int = 0
    weight_kernels: KernelUse = KernelUse()  # which kernels multiply them (weights.kernel_use)
    weights_from: str = "loaded"  # or "packed" at this load, or "saved" (packed_cache.py)
    prefill: PrefillChoice = PrefillChoice()  # what multiplies multi-token forwards' linears (prefill.py)

    @property
    def family_tested(self) -> bool:
        """Checked by tests/engine/test_families.py."""
        return self.model_type in TESTED_FAMILIES

    @property
    def position_encoding(self) -> str:
        """How positions reach the model's own attention: "alibi" or "rope"."""
        alibi = self.model_type == "mpt" or getattr(self.model.config, "alibi", False)
        return "alibi" if alibi else "rope"

    def decode_fallback(self) -> str:
        """Why decoding runs transformers' modules ("": the C++ decoder runs it)."""
        from engine.model import step

        return step.why_not(self.model, self.weights)

    def info(self) -> dict:
        fallback = self.decode_fallback()
        return {"model": self.name, "device": self.device, "dtype": self.dtype, "parameters": self.n_params,
                "layers": self.n_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "kv_bytes_per_token": self.kv_bytes_per_token, "max_positions": self.max_positions,
                "architecture": self.architecture, "model_type": self.model_type,
                "attention": self.attention, "position_encoding": self.position_encoding,
                "sliding_window": self.sliding_window, "sliding_layers": self.sliding_layers,
                "family_tested": self.family_tested, "weights": self.weights, "weight_bytes": self.weight_bytes,
                "weight_kernel_use": asdict(self.weight_kernels), "weights_from": self.weights_from,
                "decode_kernel": "modules" if fallback else "cpp", "decode_fallback": fallback,
                "family": TESTED_FAMILIES.get(self.model_type, self.model_type),
                "prefill_kernel": self.prefill.kernel, "prefill_kernel_why": self.prefill.why,
                "prefill_weight_bytes": self.prefill.nbytes}


def resolve_model_path(spec: str | None) -> tuple[str, str]:
    """(display name, local folder) of a model spec, converting it once."""
    if spec in (None, ""):
        spec = default_model()
    packaged = find_packaged(spec)
    if packaged is not None:
        return packaged.name, str(ensure_packaged(packaged.key))
    path = Path(spec).expanduser()
    if path.is_file():  # a GGUF file, converted once
        return path.stem, str(ensure_gguf_file(path))
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelError(f"model folder {path} has no config.json; point --model at a transformers model folder "
                             "(config.json + weights + tokenizer files)")
        check_model_folder(path)  # transformers reads its configs and tokenizer files whole
        return path.name, str(path)
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
        raise ModelError(f"model {spec} does not exist; check the path, or omit --model to use the default")
    raise ModelError(f"no model '{spec}': not a packaged model ({', '.join(PACKAGED)}), a model folder or a .gguf "
                     "file; the studio runs offline and never downloads from a hub: download the model folder "
                     "(config.json, weights, tokenizer) and give its path, or omit --model to use the default")


def load_tokenizer(spec: str | None = None):
    """(display name, tokenizer, codec) without loading weights."""
    from transformers import AutoTokenizer

    name, where = resolve_model_path(spec)
    try:
        config = _read_config(where)
        tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except ModelError:
        raise
    except Exception as err:  # transformers raises many kinds for a bad folder
        raise ModelError(f"cannot load the tokenizer of '{spec}': {short(err)}") from None
    return name, tok, make_codec(tok, _max_positions(config, tok), fingerprint=_fingerprint(name, where))


def load_config(spec: str | None = None):
    """The model's transformers config alone, its sizes checked."""
    _, where = resolve_model_path(spec)
    try:
        return _read_config(where)
    except ModelError:
        raise
    except Exception as err:
        raise ModelError(f"cannot read the config of '{spec}': {short(err)}") from None


def _read_config(where: str):
    """The config in ``where``, its sizes checked before transformers allocates by them."""
    from transformers import AutoConfig, PreTrainedConfig

    raw, _ = PreTrainedConfig.get_config_dict(where, local_files_only=True)
    source = f"{Path(where) / 'config.json'}" if Path(where).is_dir() else f"config.json of '{where}'"
    for part in (raw, raw.get("text_config")):
        if isinstance(part, dict):
            check_shape(part, source, CONFIG_FIX)
    return AutoConfig.from_pretrained(where, local_files_only=True)


def load_model(spec: str | None = None, device: str = "cpu", dtype: str = "float32", tokenizer=None,
               codec: TextCodec | None = None, weights: str = "fp32") -> LoadedModel:
    """A causal LM on ``device``, activations in ``dtype``, linear weights kept as ``weights`` (weights.py).
    ``tokenizer`` and ``codec`` from :func:`load_tokenizer` of the same spec are reused."""
    import torch
    from transformers import AutoTokenizer

    check_device(device)
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelError(f"unknown dtype '{dtype}'; use float32, float16 or bfloat16")
    name, where = resolve_model_path(spec)
    config = load_config(spec)
    check_config(config, where, torch_dtype, device)
    try:
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(where, local_files_only=True)
        model = _from_pretrained(where, torch_dtype)
    except ModelError:
        raise
    except Exception as err:
        raise ModelError(f"cannot load model '{spec}': {short(err)}") from None
    model.to(device).eval()
    from engine.model import prefill
    from engine.model.packed_cache import pack  # imported (with torch) when a model loads
    from engine.model.weights import kernel_use

    weight_bytes, weights_from = pack(model, weights, name, _fingerprint(name, where, dtype),
                                     lambda: gguf_blocks(spec, name))
    kernels = kernel_use(model)
    choice = prefill.use(model, prefill.asked())
    # module KV depends on the weights and on the kernels that multiply them (their roundings differ)
    precision = dtype if weights == "fp32" else f"{dtype}+{weights}+{kernels}+{choice.kernel}" + \
        (f"+{choice.layout}" if choice.layout else "")
    lm = wrap_model(model, tok, name, device=device, dtype=dtype, fingerprint=_fingerprint(name, where, precision),
                    weights=weights, weight_bytes=weight_bytes, weight_kernels=kernels, prefill_choice=choice,
                    max_positions=_max_positions(config, tok), codec_fingerprint=_fingerprint(name, where),
                    codec=codec if tokenizer is not None else None)
    lm.weights_from = weights_from
    return lm


# every field a LoadedModel records about its load
def wrap_model(model, tokenizer, name: str, device: str = "cpu", dtype: str = "float32", fingerprint: str = "",
               max_positions: int | None = None, codec_fingerprint: str | None = None,
               codec: TextCodec | None = None, weights: str = "fp32", weight_bytes: int = 0,
               weight_kernels: KernelUse = KernelUse(), prefill_choice: PrefillChoice | None = None) -> LoadedModel:
    """A LoadedModel around an in-memory model (tests' tiny random ones); ``prefill_choice``: prefill.use's."""
    import torch

    from engine.model import prefill
    from engine.model.attend import use_pml_attention

    config = model.config
    check_supported(config, type(model))
    attention = use_pml_attention(model)
    n_layers, kv_heads, head_dim = kv_shape(config)
    elt = torch.tensor([], dtype=model.dtype).element_size()
    gen_cfg = getattr(model, "generation_config", None)
    eos = gen_cfg.eos_token_id if gen_cfg is not None else None
    eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids += (tokenizer.eos_token_id,)
    fp = fingerprint or hashlib.sha256(f"{name}|{id(model)}".encode()).hexdigest()[:16]
    # the codec's fingerprint must equal load_tokenizer()'s, so layouts made before and after the
    # model loads give the same cache keys
    codec = codec or make_codec(tokenizer, max_positions or _max_positions(config, tokenizer),
                                fingerprint=codec_fingerprint or fp)
    lm = LoadedModel(name=name, model=model, tokenizer=tokenizer, codec=codec, device=device, dtype=dtype,
                     n_params=parameter_count(model), n_layers=n_layers, kv_heads=kv_heads,
                     head_dim=head_dim, kv_bytes_per_token=kv_bytes_per_token(config, elt),
                     max_positions=codec.max_positions, eos_ids=eos_ids, fingerprint=fp,
                     architecture=type(model).__name__, model_type=config.model_type, attention=attention,
                     sliding_window=sliding_window(config), sliding_layers=sliding_layers(config),
                     weights=weights, weight_bytes=weight_bytes, weight_kernels=weight_kernels,
                     prefill=prefill_choice or prefill.use(model, prefill.asked()))
    _warm_up(lm)
    return lm


def parameter_count(model) -> int:
    """The model's parameters as its checkpoint counts them, packed linear layers (buffers) and ties included."""
    from engine.model.weights import PackedLinear

    total = sum(p.numel() for p in model.parameters())
    packed = {id(m): m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if id(head) in packed and getattr(text_config(model.config), "tie_word_embeddings", False):
        packed.pop(id(head))
    return total + sum(packed.values())


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config alone."""
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if cfg.model_type == "falcon":
        # transformers caches the new decoder architecture's grouped KV heads broadcast
        kv = heads if cfg.new_decoder_architecture or not cfg.multi_query else 1
    else:
        kv = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers, kv, head_dim


def kv_bytes_per_token(config, bytes_per_element: int) -> int:
    """KV bytes per token from a config alone."""
    layers, kv, head_dim = kv_shape(config)
    return 2 * layers * kv * head_dim * bytes_per_element


def _from_pretrained(where: str, torch_dtype):
    """Load with SDPA attention, or eager for families that refuse SDPA."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, attn_implementation="sdpa",
                                                    local_files_only=True)
    except ValueError as err:
        if "scaled_dot_product_attention" not in str(err):
            raise
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, attn_implementation="eager",
                                                    local_files_only=True)


def _max_positions(config, tokenizer) -> int:
    text_cfg = text_config(config)
    n = getattr(text_cfg, "max_position_embeddings", None)
    if not n:
        n = getattr(tokenizer, "model_max_length", 2048)
    return int(min(n, 1_000_000))


def _fingerprint(name: str, where: str, dtype: str = "") -> str:
    h = hashlib.sha256(f"{name}|{where}|{dtype}".encode())
    cfg = Path(where) / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
        for w in sorted(Path(where).glob("*.safetensors")):
            st = w.stat()
            h.update(f"{w.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def _warm_up(lm: LoadedModel) -> None:
    """One tiny forward, so that the first measured run pays no one-time costs; NaN logits refuse the model."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([[lm.codec.placeholder] * 4], device=lm.device)
        logits = lm.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(f"the model {lm.name} produced non-finite logits (NaN or inf) on a 4-token test "
                                  "input at load: its weights or rope settings are broken (a NaN in the checkpoint, "
                                  "a rope_theta or rope_scaling that overflows); check its config.json and weights")


