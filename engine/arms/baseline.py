"""The baseline arm: one ordinary prefill of the whole prompt (nothing reused, nothing stored)."""

from __future__ import annotations

from engine.arms.registry import Arm, ArmResult, ArmSpec, DecodingContext, Reads, register
from engine.model.load import LoadedModel
from engine.run.batch import DecodeBatch
from engine.run.timing import Fill, timed_run
from engine.run.types import RunResult, Sampling, TokenFn
from engine.schema.plan import PromptPlan


def baseline_arm(ctx: DecodingContext) -> ArmResult:
    return ArmResult(Arm.BASELINE, run_baseline(ctx.lm, ctx.plan, ctx.sampling, ctx.on_token, ctx.batch))


def run_baseline(lm: LoadedModel, plan: PromptPlan, sampling: Sampling = Sampling(),
                 on_token: TokenFn | None = None, batch: DecodeBatch | None = None) -> RunResult:
    """One ordinary prefill of the whole materialised prompt at contiguous positions, then decode."""
    ids = list(plan.token_ids)
    run, _ = timed_run(lm, "baseline", len(ids) + sampling.max_new_tokens + 1,
                       lambda buf: Fill(ids, list(range(len(ids))), copies=False), sampling, on_token, batch=batch)
    return run


register(ArmSpec("baseline", baseline_arm, order=0, reads=Reads.NOTHING, default=True))
