"""The prefix-cache arm, as serving engines do: reuse the longest cached token prefix, prefill the rest, store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Sequence

import torch

from engine.arms.registry import Arm, ArmResult, ArmSpec, DecodingContext, Reads, RunEvents, register
from engine.cache.assemble import token_place
from engine.cache.prefix import Held, PrefixCache
from engine.errors import EngineError
from engine.kv import KVPool, Lease, lease_tokens
from engine.model.load import LoadedModel
from engine.run import forward
from engine.run.decode import Room, take_lease
from engine.run.pools import pool_of
from engine.run.timing import Fill, timed_run
from engine.run.types import RunResult


@dataclass(frozen=True)
class PrefixReuse:
    """How a prefix-arm run used the prefix cache."""

    reused_tokens: int  # leading prompt tokens taken from the cache
    repeat: bool  # the whole prompt was cached; its last token is prefilled for its logits
    stopped_at: dict  # the first prefilled token: {"token", "source", "owner"}
    held: Held  # what the cache held before this run
    stored_tokens: int = 0  # tokens this run added to the cache
    prefilled_tokens: int = 0

    def to_json(self) -> dict:
        return {"prefilled_tokens": self.prefilled_tokens, "reused_tokens": self.reused_tokens,
                "repeat": self.repeat, "stopped_at": self.stopped_at, "warmed_with": self.warmed_with,
                "stored_tokens": self.stored_tokens}

    @property
    def warmed_with(self) -> dict:
        """``held`` as run --json writes it; its ``summary`` sentence is that field's, kept for its readers."""
        return {"summary": _summary(self.held), **self.held.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "PrefixReuse":
        return cls(reused_tokens=data.get("reused_tokens", 0), repeat=bool(data.get("repeat")),
                   stopped_at=data.get("stopped_at") or {}, held=Held.from_json(data.get("warmed_with") or {}),
                   stored_tokens=data.get("stored_tokens", 0), prefilled_tokens=data.get("prefilled_tokens", 0))


def _summary(held: Held) -> str:
    """run --json's ``warmed_with.summary`` (a contract field; the front ends write their own words)."""
    parts = []
    if held.warmup is not None:
        n = len(held.warmup.modules)
        parts.append(f"schema-order warm-up ({n} module{'s' if n != 1 else ''}, {held.warmup.tokens} tokens)")
    if held.other_schemas_warmed:
        others = held.other_schemas_warmed
        parts.append(f"{others} other schema warm-up{'s' if others != 1 else ''}")
    parts.append(f"{held.earlier_runs} earlier run{'s' if held.earlier_runs != 1 else ''}")
    return " + ".join(parts)


def prefix_arm(ctx: DecodingContext) -> RunEvents[ArmResult]:
    if ctx.prefix is None:
        raise EngineError("the prefix arm needs a prefix cache (Engine.compare makes one per storage device)")
    run, reuse = yield from prefix_run(ctx)
    return ArmResult(Arm.PREFIX, run, detail=reuse, repeat=reuse.repeat)


def prefix_run(ctx: DecodingContext, insert: bool = True) -> RunEvents[tuple[RunResult, PrefixReuse]]:
    """Reuse the longest cached prefix of ``ctx.prefix``, prefill, decode; then store the prompt (never evicting
    ``ctx.keep``) unless ``insert`` is False."""
    plan, prefix, sampling = ctx.plan, ctx.prefix, ctx.sampling
    ids = list(plan.token_ids)
    held = prefix.held(plan.layout.fingerprint)
    match = prefix.match(ids, limit=len(ids) - 1)
    k = match.reused
    stored = [0]

    def store(lease: Lease, first: RunResult) -> None:  # the prompt's KV, once its first token is out
        stored[0] = prefix.insert(ids, lease.data[:, :, 0], list(ctx.keep), run=True) if insert else 0

    run = yield from timed_run(ctx.lm, "prefix", len(ids), lambda lease: match_fill(ids, match, lease), sampling,
                               ctx.decoder, after=store)
    reuse = PrefixReuse(reused_tokens=k, repeat=match.whole, stopped_at=token_place(plan, k),
                        held=held, stored_tokens=stored[0], prefilled_tokens=run.prefill_tokens)
    return run, reuse


def match_fill(ids: list[int], match, lease: Lease) -> Fill:
    """``lease`` holding the tree's KV of ``match`` (the first tokens of ``ids``), the rest of ``ids`` to prefill after
    it at contiguous positions, as the baseline numbers them."""
    for entry, a, b in match.pieces:
        entry.write_into(lease, a, b)
    k = match.reused
    return Fill(ids[k:], list(range(k, len(ids))), [e for e, *_ in match.pieces], reused_tokens=k)


def warm_prefix(lm: LoadedModel, prefix: PrefixCache, token_ids: tuple[int, ...] | list[int],
                keep: Sequence[str] = (), pool: KVPool | None = None) -> Generator[Room, None, int]:
    """Prefill and store ``token_ids`` (in a lease of ``pool``, default the model's); the tokens stored."""
    ids = list(token_ids)
    match = prefix.match(ids, limit=len(ids) - 1)
    lease = yield from take_lease(pool or pool_of(lm), lease_tokens(len(ids), 0))
    try:
        work = match_fill(ids, match, lease)
        with torch.inference_mode():
            forward.prefill(lm, lease, work.ids, work.pos, graphable=False)
        return prefix.insert(ids, lease.data[:, :, 0], list(keep))
    finally:
        lease.release()


register(ArmSpec("prefix", prefix_arm, order=10, reads=Reads.PREFIX_CACHE, detail=PrefixReuse, default=True))
