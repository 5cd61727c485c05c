"""Comparison: the arms of one run keyed by arm, and the ``run --json`` document made from them (a contract:
extend it, never rename; docs/cli.md). :meth:`Comparison.from_json` reads one back for the run log's history.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Generator, Sequence

from engine.arms.registry import (REGISTRY, Agreement, Arm, ArmContext, ArmResult, DecodingContext, Reads,
                                  RunEvents)
from engine.cache.assemble import fetch_entries, used_keys
from engine.cache.encode import EncodedSchema
from engine.cache.settings import canonical_mode
from engine.cache.store import ModuleStore
from engine.run.decode import Decoder
from engine.run.events import ArmDone, Event, finish
from engine.run.types import RunResult, Sampling
from engine.schema.plan import PromptPlan


@dataclass(frozen=True)
class StoreSummary:
    """The module store as one run saw it."""

    device: str  # where module KV is stored
    dtype: str  # storage precision
    nbytes: int  # this schema's entries
    by_module: dict[str, int]  # EntryName -> bytes
    compression: dict  # {"retention", "method"}
    stats: dict  # budget, evictions, disk counts

    @classmethod
    def of(cls, encoded: EncodedSchema, store: ModuleStore) -> "StoreSummary":
        return cls(device=store.device, dtype=encoded.dtype, nbytes=encoded.nbytes(store),
                   by_module=encoded.bytes_by_module(store),
                   compression={"retention": encoded.compression.retention, "method": encoded.compression.method},
                   stats=store.stats())


@dataclass(frozen=True)
class PromptCounts:
    """The prompt's shape (a logged run is read back without its plan)."""

    schema: str
    prompt_tokens: int
    cached_tokens: int
    uncached_tokens: int
    imported: tuple[str, ...]
    scaffolds: tuple[str, ...]

    @classmethod
    def of(cls, plan: PromptPlan) -> "PromptCounts":
        return cls(plan.layout.name, plan.prompt_tokens, plan.cached_tokens, plan.uncached_tokens,
                   tuple(plan.imported), tuple(plan.scaffolds))


@dataclass(frozen=True)
class Comparison:
    """The arms of one run, each an :class:`ArmResult` with its agreement with the baseline."""

    model: str
    device: str  # where the model ran
    store: StoreSummary
    sampling: Sampling
    arms: dict[Arm, ArmResult]  # in registry order; only the arms that ran
    mode: str
    plan: PromptPlan | None = field(default=None, repr=False)  # None when read back from JSON
    prompt: PromptCounts | None = None  # made from the plan when not given
    encode: dict | None = None  # how the schema's units were obtained (Engine.compare)
    weights: str = "fp32"  # the model's linear weights
    decode: str = "apart"  # or "together": one batch
    repair: int = 0  # link tokens recomputed per link
    sink: int = 0  # sink tokens the isolated entries were encoded after
    prefill_kernel: str = ""  # what multiplied the multi-token forwards' linears (engine/model/prefill.py)

    def __post_init__(self):
        if self.prompt is None and self.plan is not None:
            object.__setattr__(self, "prompt", PromptCounts.of(self.plan))

    # -- arms --

    def arm(self, name: str | Arm) -> ArmResult | None:
        """Arm ``name``'s result, or None."""
        return self.arms.get(Arm(str(name)))

    @property
    def baseline(self):
        """The baseline's run, or None."""
        return self._run(Arm.BASELINE)

    @property
    def cached(self):
        return self._run(Arm.CACHED)

    @property
    def prefix(self):
        return self._run(Arm.PREFIX)

    def speedup(self, name: str | Arm = Arm.CACHED) -> float | None:
        """Baseline TTFT / arm ``name``'s TTFT (None unless both ran)."""
        res = self.arm(name)
        return None if res is None else res.speedup_over(self.arm(Arm.BASELINE))

    def agreement(self, name: str | Arm = Arm.CACHED) -> Agreement | None:
        res = self.arm(name)
        return None if res is None else res.agreement

    # -- JSON --

    def to_json(self) -> dict:
        """The CLI's JSON contract (`pml-studio run --json`): extend, never rename.

        An arm that was not run (``--arms``) is null, as are the figures that need it.
        """
        p, st = self.prompt, self.store
        out = {
            "model": self.model, "storage": st.device, "mode": self.mode, "schema": p.schema,
            "prompt_tokens": p.prompt_tokens, "cached_tokens": p.cached_tokens, "uncached_tokens": p.uncached_tokens,
            "store_bytes": st.nbytes, "store_bytes_by_module": dict(st.by_module), "device": self.device,
            "storage_dtype": st.dtype, "compression": st.compression, "store_stats": st.stats,
            "imported": list(p.imported), "scaffolds": list(p.scaffolds), "arms": [a.value for a in self.arms],
            "sampling": self.sampling.to_json(), "encode": self.encode, "repair": self.repair, "sink": self.sink,
            "weights": self.weights, "decode": self.decode, "prefill_kernel": self.prefill_kernel,
        }
        by_arm = {}
        for arm, spec in REGISTRY.items():
            res = self.arms.get(arm)
            out[arm.value] = None if res is None else res.to_json()
            if arm == Arm.BASELINE:
                continue
            speedup = self.speedup(arm)
            agree = (res.agreement.to_json() if res is not None and res.agreement is not None
                     else dict.fromkeys(Agreement.FIELDS))
            stem = spec.json_stem
            out[f"{stem}speedup"] = None if speedup is None else round(speedup, 3)
            out.update({f"{stem}{k}": v for k, v in agree.items()})
            if res is not None:
                by_arm[arm.value] = {"speedup": out[f"{stem}speedup"],
                                     "agreement": None if res.agreement is None else agree}
        out["by_arm"] = by_arm
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Comparison":
        """A comparison read back from its ``run --json`` document (no plan, no logits)."""
        arms = {}
        for arm, spec in REGISTRY.items():
            d = data.get(arm.value)
            if not d:
                continue
            stem = spec.json_stem
            agree = None if arm == Arm.BASELINE else Agreement.from_json(
                {k: data.get(f"{stem}{k}") for k in Agreement.FIELDS})
            detail = spec.detail_from_json(d)
            repeat = d.get("repeat", getattr(detail, "path", None) == "repeat")  # routed, logged before
            arms[arm] = ArmResult(arm, RunResult.from_json(arm.value, d), agree, detail, error=d.get("error"),
                                  repeat=bool(repeat))
        comp = data.get("compression") or {}
        store = StoreSummary(device=data.get("storage", ""), dtype=data.get("storage_dtype") or "float32",
                             nbytes=data.get("store_bytes") or 0, by_module=data.get("store_bytes_by_module") or {},
                             compression={"retention": comp.get("retention", 1.0), "method": comp.get("method")},
                             stats=data.get("store_stats") or {})
        prompt = PromptCounts(data.get("schema", ""), data.get("prompt_tokens", 0), data.get("cached_tokens", 0),
                              data.get("uncached_tokens", 0), tuple(data.get("imported") or ()),
                              tuple(data.get("scaffolds") or ()))
        return cls(model=data.get("model", ""), device=data.get("device", ""), store=store,
                   sampling=Sampling.from_json(data.get("sampling")), arms=arms, mode=canonical_mode(data.get("mode", "")),
                   prompt=prompt, encode=data.get("encode"), repair=data.get("repair") or 0,
                   sink=data.get("sink") or 0, weights=data.get("weights") or "fp32",
                   decode=data.get("decode") or "apart", prefill_kernel=data.get("prefill_kernel") or "")

    def _run(self, arm: Arm):
        res = self.arms.get(arm)
        return None if res is None else res.run


