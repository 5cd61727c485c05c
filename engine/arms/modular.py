"""The modular-cache arm (``cached``): Prompt Cache's reuse — the imported modules' KV assembled at their
schema positions, only the uncached tokens prefilled; with ``repair`` K > 0 the link tokens are recomputed
(:func:`run_repaired`, after EPIC)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.arms.registry import Arm, ArmResult, ArmSettings, ArmSpec, DecodingContext, Reads, register, setting
from engine.arms.repair import select_repair
from engine.cache.assemble import (copy_list, copy_list_ranked, module_ranges, precomputed_tokens, prefilled,
                                   question_retention)
from engine.cache.encode import EncodedSchema
from engine.cache.store import ModuleStore
from engine.errors import EngineError
from engine.kv import KVBuffer
from engine.limits import MAX_REPAIR, Limit
from engine.model.attend import AttentionSpec
from engine.model.load import LoadedModel
from engine.model.positions import copied_positions, needs_positions
from engine.run.attention import ape_scale, check_recompute, rank_mask
from engine.run.batch import DecodeBatch
from engine.run.timing import Fill, timed_run
from engine.run.types import RunResult, Sampling, TokenFn
from engine.schema.plan import PromptPlan


@dataclass(frozen=True)
class ModularSettings(ArmSettings):
    """The modular arm's one setting: link tokens recomputed per link (0 = plain reuse)."""

    repair: int = setting(0, "repair", "Repair: link tokens recomputed (K)",
                          "a higher K brings answers closer to the baseline's where modules were encoded apart; each "
                          "module's K tokens are prefilled again, later first token (0 = off)",
                          limit=Limit("repair", 0, MAX_REPAIR, whole=True, example="4"), metavar="K",
                          how="link-token repair (EPIC's LegoLink): the first K tokens of every module that did not "
                              "see what precedes it, and after each argument, recomputed with the question")

    ape_t: float = setting(1.0, "ape_t", "APE: temperature T inside the modules",
                           "below 1 the answer leans harder on each document's strongest tokens; no time added "
                           "(modular and routed arms; T = S = 1 is off)",
                           limit=Limit("ape_t", 0.1, 1.0, example="0.9"), step=0.05, metavar="T",
                           how="APE at query time (arXiv 2502.05431): the attention inside the modules at "
                               "temperature T, with ape-s")
    ape_s: float = setting(1.0, "ape_s", "APE: scale S on the modules' attention",
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


def cached_arm(ctx: DecodingContext) -> ArmResult:
    s = ctx.settings_of("cached")
    return ArmResult(Arm.CACHED, run_cached(ctx.lm, ctx.plan, ctx.encoded, ctx.store, ctx.sampling, ctx.on_token,
                                            s.repair, ape=s.ape, batch=ctx.batch))


def run_cached(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
               sampling: Sampling = Sampling(), on_token: TokenFn | None = None, repair: int = 0,
               ape: tuple[float, float] | None = None, batch: DecodeBatch | None = None) -> RunResult:
    """Assemble the imported modules' KV into one buffer, prefill only the uncached tokens, decode.

    ``repair`` K > 0 recomputes K link tokens per link (:func:`run_repaired`). ``ape`` (T, S): the prefill and
    every decode step attend to the modules as APE does; None or (1, 1) is plain attention.
    """
    if repair:
        if ape:
            raise EngineError("APE cannot be combined with repair yet; set ape-t and ape-s to 1, or repair to 0")
        return run_repaired(lm, plan, encoded, store, sampling, on_token, repair, batch=batch)
    copies = copy_list(plan, encoded, store)
    scale = ape_scale(lm, module_ranges(plan, encoded, store), ape)
    retain = question_retention(plan, encoded)
    prefill = AttentionSpec(ape=scale, scorer=retain.capture if retain is not None else None)
    ids, pos = plan.uncached()
    # sliding windows and ALiBi need the cached keys' position ids (gapped), not their cache indices
    key_pos = copied_positions(copies, lm.n_layers) if needs_positions(lm.model) else None

    def fill(buf: KVBuffer) -> Fill:
        for span in copies:
            span.write_into(buf)
        return Fill(ids, pos, [s.entry for s in copies], reused_tokens=plan.cached_tokens,
                    precomputed_tokens=precomputed_tokens(copies), prefill=prefill, decode=AttentionSpec(ape=scale),
                    retain=retain, key_positions=key_pos)

    run, _ = timed_run(lm, "cached", plan.cached_tokens + len(ids) + sampling.max_new_tokens + 1, fill, sampling,
                       on_token, batch=batch)
    return run


def run_repaired(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
                 sampling: Sampling = Sampling(), on_token: TokenFn | None = None, k: int = 4,
                 first: bool | None = None, batch: DecodeBatch | None = None) -> RunResult:
    """The cached run with the link tokens :func:`engine.arms.repair.select_repair` picks recomputed (after EPIC)."""
    check_recompute(lm, "link-token repair", "set repair to 0")
    sel = select_repair(plan, k, encoded.mode, first)
    return run_recomputed(lm, plan, encoded, store, set(sel.ranks), sel.positions, sampling, on_token, batch=batch)


def run_recomputed(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, redo: set[int],
                   positions: tuple[int, ...], sampling: Sampling = Sampling(), on_token: TokenFn | None = None,
                   arm: str = "cached", batch: DecodeBatch | None = None) -> RunResult:
    """A cached run whose cached tokens of prompt ranks ``redo`` (at ``positions``) are left out of the buffer
    and prefilled with the uncached tokens, in prompt order (a rank mask): their fresh KV replaces the stored."""
    copies = copy_list_ranked(plan, encoded, store, redo)
    ids, pos, ranks = prefilled(plan, redo)

    def fill(buf: KVBuffer) -> Fill:
        for span in copies:
            span.write_into(buf)
        return Fill(ids, pos, [s.entry for s in copies], reused_tokens=plan.cached_tokens - len(redo),
                    precomputed_tokens=precomputed_tokens(copies), recomputed_positions=tuple(positions),
                    prefill=AttentionSpec(ranks=rank_mask(lm, copies, ranks)))

    run, _ = timed_run(lm, arm, plan.cached_tokens + plan.uncached_tokens + sampling.max_new_tokens + 1, fill,
                       sampling, on_token, batch=batch)
    return run


register(ArmSpec("cached", cached_arm, order=20, reads=Reads.MODULES, top_level_stem="", settings=ModularSettings,
                 default=True))
