"""The arms' interface: what an arm is, what it returns, and the registry every front end reads.

An **arm** is one way of getting a prompt's first token: ``baseline`` (full prefill), ``prefix``
(the prefix cache serving engines keep), ``cached`` (modular reuse), ``blend`` (selective
recompute), ... Each lives in its own file in ``engine/arms/`` and registers one :class:`ArmSpec`:
its run function ``(ArmContext) -> ArmResult`` and everything the front ends need — title, colour,
its settings as a frozen :class:`ArmSettings` dataclass (one default each, validated where made,
with their CLI options and studio controls declared by :func:`setting`), its detail type (with
``to_json``/``from_json``), its progress text and what it reads. The comparison, its JSON, the run
log, the CLI and the studio's columns iterate over :data:`REGISTRY`; none of them names an arm.

    @register(ArmSpec("cached", cached_arm, title="Modular cache", ..., reads=Reads.MODULES))

Result types live here, beside the interface that returns them (sglang's ``base_prefix_cache.py``),
never in the module that computes them. ``engine.arms`` (the package) imports every arm module, so
importing it fills the registry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

import torch

from engine.errors import EngineError
from engine.limits import Limit, check_fields


class Arm(str):
    """An arm's name: its JSON key, its ``--arms`` value, its column. The built-in names are constants."""

    BASELINE: "Arm"
    PREFIX: "Arm"
    CACHED: "Arm"

    @property
    def value(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, name: str) -> "Arm":
        """The registered arm ``name``; ValueError naming the registered ones."""
        if name not in REGISTRY:
            raise ValueError(f"unknown arm '{name}'; arms: {', '.join(REGISTRY)}")
        return cls(name)


Arm.BASELINE, Arm.PREFIX, Arm.CACHED = Arm("baseline"), Arm("prefix"), Arm("cached")


class Reads:
    """What an arm reads besides the model: nothing, the modules' stored KV, or the prefix cache."""

    NOTHING = "nothing"
    MODULES = "modules"
    PREFIX_CACHE = "prefix cache"


# ----------------------------------------------------------------------------------------------
# An arm's settings
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """How one field of an :class:`ArmSettings` is named and offered. ``key`` is its one name everywhere:
    the CLI option ``--key-with-dashes``, ``RunConfig(key=...)`` / ``with_(key=...)``, the run config's
    JSON and the studio's control."""

    key: str
    label: str  # the studio control's label
    help: str  # CLI help and the control's info line
    limit: Limit | None = None  # numeric settings: the accepted range (the slider's too)
    choices: tuple[str, ...] = ()  # text settings: the accepted values (a radio)
    step: float = 1.0  # the slider's step
    widget_max: float | None = None  # the slider's end when below the limit's (a useful range)
    enables: bool = False  # a value above 0 given on the CLI or in the studio adds the arm to the run's arms
    metavar: str | None = None  # the CLI's name for the value


def setting(default, key: str, label: str, help: str, **kw) -> Any:
    """A field of an :class:`ArmSettings` dataclass: its default and how it is offered (:class:`Setting`)."""
    return field(default=default, metadata={"setting": Setting(key, label, help, **kw)})


@dataclass(frozen=True)
class ArmSettings:
    """Base of an arm's settings: a frozen dataclass whose fields are made with :func:`setting`, checked
    (range, choices) when an instance is made. Override :meth:`check_with` for rules across settings."""

    def __post_init__(self):
        for f, s in self.declared():
            value = getattr(self, f)
            if s.limit is not None:
                check_fields(self, f, limits={f: s.limit})
            elif s.choices and value not in s.choices:
                raise EngineError(f"unknown {s.key.replace('_', ' ')} '{value}'; use one of {', '.join(s.choices)}")

    @classmethod
    def declared(cls) -> list[tuple[str, Setting]]:
        """(field name, Setting) of every setting, in declaration order."""
        return [(f.name, f.metadata["setting"]) for f in fields(cls) if "setting" in f.metadata]

    def by_key(self) -> dict[str, Any]:
        """{setting key: value} (the run config's JSON and attribute names)."""
        return {s.key: getattr(self, f) for f, s in self.declared()}

    def check_with(self, config) -> None:
        """Refuse a run config this arm cannot run with (EngineError); ``config`` is a RunConfig."""


