"""Engine: the one object the CLI, the studio and library users hold.

It loads the model once (lazily), keeps a ModuleStore and a PrefixCache per storage device (docs/arms.md), remembers
encoded schemas, and drives every run through one scheduler (engine/run/scheduler.py): runs of many callers decode
together, and one thread computes at a time.

    eng = Engine()
    result = eng.compare(schema_xml, prompt_xml, Sampling(max_new_tokens=16))
    prepared = eng.prepare(schema_xml, prompt_xml)  # parsed and tokenized once, run as often as asked
    eng.run(prepared, Sampling(max_new_tokens=16), config=eng.config.with_(mode="isolated"))
    for event in eng.events(schema_xml, prompt_xml):  # as it goes; closing the generator stops the run
        ...
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Generator

import torch

from engine.arms.compare import Comparison, comparing
from engine.arms.prefix import warm_prefix
from engine.arms.registry import REGISTRY, ArmContext, Reads, Sampling
from engine.cache.assemble import fetch_entries, used_keys
from engine.cache.encode import EncodedSchema, count_units, encoding
from engine.cache.prefix import PrefixCache, schema_order_prompt
from engine.cache.store import DiskStore, ModuleStore, default_budget
from engine.config import RunConfig
from engine.devices import check_device
from engine.errors import EngineError, MissingEntry, StorageError
from engine.kv import KVPool, stored_bytes_per_token
from engine.model.load import LoadedModel, kv_shape, load_config, load_model, load_tokenizer
from engine.schema.layout import Layout, TextCodec
from engine.schema.layout import layout as make_layout
from engine.schema.plan import PromptPlan, check_room, plan_prompt
from engine.run.events import Done, Event, UnitEncoded, Warmed, Warming, finish
from engine.run.pools import make_pool
from engine.run.scheduler import Scheduler
from engine.schema.pml import parse_prompt, parse_schema


# Encoded schemas remembered; a forgotten one is looked up in the store again (a server compiles one per request).
ENCODED_KEPT = 256


@dataclass(frozen=True)
class EncodeResult:
    encoded: EncodedSchema
    reused: bool  # nothing was computed
    store_bytes: int
    bytes_by_module: dict[str, int]


@dataclass(frozen=True)
class Prepared:
    """A schema laid out and a prompt planned on it: what :meth:`Engine.run` runs, parsed once."""

    layout: Layout
    plan: PromptPlan

    @property
    def prompt_source(self) -> str:
        return self.plan.prompt.source


class Engine:
    """Model + module stores + encoded schemas, driven by one :class:`RunConfig` (``Engine(**settings)`` makes
    one); a run may pass another config of the same model, device and dtype."""

    def __init__(self, config: RunConfig | None = None, **settings):
        if config is not None and settings:
            raise EngineError("pass either a RunConfig or settings, not both")
        self.config = config if config is not None else RunConfig.make(**settings)
        check_device(self.config.storage)
        check_device(self.config.device)
        self._lm: LoadedModel | None = None
        self._tokenizer = None
        self._codec: TextCodec | None = None
        self._model_config = None
        self._stores: dict[str, ModuleStore] = {}
        self._prefix: dict[str, PrefixCache] = {}
        self._encoded: dict[tuple, EncodedSchema] = {}
        self._load_lock = threading.Lock()
        self.run_lock = threading.RLock()  # held through each of the scheduler's turns: one caller times at a time
        self.scheduler = Scheduler(lambda: self.lm, lock=self.run_lock)
        self._pool: KVPool | None = None

    @classmethod
    def from_loaded(cls, lm: LoadedModel, config: RunConfig | None = None, **settings) -> "Engine":
        """An Engine around a loaded model; no persistence unless asked."""
        settings.setdefault("persist", False)
        base = config or RunConfig.make(**settings)
        eng = cls(base.with_(model=lm.name, device=lm.device, dtype=lm.dtype, weights=lm.weights))
        eng._lm, eng._codec, eng._tokenizer = lm, lm.codec, lm.tokenizer
        return eng

    # -- model --

    @property
    def lm(self) -> LoadedModel:
        """The model, loaded on first use."""
        with self._load_lock:
            if self._lm is None:
                cfg = self.config
                self._lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, tokenizer=self._tokenizer,
                                      codec=self._codec, weights=cfg.weights)
                self._codec, self._tokenizer = self._lm.codec, self._lm.tokenizer
            return self._lm

    @property
    def loaded(self) -> bool:
        return self._lm is not None

    @property
    def loading(self) -> bool:
        """Whether another thread is loading the model now."""
        return self._lm is None and self._load_lock.locked()

    @property
    def codec(self) -> TextCodec:
        """Tokenizer + chat template, without the weights."""
        if self._codec is None:
            with self._load_lock:
                if self._codec is None:
                    _, self._tokenizer, self._codec = load_tokenizer(self.config.model)
        return self._codec

    @property
    def tokenizer(self):
        """The tokenizer."""
        self.codec
        return self._tokenizer

    def info(self) -> dict:
        return {**self.lm.info(), "kv_pool": self.pool.stats()}

    @property
    def pool(self) -> KVPool:
        """Where this engine's runs lease their KV, sized by ``kv_budget_bytes`` (engine/run/pools.py)."""
        if self._pool is None or self._pool.device != torch.device(self.lm.device):
            self._pool = make_pool(self.lm, self.config.kv_budget_bytes)
        return self._pool

    def store(self, storage: str | None = None) -> ModuleStore:
        """The module store for ``storage``."""
        storage = storage or self.config.storage
        if storage not in self._stores:
            check_device(storage)
            cfg = self.config
            budget = cfg.budget_bytes if cfg.budget_bytes is not None else default_budget(storage)
            disk = DiskStore(cfg.modules_path) if cfg.persist else None
            self._stores[storage] = ModuleStore(storage, budget_bytes=budget, disk=disk,
                                                page_locked=str(cfg.device).startswith("cuda"))
        return self._stores[storage]

    def prefix_cache(self, storage: str | None = None) -> PrefixCache:
        """The prefix cache in ``storage``'s store."""
        storage = storage or self.config.storage
        if storage not in self._prefix:
            self._prefix[storage] = PrefixCache(self.store(storage))
        return self._prefix[storage]

    def set_budget(self, budget_bytes: int | None, storage: str | None = None) -> int:
        """Apply a memory budget (None: the default) to a store, evicting now."""
        store = self.store(storage)
        budget = budget_bytes if budget_bytes is not None else default_budget(store.device)
        store.set_budget(budget)
        return budget

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """KV bytes per token in ``dtype`` (default: the compute dtype), from the config alone."""
        if self._lm is not None:
            config = self._lm.model.config
        else:
            if self._model_config is None:
                self._model_config = load_config(self.config.model)
            config = self._model_config
        return math.ceil(stored_bytes_per_token(*kv_shape(config), dtype or self.config.dtype))

    # -- documents --

    def layout(self, schema_text: str, source: str = "<schema>") -> Layout:
        """Parse and lay out a schema."""
        return make_layout(parse_schema(schema_text, source), self.codec)

    def plan(self, layout: Layout, prompt_text: str, source: str = "<prompt>", max_new_tokens: int = 0) -> PromptPlan:
        return plan_prompt(layout, parse_prompt(prompt_text, source), max_new_tokens)

    # -- encoding and runs --

    def encode(self, layout: Layout, config: RunConfig | None = None) -> EncodeResult:
        """Encode what a schema's store lacks."""
        return finish(self.encoding(layout, config))

    def encoding(self, layout: Layout, config: RunConfig | None = None) -> Generator[UnitEncoded, None, EncodeResult]:
        """:meth:`encode`, a UnitEncoded after each unit (closing the generator stops between units)."""
        cfg = self._config(config)
        enc = yield from self._encode(layout, cfg)
        store = self.store(cfg.storage)
        return EncodeResult(encoded=enc, reused=all(u.reused for u in enc.units), store_bytes=enc.nbytes(store),
                            bytes_by_module=enc.bytes_by_module(store))

    def prepare(self, schema_text: str, prompt_text: str, max_new_tokens: int = 0, *,
                schema_source: str = "<schema>", prompt_source: str = "<prompt>") -> Prepared:
        """Lay out the schema and plan the prompt on it (PMLError, ContextLengthError with ``max_new_tokens``)."""
        lay = self.layout(schema_text, schema_source)
        return Prepared(lay, self.plan(lay, prompt_text, prompt_source, max_new_tokens))

    def compare(self, schema_text: str, prompt_text: str, sampling: Sampling | None = None, **kw) -> Comparison:
        """:meth:`events` (its keywords: config, schema_source, prompt_source) to the end: the Comparison."""
        return finish(self.events(schema_text, prompt_text, sampling, **kw))

    def run(self, prepared: Prepared, sampling: Sampling | None = None, *,
            config: RunConfig | None = None) -> Comparison:
        """:meth:`run_events` to the end: the Comparison."""
        return finish(self.run_events(prepared, sampling, config=config))

    def events(self, schema_text: str, prompt_text: str, sampling: Sampling | None = None, *,
               config: RunConfig | None = None, schema_source: str = "<schema>",
               prompt_source: str = "<prompt>") -> Generator[Event, None, Comparison]:
        """:meth:`prepare` then :meth:`run_events`, through the scheduler."""
        return self.scheduler.stream(self._prepared(schema_text, prompt_text, sampling, config, schema_source,
                                                    prompt_source))

    def run_events(self, prepared: Prepared, sampling: Sampling | None = None, *,
                   config: RunConfig | None = None) -> Generator[Event, None, Comparison]:
        """:meth:`request`'s events through the scheduler; closing the generator stops it."""
        return self.scheduler.stream(self.request(prepared, sampling, config=config))

    def request(self, prepared: Prepared, sampling: Sampling | None = None, *,
                config: RunConfig | None = None) -> Generator[Event, None, Comparison]:
        """Encode if needed, run the configured arms on ``prepared`` and compare them, yielding each step
        (engine/run/events.py ``Event``), last a Done: a request for :attr:`scheduler` (directives inside)."""
        cfg = self._config(config)
        sampling = sampling or Sampling()
        lay, plan, source = prepared.layout, prepared.plan, prepared.prompt_source
        if lay.codec.fingerprint != self.codec.fingerprint:
            raise EngineError(f"prompt {source} was prepared with another tokenizer than this engine's: prepare it "
                              "again with this engine")
        check_room(plan, sampling.max_new_tokens)
        store = self.store(cfg.storage)
        check_budget(plan, cfg, store, source, self.kv_bytes_per_token(cfg.storage_dtype), self.kv_bytes_per_token())
        enc = yield from self._encode(lay, cfg)
        store.check_fits(used_keys(plan, enc), f"prompt {source}")
        enc = yield from self._fetched(plan, lay, cfg, enc)
        prefix = (yield from self._warm(lay, cfg, keep=used_keys(plan, enc))) if reads_prefix_cache(cfg) \
            else self.prefix_cache(cfg.storage) if "routed" in cfg.arms else None  # it keeps its runs there
        ctx = ArmContext(self.lm, plan, enc, store, sampling, prefix, settings=dict(cfg.arm_settings), pool=self.pool)
        result = yield from comparing(ctx, cfg.arms, cfg.decode, parks=True)
        result = replace(result, encode=encode_summary(enc))
        yield Done(result)
        return result

    # -- internal helpers --

    def _config(self, config: RunConfig | None) -> RunConfig:
        if config is None:
            return self.config
        if not self.config.same_model(config):
            raise EngineError(f"this engine runs model {self.config.model or 'default'} on {self.config.device} in "
                              f"{self.config.dtype} with {self.config.weights} weights; a run asked for {config.model or 'default'} "
                              f"on {config.device} in {config.dtype} with {config.weights} weights: make another Engine "
                              "for that")
        check_device(config.storage)
        return config

    def _prepared(self, schema_text: str, prompt_text: str, sampling: Sampling | None, config: RunConfig | None,
                  schema_source: str, prompt_source: str) -> Generator[Event, None, Comparison]:
        self._config(config)
        sampling = sampling or Sampling()
        prepared = self.prepare(schema_text, prompt_text, sampling.max_new_tokens, schema_source=schema_source,
                                prompt_source=prompt_source)
        return (yield from self.request(prepared, sampling, config=config))

    def _encode(self, layout: Layout, cfg: RunConfig) -> Generator[UnitEncoded, None, EncodedSchema]:
        store = self.store(cfg.storage)
        key = (layout.fingerprint, *cfg.encoding_key())
        enc = self._encoded.get(key)
        if enc is not None and all(k in store for k in enc.keys()):
            total = count_units(layout)
            yield UnitEncoded(total, total, "already encoded")
            return replace(enc, units=tuple(replace(u, source="memory", ms=0.0) for u in enc.units), encode_ms=0.0)
        enc = yield from encoding(self.lm.model, layout, store, cfg, self.lm.fingerprint)
        self._encoded[key] = enc
        while len(self._encoded) > ENCODED_KEPT:  # the oldest first
            self._encoded.pop(next(iter(self._encoded)))
        return enc

    def _fetched(self, plan: PromptPlan, layout: Layout, cfg: RunConfig,
                 enc: EncodedSchema) -> Generator[UnitEncoded, None, EncodedSchema]:
        """``enc`` with the plan's entries in memory (encoded again, once, if one vanished)."""
        store = self.store(cfg.storage)
        try:
            fetch_entries(plan, enc, store)
            return enc
        except MissingEntry:
            self._encoded.pop((layout.fingerprint, *cfg.encoding_key()), None)
            enc = yield from self._encode(layout, cfg)
            fetch_entries(plan, enc, store)
            return enc

    def _warm(self, layout: Layout, cfg: RunConfig, keep: list[str] = ()) -> Generator[Event, None, PrefixCache]:
        """The prefix cache, warmed once per schema with every module in schema order (docs/arms.md)."""
        cache = self.prefix_cache(cfg.storage)
        if cfg.warmup and layout.fingerprint not in cache.warmed:
            warm = schema_order_prompt(layout)
            yield Warming(len(warm.token_ids))
            start = time.perf_counter()
            if len(warm.token_ids) >= 2:
                yield from warm_prefix(self.lm, cache, warm.token_ids[: self.codec.max_positions], keep, self.pool)
            ms = (time.perf_counter() - start) * 1000
            cache.warmed[layout.fingerprint] = replace(warm, ms=ms, at_run=cache.inserted_runs)
            yield Warmed(ms)
        return cache

