"""The arms' interface: what an arm is and returns, and the registry every front end iterates over.

Each arm is one file in ``engine/arms/`` registering an :class:`ArmSpec`; its look is the studio's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Generator, Mapping, TypeVar, Union

import torch

from engine.errors import EngineError
from engine.limits import Limit, check_fields
from engine.run.decode import Decoder
from engine.run.events import FirstToken, Token
from engine.run.types import Routing, RunResult, Sampling  # noqa: F401  (callers import them from here too)

if TYPE_CHECKING:
    from engine.cache.encode import EncodedSchema
    from engine.cache.prefix import PrefixCache
    from engine.cache.store import ModuleStore
    from engine.kv.pool import KVPool
    from engine.model.load import LoadedModel
    from engine.schema.plan import PromptPlan


T = TypeVar("T")
RunEvents = Generator[Union[FirstToken, Token], None, T]  # an arm's run: its events, then what it returns


class Arm(str):
    """An arm's name: its JSON key and ``--arms`` value."""

    BASELINE: "Arm"
    PREFIX: "Arm"
    CACHED: "Arm"

    @property
    def value(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, name: str) -> "Arm":
        if name not in REGISTRY:
            raise ValueError(f"unknown arm '{name}'; arms: {', '.join(REGISTRY)}")
        return cls(name)


Arm.BASELINE, Arm.PREFIX, Arm.CACHED = Arm("baseline"), Arm("prefix"), Arm("cached")


class Reads:
    """What an arm reads besides the model."""

    NOTHING = "nothing"
    MODULES = "modules"
    PREFIX_CACHE = "prefix cache"


# -- An arm's settings --

@dataclass(frozen=True)
class Setting:
    """How one arm setting is offered; ``key`` is its name everywhere."""

    key: str
    title: str
    help: str  # what it does to the answer and to the time, in plain words
    limit: Limit | None = None  # numeric settings: the accepted range
    choices: tuple[str, ...] = ()  # text settings: the accepted values
    step: float = 1.0
    widget_max: float | None = None  # the useful end, when below the limit
    enables: bool = False  # a value above 0 adds the arm to the run's arms
    metavar: str | None = None
    how: str = ""  # how it works, in the field's terms (papers, mechanisms): the second line under ``help``

    @property
    def words(self) -> str:
        """``help``, then ``how`` on a line of its own."""
        return f"{self.help}\n{self.how}" if self.how else self.help


def setting(default, key: str, title: str, help: str, **kw) -> Any:
    """A field of an :class:`ArmSettings`."""
    return field(default=default, metadata={"setting": Setting(key, title, help, **kw)})


@dataclass(frozen=True)
class ArmSettings:
    """An arm's settings, checked when made."""

    def __post_init__(self):
        for f, s in self.declared():
            value = getattr(self, f)
            if s.limit is not None:
                check_fields(self, f, limits={f: s.limit})
            elif s.choices and value not in s.choices:
                raise EngineError(f"unknown {s.key.replace('_', ' ')} '{value}'; use one of {', '.join(s.choices)}")

    @classmethod
    def declared(cls) -> list[tuple[str, Setting]]:
        """(field name, Setting) of every setting."""
        return [(f.name, f.metadata["setting"]) for f in fields(cls) if "setting" in f.metadata]

    def by_key(self) -> dict[str, Any]:
        return {s.key: getattr(self, f) for f, s in self.declared()}

    def check_with(self, config) -> None:
        """EngineError when this arm cannot run with RunConfig ``config``."""


# -- What a run returns --

