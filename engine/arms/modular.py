"""The modular-cache arm (``cached``): Prompt Cache's reuse — the imported modules' KV assembled at their
schema positions, only the uncached tokens prefilled; with ``repair`` K > 0 the link tokens are recomputed
(:func:`repaired_run`, after EPIC)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.arms.registry import (Arm, ArmResult, ArmSettings, ArmSpec, DecodingContext, Reads, RunEvents, register,
                                  setting)
from engine.arms.repair import select_repair
from engine.cache.assemble import (copy_list, copy_list_ranked, module_ranges, precomputed_tokens, prefilled,
                                   question_retention)
from engine.errors import EngineError
from engine.kv import Lease
from engine.limits import MAX_REPAIR, Limit
from engine.model.attend import AttentionSpec
from engine.model.positions import copied_positions, needs_positions
from engine.run.attention import ape_scale, check_recompute, rank_mask
from engine.run.timing import Fill, timed_run
from engine.run.types import RunResult


@dataclass(frozen=True)
class ModularSettings(ArmSettings):
    """The modular arm's one setting: link tokens recomputed per link (0 = plain reuse)."""

    repair: int = setting(0, "repair", "Repair: link tokens recomputed (K)",
                          "a higher K brings answers closer to the baseline's where modules were encoded apart; each "
                          "module's K tokens are prefilled again, later first token (0 = off)",
                          limit=Limit("repair", 0, MAX_REPAIR, whole=True, example="4"), metavar="K",
                          how="link-token repair (EPIC's LegoLink): the first K tokens of every module that did not "
                              "see what precedes it, and after each argument, recomputed with the question")

    ape_t: float = setting(1.0, "ape_t", "Modular cache: sharpness inside the modules (T)",
                           "below 1 the answer leans harder on each document's strongest tokens; no time added "
                           "(modular and routed arms; T = S = 1 is off)",
                           limit=Limit("ape_t", 0.1, 1.0, example="0.9"), step=0.05, metavar="T",
                           how="APE at query time (arXiv 2502.05431): the attention inside the modules at "
                               "temperature T, with ape-s")
    ape_s: float = setting(1.0, "ape_s", "Modular cache: weight of the modules (S)",
                           "below 1 the answer weighs the documents less against the system text and the question; "
                           "no time added (T = S = 1 is off)",
                           limit=Limit("ape_s", 0.1, 1.0, example="0.9"), step=0.05, metavar="S",
                           how="APE, with ape-t: the modules' share of the attention scaled by S (log-sum-exp "
                               "times S·T)")

    @property
    def ape(self) -> tuple[float, float] | None:
        """(T, S) when APE is on, else None."""
        return None if (self.ape_t, self.ape_s) == (1.0, 1.0) else (self.ape_t, self.ape_s)

    def check_with(self, config) -> None:
        if self.ape and (self.repair or config.compression.at_run):
            raise EngineError("APE cannot be combined with repair or question-aware retention yet (both change the "
                              "buffer whose modules APE scales); set ape-t and ape-s to 1, or repair to 0 and pick "
                              "another compression")
        if self.repair and config.compression.at_run:
            raise EngineError("repair and question-aware retention cannot be combined yet (repair reorders the run's "
                              "buffer that question retention thins); set repair to 0 or pick another compression")


def cached_arm(ctx: DecodingContext) -> RunEvents[ArmResult]:
    return ArmResult(Arm.CACHED, (yield from cached_run(ctx)))


def cached_run(ctx: DecodingContext, settings: ModularSettings | None = None,
               arm: str = "cached") -> RunEvents[RunResult]:
    """Assemble the imported modules' KV into one buffer, prefill only the uncached tokens, decode, as ``settings``
    (default: the context's) say.

    ``repair`` K > 0 recomputes K link tokens per link (:func:`repaired_run`). ``ape`` (T, S): the prefill and
    every decode step attend to the modules as APE does; (1, 1) is plain attention.
    """
    s = settings or ctx.settings_of("cached")
    if s.repair:
        if s.ape:
            raise EngineError("APE cannot be combined with repair yet; set ape-t and ape-s to 1, or repair to 0")
        return (yield from repaired_run(ctx, s.repair, arm=arm))
    lm, plan, encoded, store = ctx.lm, ctx.plan, ctx.encoded, ctx.store
    copies = copy_list(plan, encoded, store)
    scale = ape_scale(lm, module_ranges(plan, encoded, store), s.ape)
    retain = question_retention(plan, encoded)
    prefill = AttentionSpec(ape=scale, scorer=retain.capture if retain is not None else None)
    ids, pos = plan.uncached()
    # sliding windows and ALiBi need the cached keys' position ids (gapped), not their cache indices
    key_pos = copied_positions(copies, lm.n_layers) if needs_positions(lm.model) else None

    def fill(lease: Lease) -> Fill:
        for span in copies:
            span.write_into(lease)
        return Fill(ids, pos, [s.entry for s in copies], reused_tokens=plan.cached_tokens,
                    precomputed_tokens=precomputed_tokens(copies), prefill=prefill, decode=AttentionSpec(ape=scale),
                    retain=retain, key_positions=key_pos)

    return (yield from timed_run(lm, arm, plan.cached_tokens + len(ids), fill, ctx.sampling, ctx.decoder))


def repaired_run(ctx: DecodingContext, k: int = 4, first: bool | None = None,
                 arm: str = "cached") -> RunEvents[RunResult]:
    """The cached run with the link tokens :func:`engine.arms.repair.select_repair` picks recomputed (after EPIC)."""
    check_recompute(ctx.lm, "link-token repair", "set repair to 0")
    sel = select_repair(ctx.plan, k, ctx.encoded.mode, first)
    return (yield from recomputed_run(ctx, set(sel.ranks), sel.positions, arm))


def recomputed_run(ctx: DecodingContext, redo: set[int], positions: tuple[int, ...],
                   arm: str = "cached") -> RunEvents[RunResult]:
    """A cached run whose cached tokens of prompt ranks ``redo`` (at ``positions``) are left out of the buffer
    and prefilled with the uncached tokens, in prompt order (a rank mask): their fresh KV replaces the stored."""
    lm, plan = ctx.lm, ctx.plan
    copies = copy_list_ranked(plan, ctx.encoded, ctx.store, redo)
    ids, pos, ranks = prefilled(plan, redo)

    def fill(lease: Lease) -> Fill:
        for span in copies:
            span.write_into(lease)
        return Fill(ids, pos, [s.entry for s in copies], reused_tokens=plan.cached_tokens - len(redo),
                    precomputed_tokens=precomputed_tokens(copies), recomputed_positions=tuple(positions),
                    prefill=AttentionSpec(ranks=rank_mask(lm, copies, ranks)))

    return (yield from timed_run(lm, arm, plan.cached_tokens + plan.uncached_tokens, fill, ctx.sampling, ctx.decoder))


register(ArmSpec("cached", cached_arm, order=20, reads=Reads.MODULES, top_level_stem="", settings=ModularSettings,
                 default=True))