# -- running the arms --

def comparing(ctx: ArmContext, arms: Sequence[str] = ("baseline", "cached"), decode: str = "together",
              parks: bool = False) -> Generator[Event, None, Comparison]:
    """The asked-for arms of ``ctx.plan`` in registry order, their events, an ArmDone each; the Comparison.
    ``decode="together"``: after their first tokens the arms decode as one batch; ``parks``: a scheduler drives the
    comparison and decodes its runs beside other requests' (engine/run/scheduler.py)."""
    lm, plan, encoded, store = ctx.lm, ctx.plan, ctx.encoded, ctx.store
    wanted = [a for a in REGISTRY if a in {str(x) for x in arms}]
    reads_modules = any(REGISTRY[a].reads == Reads.MODULES for a in wanted)
    if reads_modules:
        fetch_entries(plan, encoded, store)
    keep = tuple(used_keys(plan, encoded)) if reads_modules else ()
    decoder = Decoder(lm, together=decode == "together", parks=parks, pool=ctx.pool)
    dctx = replace(decoding(ctx, decoder), keep=keep)
    results = {}
    try:
        for a in wanted:
            results[a] = yield from arm_run(dctx, a)
        yield from decoder.rest()
    finally:
        decoder.close()  # a comparison stopped early gives its runs' leases back
    results = {a: replace(r, run=decoder.finish(r.run)) for a, r in results.items()}
    together = any(r.run.decode_batch > 1 for r in results.values())
    base = results.get(Arm.BASELINE)
    results = {a: r.with_agreement(base) for a, r in results.items()}
    for r in results.values():
        yield ArmDone(r)
    return Comparison(
        model=lm.name, device=lm.device, plan=plan, store=StoreSummary.of(encoded, store), sampling=ctx.sampling,
        arms=results, mode=encoded.mode, repair=dctx.settings_of("cached").repair if Arm.CACHED in wanted else 0,
        sink=encoded.sink, weights=lm.weights, decode="together" if together else "apart",
        prefill_kernel=lm.prefill.kernel)


def arm_run(ctx: DecodingContext, arm: str) -> RunEvents[ArmResult]:
    """Arm ``arm``'s run on ``ctx``: its events, then its result."""
    out = REGISTRY[Arm(arm)].run(ctx)
    return out if isinstance(out, ArmResult) else (yield from out)


def run_arm(ctx: ArmContext, arm: str) -> ArmResult:
    """Arm ``arm`` alone on ``ctx``, its events drained, its tokens decoded at once: what a benchmark times."""
    return finish(arm_run(decoding(ctx), arm))


def decoding(ctx: ArmContext, decoder: Decoder | None = None) -> DecodingContext:
    """``ctx`` as a DecodingContext whose runs decode through ``decoder`` (None: each at once)."""
    return DecodingContext(**{f.name: getattr(ctx, f.name) for f in fields(ArmContext)}, decoder=decoder)


def agreement(base: RunResult, other: RunResult) -> dict:
    """:meth:`Agreement.between` as the ``run --json`` keys."""
    a = Agreement.between(base, other)
    return {k: getattr(a, k) for k in Agreement.FIELDS}