# ----------------------------------------------------------------------------------------------
# What a run returns
# ----------------------------------------------------------------------------------------------

TokenFn = Callable[[str, str], None]  # (arm, text so far)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings shared by every arm. temperature 0 = greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # the generation ends once its text holds one of these (the text keeps it)

    def __post_init__(self):
        check_fields(self, "max_new_tokens", "temperature", "top_p", "seed")  # EngineError naming the setting
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise EngineError(f"stop must be a list of non-empty strings, got {self.stop!r}; e.g. [\"\\n\\n\"]")
        object.__setattr__(self, "stop", tuple(stop))

    @classmethod
    def from_json(cls, data: dict | None) -> "Sampling":
        keys = ("max_new_tokens", "temperature", "top_p", "seed", "stop")
        return cls(**{k: v for k, v in (data or {}).items() if k in keys})

    def to_json(self) -> dict:
        out = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "seed": self.seed}
        return {**out, "stop": list(self.stop)} if self.stop else out  # the key only when set: documents unchanged


@dataclass(frozen=True)
class RunResult:
    """One timed run of an arm: its output, timings, what it reused and the KV it held."""

    arm: str  # the arm whose run this is
    text: str
    token_ids: tuple[int, ...]
    ttft_ms: float
    copy_ms: float  # buffer allocation + the arm's fill (stored KV copied in; 0 for baseline)
    prefill_ms: float  # forward over the prefilled tokens
    sample_ms: float  # choosing the first token from its logits
    prefill_tokens: int
    decode_ms_per_token: float | None  # None when fewer than two tokens were generated
    decode_tokens: int
    peak_rss_bytes: int
    cuda_peak_bytes: int | None
    kv_buffer_bytes: int  # capacity of the run's buffer
    first_logits: torch.Tensor | None = field(repr=False, compare=False)  # None when read back from JSON
    reused_tokens: int = 0  # prompt tokens whose KV came from a store (modules or the prefix cache)
    recomputed_tokens: int = 0  # cached tokens prefilled again (repair, blend; in prefill_tokens)
    recomputed_positions: tuple[int, ...] = ()  # their position ids
    kv_buffer_used_bytes: int = 0  # KV in the run's buffer after the prefill (baseline: prompt tokens x bytes/token)
    kv_store_bytes: int = 0  # store entries the run read, as stored: modules (cached), prefix nodes (prefix)
    kv_buffer_bytes_after_retention: int = 0  # what decoding ran over (= kv_buffer_used_bytes without retention)
    retention_ms: float = 0.0  # scoring + thinning the buffer (question retention), after the first token
    decode_batch: int = 1  # runs decoded together in one batch (decode_ms_per_token is then the batch's step)

    @property
    def kv_held_bytes(self) -> int:
        """Stored entries read + the run's buffer after the prefill."""
        return self.kv_store_bytes + self.kv_buffer_used_bytes

    def to_json(self) -> dict:
        return {"text": self.text, "ttft_ms": round(self.ttft_ms, 3), "copy_ms": round(self.copy_ms, 3),
                "prefill_ms": round(self.prefill_ms, 3), "sample_ms": round(self.sample_ms, 3),
                "prefill_tokens": self.prefill_tokens,
                "decode_ms_per_token": None if self.decode_ms_per_token is None else round(self.decode_ms_per_token, 3),
                "new_tokens": self.decode_tokens, "peak_rss_bytes": self.peak_rss_bytes,
                "cuda_peak_bytes": self.cuda_peak_bytes, "kv_buffer_bytes": self.kv_buffer_bytes,
                "reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens,
                "recomputed_positions": list(self.recomputed_positions),
                "kv_buffer_used_bytes": self.kv_buffer_used_bytes, "kv_store_bytes": self.kv_store_bytes,
                "kv_held_bytes": self.kv_held_bytes,
                "kv_buffer_bytes_after_retention": self.kv_buffer_bytes_after_retention,
                "retention_ms": round(self.retention_ms, 3), "decode_batch": self.decode_batch}

    @classmethod
    def from_json(cls, arm: str, d: dict) -> "RunResult":
        """A run read back from its ``run --json`` object (no logits; figures a run log lacks are 0)."""
        return cls(arm=arm, text=d.get("text", ""), token_ids=(), ttft_ms=d.get("ttft_ms", 0.0),
                   copy_ms=d.get("copy_ms", 0.0), prefill_ms=d.get("prefill_ms", 0.0),
                   sample_ms=d.get("sample_ms", 0.0), prefill_tokens=d.get("prefill_tokens", 0),
                   decode_ms_per_token=d.get("decode_ms_per_token"), decode_tokens=d.get("new_tokens", 0),
                   peak_rss_bytes=d.get("peak_rss_bytes", 0), cuda_peak_bytes=d.get("cuda_peak_bytes"),
                   kv_buffer_bytes=d.get("kv_buffer_bytes", 0), first_logits=None,
                   reused_tokens=d.get("reused_tokens", 0), recomputed_tokens=d.get("recomputed_tokens", 0),
                   recomputed_positions=tuple(d.get("recomputed_positions") or ()),
                   kv_buffer_used_bytes=d.get("kv_buffer_used_bytes", 0), kv_store_bytes=d.get("kv_store_bytes", 0),
                   kv_buffer_bytes_after_retention=d.get("kv_buffer_bytes_after_retention", 0),
                   retention_ms=d.get("retention_ms", 0.0), decode_batch=d.get("decode_batch") or 1)


