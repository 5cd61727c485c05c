"""Arms as values: the name type, one result type per arm, and the registry that runs them.

An **arm** is one way of getting a prompt's first token: ``baseline`` (full prefill), ``prefix``
(what serving engines do), ``cached`` (modular reuse) and, later, ``blend``. Every arm is one
function ``(ArmContext) -> ArmResult`` plus one :func:`register` call; everything downstream —
the comparison, its JSON, the run log, the studio's columns — iterates over :data:`REGISTRY`.

    @register(Arm.CACHED, title="Modular cache", reads_store=True, legacy_prefix="")
    def cached_arm(ctx: ArmContext) -> ArmResult: ...

Public API first (Arm, Agreement, ArmResult, ArmContext, register, REGISTRY), helpers after.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # runner imports this module; these are only annotations here
    from .encode import EncodedSchema
    from .models import LoadedModel
    from .plan import PromptPlan
    from .prefix import PrefixCache
    from .runner import RunResult, Sampling, TokenFn
    from .store import ModuleStore


class Arm(str, enum.Enum):
    """An arm's name. A ``str``: JSON keys, ``--arms`` values and streaming paths spell it as text."""

    BASELINE = "baseline"
    PREFIX = "prefix"
    CACHED = "cached"
    BLEND = "blend"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str) -> "Arm":
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(a.value for a in REGISTRY) or ", ".join(a.value for a in cls)
            raise ValueError(f"unknown arm '{name}'; arms: {known}") from None


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
    def between(cls, base: "RunResult", other: "RunResult") -> "Agreement":
        import torch

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
    own details (``detail``: e.g. the prefix arm's :class:`engine.runner.PrefixReuse`)."""

    arm: Arm
    run: "RunResult"
    agreement: Agreement | None = None
    detail: Any = None  # a frozen dataclass with to_json() (arm-specific), or None

    def speedup_over(self, base: "ArmResult | None") -> float | None:
        """Baseline TTFT / this arm's TTFT (None without a baseline or for the baseline itself), from the
        TTFTs as ``run --json`` writes them (to the microsecond), so a document read back gives the same."""
        if base is None or self.arm == Arm.BASELINE:
            return None
        mine = round(self.run.ttft_ms, 3)
        return round(base.run.ttft_ms, 3) / mine if mine > 0 else float("inf")

    def to_json(self) -> dict:
        """The arm's object in ``run --json`` (its run, then its details; keys never renamed)."""
        out = self.run.to_json()
        spec = REGISTRY.get(self.arm)
        if spec is not None:
            out.update(spec.extra_json(self))
        if self.detail is not None:
            out.update(self.detail.to_json())
        return out

    def with_agreement(self, base: "ArmResult | None") -> "ArmResult":
        if base is None or self.arm == Arm.BASELINE:
            return self
        return ArmResult(self.arm, self.run, Agreement.between(base.run, self.run), self.detail)


@dataclass(frozen=True)
class ArmContext:
    """Everything an arm function may read; arms never change it (the prefix arm's cache excepted)."""

    lm: "LoadedModel"
    plan: "PromptPlan"
    encoded: "EncodedSchema"
    store: "ModuleStore"
    sampling: "Sampling"
    on_token: "TokenFn | None" = None
    prefix: "PrefixCache | None" = None
    keep: tuple[str, ...] = ()  # store keys the prefix arm must not evict (the modules the cached arm reads)
    repair: int = 0  # link tokens recomputed per link by the cached arm
    blend: float = 0.0  # share of cached tokens the blend arm recomputes
    options: dict = field(default_factory=dict)  # arm-specific settings (e.g. the blend arm's rule)


@dataclass(frozen=True)
class ArmSpec:
    """A registered arm: its function and how it is presented."""

    arm: Arm
    run: Callable[[ArmContext], ArmResult]
    title: str
    subtitle: str
    reads_store: bool  # its TTFT includes copying stored KV (``ttft_includes_copy`` in the JSON)
    legacy_prefix: str | None  # prefix of its agreement keys at the top of run --json ("" = unprefixed)
    color: str

    def extra_json(self, result: ArmResult) -> dict:
        return {"ttft_includes_copy": True} if self.reads_store else {}


REGISTRY: dict[Arm, ArmSpec] = {}  # in column order


def register(arm: Arm, *, title: str, subtitle: str, color: str, reads_store: bool,
             legacy_prefix: str | None = None) -> Callable:
    """Decorator: make ``fn(ctx) -> ArmResult`` the arm ``arm``."""
    def wrap(fn: Callable[[ArmContext], ArmResult]) -> Callable[[ArmContext], ArmResult]:
        REGISTRY[arm] = ArmSpec(arm, fn, title, subtitle, reads_store,
                                arm.value + "_" if legacy_prefix is None else legacy_prefix, color)
        return fn
    return wrap


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first differing token (or of the shorter sequence's end); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _round(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)
