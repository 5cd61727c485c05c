"""Blend: selective recompute of the cached tokens a full prefill would change most (after CacheBlend; docs/arms.md).

Inside TTFT: a **selection pass** (a full prefill's first layers), the ``ratio`` share of cached tokens chosen by
``rule``, then the modular run with those tokens prefilled with the uncached text in prompt order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from engine.arms.modular import ModularSettings, cached_run
from engine.arms.registry import (Arm, ArmResult, ArmSettings, ArmSpec, DecodingContext, Reads, RunEvents, register,
                                  setting)
from engine.arms.repair import select_repair
from engine.cache.assemble import (Span, buffer_ranks, copy_list_ranked, module_ranges, precomputed_tokens,
                                   prefilled)
from engine.cache.encode import EncodedSchema
from engine.cache.store import ModuleStore
from engine.errors import EngineError
from engine.kv import Lease
from engine.limits import Limit
from engine.model.attend import PLAIN, AttentionSpec
from engine.model.load import LoadedModel
from engine.run.attention import check_recompute, rank_mask
from engine.run.layers import decoder_layers, run_until
from engine.run.timing import Fill, timed_run
from engine.run.types import RunResult
from engine.schema.plan import PromptPlan

# rule -> what picks the recomputed tokens
RULES = {
    "deviation": "largest KV deviation at the check layer (the measured choice of K or V: DEVIATION_OF)",
    "deviation-k": "largest key deviation (after RoPE) at the check layer",
    "deviation-v": "largest value deviation at the check layer",
    "link": "the repair path's link tokens, the first tokens after every inexact link, round-robin",
    "question": "the tokens the uncached text attends to most at the check layer (over heads and queries)",
    "mixed": "the first 2 tokens of every link, then half by deviation and half by the question's attention",
    "random": "a seeded random choice (the control)",
}
DEVIATION_OF = "v"  # what "deviation" reads (CacheBlend's; docs/arms.md)
FRESH_EARLY = True  # the selection pass's early layers replace the stored KV
MIXED_LINK_TOKENS = 2  # tokens per link the mixed rule always takes


@dataclass(frozen=True)
class BlendSettings(ArmSettings):
    """The blend arm's settings (their one default each is here)."""

    ratio: float = setting(0.15, "blend", "Blend: share of cached tokens recomputed (R)",
                           "a larger share brings answers closer to the baseline's and the first token later (that "
                           "share of the cached tokens is prefilled again), e.g. 0.15",
                           limit=Limit("blend", 0.0, 1.0, meaning="a share of the cached tokens from 0 to 1",
                                       example="0.15"), step=0.05, widget_max=0.5, enables=True, metavar="R",
                           how="CacheBlend's selective recompute of this share of the cached tokens")
    rule: str = setting("deviation", "blend_rule", "Blend: which tokens",
                        "which cached tokens are recomputed: it changes which answers come back, not the time",
                        choices=tuple(RULES),
                        how="largest KV deviation at layer 1 (CacheBlend), link tokens, the question's attention, "
                            "a mix, or random (a control)")

    def check_with(self, config) -> None:
        if config.compression.at_run:
            raise EngineError("blend and question-aware retention cannot be combined yet (blend reorders the run's "
                              "buffer that question retention thins); leave blend out of the arms or pick another "
                              "compression")


@dataclass(frozen=True)
class BlendInfo:
    """How one blended run chose what to recompute."""

    ratio: float  # share of the cached tokens asked for
    rule: str
    check_layer: int
    ranks: tuple[int, ...]  # recomputed tokens' indices into plan.token_ids
    selection_ms: float  # inside TTFT
    fresh_early: bool  # layers 0..check_layer came from the selection pass

    def to_json(self) -> dict:
        return {"blend_ratio": self.ratio, "rule": self.rule, "check_layer": self.check_layer,
                "selection_ms": round(self.selection_ms, 3), "fresh_early": self.fresh_early}

    @classmethod
    def from_json(cls, data: dict) -> "BlendInfo":
        """Read back from run --json (``ranks`` are not kept there)."""
        return cls(ratio=data.get("blend_ratio", 0.0), rule=data.get("rule", ""), check_layer=data.get("check_layer", 1),
                   ranks=(), selection_ms=data.get("selection_ms", 0.0), fresh_early=bool(data.get("fresh_early")))


@dataclass(frozen=True)
class Probe:
    """A full prefill's KV of the first layers, in prompt order."""

    fresh: list[torch.Tensor]  # [check_layer + 1] x [2, kv_heads, prompt tokens, head_dim]
    question: torch.Tensor | None  # [prompt tokens]


# -- public API --

def blend_arm(ctx: DecodingContext) -> RunEvents[ArmResult]:
    run, info = yield from blend_run(ctx)
    return ArmResult(Arm("blend"), run, detail=info)


