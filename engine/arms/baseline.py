"""The baseline arm: one ordinary prefill of the whole prompt (nothing reused, nothing stored)."""

from __future__ import annotations

from engine.arms.registry import Arm, ArmResult, ArmSpec, DecodingContext, Reads, RunEvents, register
from engine.run.timing import Fill, timed_run
from engine.run.types import RunResult


def baseline_arm(ctx: DecodingContext) -> RunEvents[ArmResult]:
    return ArmResult(Arm.BASELINE, (yield from baseline_run(ctx)))


def baseline_run(ctx: DecodingContext, arm: str = "baseline") -> RunEvents[RunResult]:
    """One ordinary prefill of the whole materialised prompt at contiguous positions, then decode."""
    ids = list(ctx.plan.token_ids)
    return (yield from timed_run(ctx.lm, arm, len(ids), lambda lease: Fill(ids, list(range(len(ids))), copies=False),
                                 ctx.sampling, ctx.decoder))


register(ArmSpec("baseline", baseline_arm, order=0, reads=Reads.NOTHING, default=True))