@dataclass(frozen=True)
class Agreement:
    """How far an arm's run drifted from the baseline's."""

    same_text: bool
    first_divergence: int | None  # None: same tokens
    first_token_agree: bool
    first_token_kl: float  # KL(baseline || arm), nats
    max_first_logit_diff: float

    FIELDS = ("same_text", "first_divergence", "first_token_agree", "first_token_kl", "max_first_logit_diff")

    @classmethod
    def between(cls, base: RunResult, other: RunResult) -> "Agreement":
        lb = torch.log_softmax(base.first_logits.float(), -1)
        lo = torch.log_softmax(other.first_logits.float(), -1)
        # rounding can put the KL of equal distributions below zero
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
    """One arm of a comparison. ``error``: why it could not run (its run has no figures: every front end leaves it
    out of them and says why); ``repeat``: it read an identical earlier request back (its TTFT is a lookup's)."""

    arm: Arm
    run: RunResult
    agreement: Agreement | None = None
    detail: Any = None
    error: str | None = None
    repeat: bool = False

    def __post_init__(self):
        if self.error is None and getattr(self.detail, "error", None):  # said in its detail only
            object.__setattr__(self, "error", self.detail.error)

    @property
    def routing(self) -> Routing | None:
        """The arm's routing when its detail is one, else None."""
        return self.detail if isinstance(self.detail, Routing) else None

    @property
    def ran(self) -> bool:
        return self.error is None

    @property
    def error_kind(self) -> str | None:
        """"unconfigured", or a remote server's failure kind (RemoteError's), when it could not run."""
        return (getattr(self.detail, "error_kind", None) or "broken") if self.error else None

    def speedup_over(self, base: "ArmResult | None") -> float | None:
        """Baseline TTFT / this arm's, as ``run --json`` rounds them."""
        if base is None or self.arm == Arm.BASELINE or not self.ran or not base.ran:
            return None
        mine = round(self.run.ttft_ms, 3)
        return round(base.run.ttft_ms, 3) / mine if mine > 0 else math.inf

    def to_json(self) -> dict:
        out = self.run.to_json()
        spec = REGISTRY.get(self.arm)
        if spec is not None and spec.reads != Reads.NOTHING:
            out["ttft_includes_copy"] = True
        if self.detail is not None:
            out.update(self.detail.to_json())
        out.update(ran=self.ran, error=self.error, repeat=self.repeat)
        return out

    def with_agreement(self, base: "ArmResult | None") -> "ArmResult":
        if base is None or self.arm == Arm.BASELINE or not self.ran:
            return self
        spec = REGISTRY.get(self.arm)
        agree = spec.agreement(base, self) if spec is not None and spec.agreement is not None \
            else Agreement.between(base.run, self.run)
        return replace(self, agreement=agree)


@dataclass(frozen=True)
class ArmContext:
    """Everything an arm function may read."""

    lm: "LoadedModel"
    plan: "PromptPlan"
    encoded: "EncodedSchema"
    store: "ModuleStore"
    sampling: Sampling
    prefix: "PrefixCache | None" = None
    keep: tuple[str, ...] = ()  # store keys the prefix cache must not evict
    settings: Mapping[str, ArmSettings] = field(default_factory=dict)  # arm name -> its settings
    pool: "KVPool | None" = None  # where runs lease their KV (None: the model's pool, engine/run/pools.py)

    def settings_of(self, arm: str) -> ArmSettings | None:
        """The settings the run gave ``arm``, else its defaults."""
        if arm in self.settings:
            return self.settings[arm]
        spec = REGISTRY.get(arm)
        return None if spec is None or spec.settings is None else spec.settings()


@dataclass(frozen=True)
class DecodingContext(ArmContext):
    """An arm's context in a comparison; its runs decode through ``decoder`` (None: each at once)."""

    decoder: Decoder | None = None


# -- The registry --

@dataclass(frozen=True)
class ArmSpec:
    """A registered arm."""

    name: str
    # a generator of its run's events returning the ArmResult (or a plain function returning it)
    run: Callable[[DecodingContext], "RunEvents[ArmResult] | ArmResult"]
    order: int  # column order
    reads: str = Reads.NOTHING  # its TTFT includes copying stored KV unless NOTHING
    top_level_stem: str | None = None  # see json_stem
    settings: type[ArmSettings] | None = None
    detail: type | None = None  # with to_json() and classmethod from_json(dict)
    default: bool = False  # run when no arms are named
    # (baseline, this arm) -> its Agreement, for an arm without full first logits (a remote server); None: between()
    agreement: Callable[["ArmResult", "ArmResult"], "Agreement | None"] | None = None

    @property
    def arm(self) -> Arm:
        return Arm(self.name)

    @property
    def json_stem(self) -> str:
        """Its agreement keys' prefix in run --json."""
        return f"{self.name}_" if self.top_level_stem is None else self.top_level_stem

    def detail_from_json(self, data: dict) -> Any:
        return None if self.detail is None else self.detail.from_json(data)


REGISTRY: dict[Arm, ArmSpec] = {}  # in column order


def register(spec: ArmSpec) -> ArmSpec:
    """Make ``spec`` an arm, replacing one of its name."""
    if not spec.name.isidentifier() or spec.name != spec.name.lower():
        raise EngineError(f"an arm's name is a lower-case identifier (a JSON key and --arms value), got '{spec.name}'")
    entries = {**REGISTRY, Arm(spec.name): spec}
    REGISTRY.clear()
    REGISTRY.update(sorted(entries.items(), key=lambda kv: (kv[1].order, kv[0])))
    return spec


def unregister(name: str) -> None:
    REGISTRY.pop(Arm(name), None)


def arm_names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def default_arms() -> tuple[str, ...]:
    return tuple(a for a, s in REGISTRY.items() if s.default)


def settings_specs() -> list[tuple[ArmSpec, str, Setting]]:
    """(arm spec, field name, Setting) of every setting."""
    return [(spec, f, s) for spec in REGISTRY.values() if spec.settings is not None for f, s in spec.settings.declared()]


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first differing token; None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _round(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)