@dataclass(frozen=True)
class Agreement:
    """How far an arm's run drifted from the baseline's."""

    same_text: bool
    first_divergence: int | None  # first differing generated token (None: same tokens)
    first_token_agree: bool
    first_token_kl: float  # KL(baseline || arm) of the first-token distributions, nats
    max_first_logit_diff: float

    FIELDS = ("same_text", "first_divergence", "first_token_agree", "first_token_kl", "max_first_logit_diff")

    @classmethod
    def between(cls, base: RunResult, other: RunResult) -> "Agreement":
        lb = torch.log_softmax(base.first_logits.float(), -1)
        lo = torch.log_softmax(other.first_logits.float(), -1)
        # rounding can make the KL of two identical distributions a hair below zero
        kl = max(float(torch.sum(lb.exp() * (lb - lo))), 0.0)
        div = first_divergence(base.token_ids, other.token_ids)
        return cls(same_text=div is None, first_divergence=div,
                   first_token_agree=bool(torch.argmax(lb) == torch.argmax(lo)), first_token_kl=kl,
                   max_first_logit_diff=float((base.first_logits - other.first_logits).abs().max()))

    def to_json(self) -> dict:
        return {"same_text": self.same_text, "first_divergence": self.first_divergence,
                "first_token_agree": self.first_token_agree, "first_token_kl": _round(self.first_token_kl),
                "max_first_logit_diff": _round(self.max_first_logit_diff)}

    @classmethod
    def from_json(cls, data: dict | None) -> "Agreement | None":
        if not data or data.get("same_text") is None:
            return None
        return cls(**{k: data.get(k) for k in cls.FIELDS})


@dataclass(frozen=True)
class ArmResult:
    """One arm of a comparison: its timed run (what it reused and the KV it held are in ``run``), its
    agreement with the baseline (None for the baseline itself, or when no baseline ran) and the arm's
    own details (``detail``: an instance of its spec's ``detail`` type, e.g. the prefix arm's reuse)."""

    arm: Arm
    run: RunResult
    agreement: Agreement | None = None
    detail: Any = None  # a frozen dataclass with to_json() / from_json() (arm-specific), or None

    def speedup_over(self, base: "ArmResult | None") -> float | None:
        """Baseline TTFT / this arm's TTFT (None without a baseline or for the baseline itself), from the
        TTFTs as ``run --json`` writes them (to the microsecond), so a document read back gives the same."""
        if base is None or self.arm == Arm.BASELINE:
            return None
        mine = round(self.run.ttft_ms, 3)
        return round(base.run.ttft_ms, 3) / mine if mine > 0 else math.inf

    def to_json(self) -> dict:
        """The arm's object in ``run --json`` (its run, then its details; keys never renamed)."""
        out = self.run.to_json()
        spec = REGISTRY.get(self.arm)
        if spec is not None and spec.reads != Reads.NOTHING:
            out["ttft_includes_copy"] = True
        if self.detail is not None:
            out.update(self.detail.to_json())
        return out

    def with_agreement(self, base: "ArmResult | None") -> "ArmResult":
        if base is None or self.arm == Arm.BASELINE:
            return self
        return ArmResult(self.arm, self.run, Agreement.between(base.run, self.run), self.detail)


