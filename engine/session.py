"""Engine: the one object the CLI, the studio and library users hold.

It loads the model once (lazily, never at import), keeps one ModuleStore per storage device,
remembers encoded schemas (re-encoding only when schema, model, mode or storage changed) and
serialises runs so that two callers never time each other's work.

    from engine import Engine
    eng = Engine()                                  # default model, CPU storage, prefixed mode
    result = eng.compare(schema_xml, prompt_xml, max_new_tokens=16)
    print(result.to_json())
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from .compress import Compression
from .encode import DTYPES, MODES, EncodedSchema, ProgressFn, count_units, encode_schema
from .errors import EngineError, StorageError
from .layout import Layout, TextCodec, layout as make_layout
from .models import LoadedModel, cache_root, check_device, load_model, load_tokenizer
from .plan import PromptPlan, plan_prompt
from .pml import parse_prompt, parse_schema
from .runner import Comparison, Sampling, TokenFn, compare as run_compare, used_keys
from .store import DiskStore, ModuleStore, default_budget


@dataclass(frozen=True)
class EncodeResult:
    encoded: EncodedSchema
    reused: bool  # True when nothing had to be computed
    store_bytes: int
    bytes_by_module: dict[str, int]


class Engine:
    """Model + module stores + encoded schemas.

    ``storage_dtype`` (float32 | float16 | bfloat16) and ``compression`` (retention < 1) shrink
    stored modules; ``budget_bytes`` caps the module memory of each store (default: half the
    available memory); ``persist`` saves entries under ``module_dir`` (default
    ``$PML_STUDIO_MODULES``, else ``$PML_STUDIO_CACHE/modules``) so a restart encodes nothing that is already there.
    """

    def __init__(self, model: str | None = None, storage: str = "cpu", mode: str = "prefixed",
                 device: str | None = None, dtype: str = "float32", storage_dtype: str = "float32",
                 compression: Compression | None = None, budget_bytes: int | None = None, persist: bool = True,
                 module_dir: str | Path | None = None):
        if mode not in MODES:
            raise EngineError(f"unknown encoding mode '{mode}'; use one of {', '.join(MODES)}")
        if storage_dtype not in DTYPES:
            raise EngineError(f"unknown storage dtype '{storage_dtype}'; use one of {', '.join(DTYPES)}")
        check_device(storage)
        self.model_spec = model
        self.storage = storage
        self.mode = mode
        self.device = device or ("cuda" if storage.startswith("cuda") else "cpu")
        check_device(self.device)
        self.dtype = dtype
        self.storage_dtype = storage_dtype
        self.compression = compression or Compression()
        self.budget_bytes = budget_bytes
        self.module_dir = Path(module_dir or os.environ.get("PML_STUDIO_MODULES") or cache_root() / "modules")
        self.persist = persist
        self._lm: LoadedModel | None = None
        self._codec: TextCodec | None = None
        self._stores: dict[str, ModuleStore] = {}
        self._encoded: dict[tuple, EncodedSchema] = {}
        self._load_lock = threading.Lock()
        self.run_lock = threading.RLock()

    @classmethod
    def from_loaded(cls, lm: LoadedModel, storage: str = "cpu", mode: str = "prefixed", persist: bool = False,
                    **options) -> "Engine":
        """An Engine around an already loaded model (tests, notebooks); no persistence unless asked."""
        eng = cls(model=lm.name, storage=storage, mode=mode, device=lm.device, dtype=lm.dtype, persist=persist,
                  **options)
        eng._lm, eng._codec = lm, lm.codec
        return eng

    # -- model --------------------------------------------------------------------------------

    @property
    def lm(self) -> LoadedModel:
        """The loaded model (loaded on first use)."""
        with self._load_lock:
            if self._lm is None:
                self._lm = load_model(self.model_spec, device=self.device, dtype=self.dtype)
                self._codec = self._lm.codec
            return self._lm

    @property
    def loaded(self) -> bool:
        return self._lm is not None

    @property
    def codec(self) -> TextCodec:
        """Tokenizer + chat template; loads only the tokenizer when the model is not loaded yet."""
        if self._codec is None:
            with self._load_lock:
                if self._codec is None:
                    self._codec = load_tokenizer(self.model_spec)[2]
        return self._codec

    def info(self) -> dict:
        return self.lm.info()

    def store(self, storage: str | None = None) -> ModuleStore:
        """The module store for ``storage`` (created on first use, with this engine's budget and disk)."""
        storage = storage or self.storage
        if storage not in self._stores:
            check_device(storage)
            budget = self.budget_bytes if self.budget_bytes is not None else default_budget(storage)
            disk = DiskStore(self.module_dir) if self.persist else None
            self._stores[storage] = ModuleStore(storage, budget_bytes=budget, disk=disk)
        return self._stores[storage]

    # -- documents ----------------------------------------------------------------------------

    def layout(self, schema_text: str, source: str = "<schema>") -> Layout:
        """Parse and lay out a schema (raises PMLError / ContextLengthError)."""
        return make_layout(parse_schema(schema_text, source), self.codec)

    def plan(self, layout: Layout, prompt_text: str, source: str = "<prompt>", max_new_tokens: int = 0) -> PromptPlan:
        return plan_prompt(layout, parse_prompt(prompt_text, source), max_new_tokens)

    # -- encoding and runs --------------------------------------------------------------------

    def encode(self, layout: Layout, mode: str | None = None, storage: str | None = None,
               progress: ProgressFn | None = None, storage_dtype: str | None = None,
               compression: Compression | None = None) -> EncodeResult:
        """Encode a schema's modules into the store for ``storage`` (skipped for what is already there)."""
        mode = mode or self.mode
        storage = storage or self.storage
        storage_dtype = storage_dtype or self.storage_dtype
        compression = compression or self.compression
        store = self.store(storage)  # checks the device; encode_schema checks mode, dtype and compression
        key = (layout.fingerprint, mode, storage, storage_dtype, compression.key())
        with self.run_lock:
            enc = self._encoded.get(key)
            if enc is not None and all(k in store for k in enc.keys()):
                if progress:
                    total = count_units(layout)
                    progress(total, total, "already encoded")
                enc = replace(enc, units=tuple(replace(u, source="memory", ms=0.0) for u in enc.units), encode_ms=0.0)
                reused = True
            else:
                enc = encode_schema(self.lm.model, layout, store, mode, self.lm.fingerprint, progress,
                                    dtype=storage_dtype, compression=compression)
                self._encoded[key] = enc
                reused = all(u.reused for u in enc.units)
        return EncodeResult(encoded=enc, reused=reused, store_bytes=enc.nbytes(store),
                            bytes_by_module=enc.bytes_by_module(store))

    def compare(self, schema_text: str, prompt_text: str, max_new_tokens: int = 32, mode: str | None = None,
                storage: str | None = None, sampling: Sampling | None = None, on_token: TokenFn | None = None,
                schema_source: str = "<schema>", prompt_source: str = "<prompt>",
                progress: ProgressFn | None = None, storage_dtype: str | None = None,
                compression: Compression | None = None) -> Comparison:
        """Encode (if needed), then run baseline and cached on the prompt."""
        sampling = sampling or Sampling(max_new_tokens=max_new_tokens)
        if sampling.max_new_tokens < 1:
            raise EngineError("max new tokens must be at least 1")
        lay = self.layout(schema_text, schema_source)
        plan = self.plan(lay, prompt_text, prompt_source, sampling.max_new_tokens)
        storage = storage or self.storage
        store = self.store(storage)
        with self.run_lock:
            enc = self.encode(lay, mode, storage, progress, storage_dtype, compression).encoded
            store.check_fits(used_keys(plan, enc), f"prompt {prompt_source}")
            try:
                result = run_compare(self.lm, plan, enc, store, sampling, on_token)
            except KeyError:
                # an entry vanished between encoding and the run (evicted without a disk copy, or a
                # corrupted file): encode again, once, and run
                self._encoded.clear()
                enc = self.encode(lay, mode, storage, progress, storage_dtype, compression).encoded
                result = run_compare(self.lm, plan, enc, store, sampling, on_token)
        return replace(result, encode=encode_summary(enc))


def encode_summary(enc: EncodedSchema) -> dict:
    """JSON summary of how a schema's units were obtained: counts by source, and each unit's time."""
    by_source = {src: sum(u.source == src for u in enc.units) for src in ("memory", "disk", "encoded")}
    return {"ms": round(enc.encode_ms, 3), "units": len(enc.units), **by_source,
            "detail": [{"unit": u.name, "kind": u.kind, "tokens": u.tokens, "ms": round(u.ms, 3), "source": u.source}
                       for u in enc.units]}


def gpu_status() -> tuple[bool, str]:
    """(available, explanation) for the GPU storage option."""
    try:
        check_device("cuda")
    except StorageError as err:
        return False, str(err)
    import torch
    return True, f"CUDA device: {torch.cuda.get_device_name(0)}"