def blend_run(ctx: DecodingContext, settings: BlendSettings | None = None, *, check_layer: int = 1,
              fresh_early: bool | None = None, seed: int = 0) -> RunEvents[tuple[RunResult, BlendInfo]]:
    """The cached run with the ``ratio`` share of cached tokens recomputed, chosen by ``rule`` (``settings``,
    default the context's), and how it chose."""
    s = settings or ctx.settings_of("blend")
    lm, plan, encoded, store = ctx.lm, ctx.plan, ctx.encoded, ctx.store
    ratio, rule = s.ratio, s.rule
    fresh_early = FRESH_EARLY if fresh_early is None else fresh_early
    _check_args(lm, ratio, rule, check_layer)
    cached = cached_ranks(plan)
    n = round(ratio * len(cached))
    info = BlendInfo(ratio=ratio, rule=rule, check_layer=check_layer, ranks=(), selection_ms=0.0,
                     fresh_early=fresh_early)
    if n == 0:
        return (yield from cached_run(ctx, ModularSettings(), arm="blend")), info
    check_recompute(lm, "blend", "set blend to 0")
    decoder_layers(lm.model, "blend", "set blend to 0")
    ranges = module_ranges(plan, encoded, store)  # store lookups before TTFT
    chosen = info

    def fill(buf: Lease) -> Fill:
        nonlocal chosen
        t0 = time.perf_counter()
        if n < len(cached):
            probe = selection_pass(lm, plan, check_layer, question=rule in ("question", "mixed"))
            ranks = select_blend(plan, encoded.mode, probe, stored_at(ranges, check_layer), rule, n, seed)
        else:  # everything is recomputed: nothing to choose
            probe, ranks = None, tuple(cached)
        chosen = replace(info, ranks=ranks, selection_ms=(time.perf_counter() - t0) * 1000)
        return _recompute_fill(lm, plan, encoded, store, buf, ranks, probe if fresh_early else None)

    run = yield from timed_run(lm, "blend", plan.cached_tokens + plan.uncached_tokens, fill, ctx.sampling,
                               ctx.decoder)
    return run, chosen


def selection_pass(lm: LoadedModel, plan: PromptPlan, check_layer: int, question: bool = False) -> Probe:
    """Layers ``0..check_layer`` of a full prefill of ``plan``; with ``question``, the uncached tokens' attention."""
    ids = plan.token_ids
    pos = plan.positions
    model = lm.model
    # [check_layer + 1, 2, 1, kv_heads, prompt, head_dim]
    data = torch.empty(check_layer + 1, 2, 1, lm.kv_heads, len(ids), lm.head_dim, dtype=model.dtype,
                       device=lm.device)
    cache = Lease.private(data).cache()
    scorer = _QuestionAttention(check_layer, _uncached_ranks(plan)) if question else None
    with torch.inference_mode():
        run_until(lm, check_layer, "the blend selection pass", "set blend to 0",
                  input_ids=torch.tensor([ids], device=lm.device), position_ids=torch.tensor([pos], device=lm.device),
                  past_key_values=cache, use_cache=True, logits_to_keep=1,
                  attn_spec=PLAIN if scorer is None else AttentionSpec(scorer=scorer))
    return Probe(fresh=[data[i, :, 0] for i in range(check_layer + 1)],
                 question=None if scorer is None else scorer.total)


def stored_at(ranges: list[Span], layer: int) -> torch.Tensor:
    """Every cached token's stored KV at ``layer`` (dropped tokens zero): [2, kv_heads, cached, dim]."""
    return torch.cat([span.entry.layer_view(layer, span.start, span.end) for span in ranges], 2)


def deviations(probe: Probe, plan: PromptPlan, stored: torch.Tensor) -> torch.Tensor:
    """[2, cached] squared L2 of fresh minus stored K (row 0) and V (row 1) at the check layer."""
    fresh = probe.fresh[-1][:, :, torch.tensor(cached_ranks(plan), dtype=torch.long)].float()
    return (fresh - stored.to(fresh.device)).pow(2).sum(dim=(1, 3)).cpu()  # [2, cached]