@dataclass(frozen=True)
class ArmContext:
    """Everything an arm function may read; arms never change it (the prefix cache excepted, which the
    prefix arm inserts into through its public API)."""

    lm: Any  # engine.model.load.LoadedModel
    plan: Any  # engine.schema.plan.PromptPlan
    encoded: Any  # engine.cache.encode.EncodedSchema
    store: Any  # engine.cache.store.ModuleStore
    sampling: Sampling
    on_token: TokenFn | None = None
    prefix: Any = None  # engine.cache.prefix.PrefixCache (the prefix arm's)
    keep: tuple[str, ...] = ()  # store keys the prefix cache must not evict (the modules other arms read)
    settings: Mapping[str, ArmSettings] = field(default_factory=dict)  # arm name -> its settings

    def settings_of(self, arm: str) -> ArmSettings | None:
        """The settings the run gave arm ``arm`` (its defaults when it gave none; None: it has none)."""
        if arm in self.settings:
            return self.settings[arm]
        spec = REGISTRY.get(arm)
        return None if spec is None or spec.settings is None else spec.settings()


# ----------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArmSpec:
    """A registered arm: its run function and everything the front ends show and offer of it."""

    name: str
    run: Callable[[ArmContext], ArmResult]
    title: str
    subtitle: str
    color: str
    order: int  # column order (baseline 0, prefix 10, cached 20, blend 30, ...)
    reads: str = Reads.NOTHING  # Reads.*: its TTFT includes copying stored KV unless NOTHING
    top_level_stem: str | None = None  # its agreement keys at the top of run --json: NAME_ unless given ("" = cached's)
    settings: type[ArmSettings] | None = None
    detail: type | None = None  # ArmResult.detail's type: to_json() and a classmethod from_json(dict)
    progress: str = ""  # what the studio says while it runs
    default: bool = False  # in the arms a run takes when none are named
    token_class: tuple[str, str] | None = None  # (name, legend) of the tokens it recomputed, in the token view

    @property
    def arm(self) -> Arm:
        return Arm(self.name)

    @property
    def json_stem(self) -> str:
        """What its agreement keys at the top of run --json start with ('prefix_', 'blend_'; '' for cached)."""
        return f"{self.name}_" if self.top_level_stem is None else self.top_level_stem

    def detail_from_json(self, data: dict) -> Any:
        """Its detail read back from its run --json object (None when it has no detail type)."""
        return None if self.detail is None else self.detail.from_json(data)


REGISTRY: dict[Arm, ArmSpec] = {}  # in column order


def register(spec: ArmSpec) -> ArmSpec:
    """Make ``spec`` an arm; a spec registered again under its name replaces the old one."""
    if not spec.name.isidentifier() or spec.name != spec.name.lower():
        raise EngineError(f"an arm's name is a lower-case identifier (a JSON key and --arms value), got '{spec.name}'")
    entries = {**REGISTRY, Arm(spec.name): spec}
    REGISTRY.clear()
    REGISTRY.update(sorted(entries.items(), key=lambda kv: (kv[1].order, kv[0])))
    return spec


def unregister(name: str) -> None:
    """Remove arm ``name`` (tests that register a toy arm)."""
    REGISTRY.pop(Arm(name), None)


def arm_names() -> tuple[str, ...]:
    """Every registered arm, in column order."""
    return tuple(REGISTRY)


def default_arms() -> tuple[str, ...]:
    return tuple(a for a, s in REGISTRY.items() if s.default)


def settings_specs() -> list[tuple[ArmSpec, str, Setting]]:
    """(arm spec, field name, Setting) of every arm's every setting, in column order."""
    return [(spec, f, s) for spec in REGISTRY.values() if spec.settings is not None for f, s in spec.settings.declared()]


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first differing token (or of the shorter sequence's end); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _round(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)