def check_budget(plan: PromptPlan, cfg: RunConfig, store: ModuleStore, what: str, per_token: int,
                 anonymous_per_token: int) -> None:
    """Refuse a prompt whose module KV cannot fit the store's budget, from token counts (bytes per token stored, and
    of anonymous text, kept in the compute dtype)."""
    if store.budget_bytes is None:
        return
    need = 0
    for name, tokens in plan.entry_tokens().items():
        if name.kind == "anonymous":
            need += tokens * anonymous_per_token
        else:
            need += int(tokens * per_token * cfg.compression.stored_fraction)
    store.check_need(need, f"prompt {what}")


def encode_summary(enc: EncodedSchema) -> dict:
    """How a schema's units were obtained, as JSON."""
    by_source = {src: sum(u.source == src for u in enc.units) for src in ("memory", "disk", "encoded")}
    unsaved = [u.unsaved for u in enc.units if u.unsaved]
    return {"ms": round(enc.encode_ms, 3), "units": len(enc.units), **by_source,
            "unsaved": len(unsaved), "store_note": unsaved[0] if unsaved else "",
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


def reads_prefix_cache(cfg: RunConfig) -> bool:
    """Whether any of the run's arms reads the prefix cache: the prefix arm, or routed with its tree path on."""
    return any(REGISTRY[a].reads == Reads.PREFIX_CACHE for a in cfg.arms) or (
        "routed" in cfg.arms and cfg.settings_of("routed").tree == "on")