def select_blend(plan: PromptPlan, mode: str, probe: Probe, stored: torch.Tensor, rule: str, n: int,
                 seed: int = 0) -> tuple[int, ...]:
    """``n`` distinct cached ranks (ascending) chosen by ``rule``."""
    cached = cached_ranks(plan)
    if rule == "random":
        order = torch.randperm(len(cached), generator=torch.Generator().manual_seed(seed))
        return tuple(sorted(cached[i] for i in order[:n].tolist()))
    if rule == "link":
        return tuple(sorted(link_tokens(plan, mode, n)))
    chosen: list[int] = []
    if rule == "mixed":
        chosen = link_tokens(plan, mode, n, per_link=MIXED_LINK_TOKENS)
    by_dev = _by_score(cached, deviations(probe, plan, stored)[_which(rule)]) if rule != "question" else []
    by_att = _by_score(cached, probe.question[torch.tensor(cached)]) if rule in ("question", "mixed") else []
    if rule == "mixed":
        _fill(chosen, by_dev, len(chosen) + (n - len(chosen) + 1) // 2)
    _fill(chosen, by_att or by_dev, n)
    return tuple(sorted(chosen))


def link_tokens(plan: PromptPlan, mode: str, n: int, per_link: int | None = None) -> list[int]:
    """``n`` cached ranks: each inexact link's first token, then second, ... (``per_link`` None: then the rest)."""
    chosen: list[int] = []
    prev: list[int] = []
    k = 0
    while len(chosen) < n and (per_link is None or k < per_link):
        k += 1
        now = list(select_repair(plan, k, mode).ranks)
        if now == prev:
            break
        _fill(chosen, sorted(set(now) - set(prev)), n)
        prev = now
    if per_link is None:
        _fill(chosen, cached_ranks(plan), n)
    return chosen[:n]


def cached_ranks(plan: PromptPlan) -> list[int]:
    """Prompt ranks of the cached tokens."""
    return [r for at in plan.placed() if at.cached for r in at.ranks]


# -- internal helpers --

class _QuestionAttention:
    """At one layer of the selection pass, the attention the uncached tokens pay every key, summed."""

    def __init__(self, layer: int, queries: list[int]):
        self.layer = layer
        self.queries = torch.tensor(queries, dtype=torch.long)
        self.total: torch.Tensor | None = None  # [prompt tokens]

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        if layer != self.layer:
            return
        _, heads, _, dim = query.shape
        kv_heads, n = key.shape[1], key.shape[2]
        u = self.queries.to(query.device)
        q = query[0, :, u].float().reshape(kv_heads, heads // kv_heads * u.shape[0], dim)
        att = torch.matmul(q, key[0].float().transpose(-1, -2)) * (scaling or dim ** -0.5)
        att = att.view(kv_heads, heads // kv_heads, u.shape[0], n)
        causal = torch.arange(n, device=query.device)[None, :] <= u[:, None]  # [queries, keys]
        self.total = att.masked_fill(~causal, float("-inf")).softmax(-1).sum(dim=(0, 1, 2)).cpu()


def _recompute_fill(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, buf: Lease,
                    ranks: tuple[int, ...], fresh: "Probe | None") -> Fill:
    """Fill ``buf`` to recompute ``ranks`` in prompt order; ``fresh``'s early layers over the stored KV."""
    redo = set(ranks)
    copies = copy_list_ranked(plan, encoded, store, redo)
    ids, pos, order = prefilled(plan, redo)
    for span in copies:
        span.write_into(buf)
    if fresh is not None:
        in_buffer = buffer_ranks(copies, lm.n_layers)
        for layer, kv in enumerate(fresh.fresh):
            r = in_buffer[layer]
            buf.overwrite(layer, kv[:, :, r.to(kv.device)])
    positions = plan.positions
    return Fill(ids, pos, [s.entry for s in copies], reused_tokens=plan.cached_tokens - len(ranks),
                precomputed_tokens=precomputed_tokens(copies), recomputed_positions=tuple(positions[r] for r in ranks),
                prefill=AttentionSpec(ranks=rank_mask(lm, copies, order)))


def _check_args(lm: LoadedModel, ratio: float, rule: str, check_layer: int) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise EngineError(f"blend ratio must be a share of the cached tokens from 0 to 1 (got {ratio!r}); "
                          "e.g. 0.15 recomputes 15 %")
    if rule not in RULES:
        raise EngineError(f"unknown blend rule '{rule}'; use one of: {', '.join(RULES)}")
    if isinstance(check_layer, bool) or not isinstance(check_layer, int) or not 1 <= check_layer < lm.n_layers:
        raise EngineError(f"blend check layer must be a layer index from 1 to {lm.n_layers - 1} (got {check_layer!r}); "
                          "1 is CacheBlend's choice")


def _uncached_ranks(plan: PromptPlan) -> list[int]:
    return [r for at in plan.placed() if not at.cached for r in at.ranks]


def _which(rule: str) -> int:
    """Row of :func:`deviations` a rule reads: 0 keys, 1 values."""
    of = {"deviation-k": "k", "deviation-v": "v"}.get(rule, DEVIATION_OF)
    return 0 if of == "k" else 1


def _by_score(ranks: list[int], score: torch.Tensor) -> list[int]:
    """``ranks`` by descending ``score`` (ties by rank)."""
    order = torch.sort(score.float(), descending=True, stable=True).indices.tolist()
    return [ranks[i] for i in order]


def _fill(chosen: list[int], candidates: list[int], n: int) -> None:
    """Append new candidates until ``chosen`` holds ``n``."""
    have = set(chosen)
    for r in candidates:
        if len(chosen) >= n:
            return
        if r not in have:
            chosen.append(r)
            have.add(r)


register(ArmSpec("blend", blend_arm, order=30, reads=Reads.MODULES, settings=BlendSettings, detail=BlendInfo))
