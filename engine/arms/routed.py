"""Question-routed reuse (``routed``): the question picks the modules it reads (docs/arms.md).

A **scout** prefills the uncached tokens over every module's stored KV through the first layers and measures
each module's **pull** (the strongest attention any head of a new token pays one of its keys); the modules
whose pull reaches the threshold stay, and the run prefills and decodes over them as the modular arm does.
"""

from __future__ import annotations

import time
from functools import partial
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from engine.arms.prefix import match_fill
from engine.arms.registry import (Arm, ArmResult, ArmSettings, ArmSpec, DecodingContext, Reads, RunEvents, register,
                                  setting)
from engine.cache.assemble import Span, fresh_tokens, module_ranges, precomputed_tokens, slot_owners, used_keys
from engine.cache.encode import EncodedSchema
from engine.cache.prefix import PrefixCache
from engine.cache.store import ModuleStore
from engine.errors import EngineError
from engine.kv import Lease, lease_tokens
from engine.limits import Limit
from engine.model.attend import AttentionSpec, Focus, attention_weights
from engine.model.load import LoadedModel
from engine.run.attention import ape_scale, check_recompute
from engine.run.joint import keep_run, module_ranks, recall, recompute_fill, run_key, select_tokens
from engine.run.layers import run_until
from engine.run.timing import Fill, timed_run
from engine.run.types import Routing, RunResult
from engine.run.decode import take_lease
from engine.run.events import finish
from engine.run.pools import pool_of
from engine.schema.plan import PromptPlan

# Each default's split and figures: docs/arms.md (routed) and bench/results/.
SCOUT_LAYERS = (6, 7, 8, 9, 10, 11)  # decoder layers the scout reads (bench/routing.py)
MIN_PULL = 0.95  # the pull a module needs to stay
DEFAULT_K = 0  # 0: keep by the threshold; K > 0: the K strongest
DEFAULT_FOCUS = "clause"  # decode steps read the module the answer named last, until its clause ends
FOCUSES = ("on", "clause", "off")
FOCUS_MARGIN = 0.2  # a token names a module when its pull there leads the others' by this
DEFAULT_JOINT = "on"  # two or more kept modules are prefilled together
DEFAULT_SHARE = 0.3  # ... the share of their tokens the question reads most (1: all of them)
DEFAULT_SINKS = 4  # ... and each one's first tokens (EPIC's attention sinks)
DEFAULT_TREE = "on"  # every module kept and in the prefix tree: read the full prefill's own KV from there
PATHS = ("stored", "partial", "full", "repeat", "tree")  # how a run read its kept modules (Routing.path)


@dataclass(frozen=True)
class RoutedSettings(ArmSettings):
    """The routed arm's settings (their one default each is here)."""

    k: int = setting(DEFAULT_K, "route_k", "Routed: modules kept (top k)",
                     "fewer modules read, a sooner first token; an answer that needs a module left out loses it "
                     "(0: every module the question pulls strongly enough)",
                     limit=Limit("route_k", 0, 256, whole=True, example="2"), metavar="K",
                     how="top-k routing: the k modules the question's attention pulls hardest (see route-min-pull)")
    min_pull: float = setting(MIN_PULL, "route_min_pull", "Routed: pull a module needs (0-1)",
                              "higher: fewer modules read, a sooner first token and a greater risk of missing the "
                              "one the answer needs; when no module reaches it, all are read", limit=Limit(
                                  "route_min_pull", 0.0, 1.0, meaning="an attention weight from 0 to 1", example="0.95"),
                              step=0.01, metavar="P",
                              how="the attention some head of the question puts on one key of the module")

    joint: str = setting(DEFAULT_JOINT, "route_joint", "Routed: recompute kept modules together",
                         "on: modules kept together are prefilled together, answers closer to the baseline's on "
                         "questions that span them, a later first token; off: read as stored, sooner",
                         choices=("on", "off"),
                         how="with two or more modules kept (two reached the pull, or none did and all stay), their "
                             "tokens prefilled together in prompt order, as a full prefill does")
    share: float = setting(DEFAULT_SHARE, "route_share", "Routed: share of kept modules recomputed (R)",
                           "a larger share brings answers closer to the baseline's when two or more modules are "
                           "kept, and the first token later; 1 prefills them all, as a full prefill",
                           limit=Limit("route_share", 0.0, 1.0, meaning="a share of the kept modules' tokens from 0 "
                                       "to 1", example="0.2"), step=0.05, metavar="R",
                           how="with joint on: the kept tokens the question attends to most at the scout's layers "
                               "(half of the share spread over every kept module), the rest read as stored")
    sinks: int = setting(DEFAULT_SINKS, "route_sinks", "Routed: first tokens recomputed per kept module",
                         "with a share under 1: K more tokens per kept module prefilled again, a little later first "
                         "token, answers closer to the baseline's",
                         limit=Limit("route_sinks", 0, 64, whole=True, example="4"), metavar="K",
                         how="each kept module's first K tokens: the attention sinks a module encoded alone holds "
                             "(EPIC)")
    tree: str = setting(DEFAULT_TREE, "route_tree", "Routed: read every-module KV from the prefix tree",
                        "on: when every module is kept and an earlier run left the prompt through its last module, "
                        "the answer is the full prefill's at a fraction of its time; off: recompute as the share says",
                        choices=("on", "off"),
                        how="the prefix tree's KV (the schema-order warm-up, an earlier prefix run), the full "
                            "prefill's own, read; only the rest prefilled")
    focus: str = setting(DEFAULT_FOCUS, "route_focus", "Routed: focus while decoding",
                         "with two or more modules kept: facts from different modules mix less in the answer, "
                         "decoding a little faster (on: when read as stored; clause: also when partly recomputed, "
                         "until the answer ends that clause; off: never)", choices=FOCUSES,
                         how="each decode step reads only the module the answer named last")

    def check_with(self, config) -> None:
        if config.compression.at_run:
            raise EngineError("routing and question-aware retention cannot be combined yet (retention marks the "
                              "tokens of a buffer routing rebuilds); leave routed out of the arms or pick another "
                              "compression")


@dataclass(frozen=True)
class Scouted:
    """What the scout saw: per scout layer, each module's pull."""

    modules: tuple[str, ...]  # routable (top-level) modules, in prompt order
    layers: tuple[int, ...]
    pull: torch.Tensor  # [layers, modules]
    mass: torch.Tensor  # [layers, modules]: attention summed over heads and new tokens
    others: torch.Tensor  # [layers]: the pull of text never routed
    by_token: torch.Tensor | None = None  # [new tokens, modules]: each token's pull
    by_key: torch.Tensor | None = None  # [cached slots]: attention paid by the new tokens, over heads and layers

    def strength(self) -> torch.Tensor:
        """Peak pull per module."""
        return self.pull.amax(0)

    def shares(self) -> dict[str, float]:
        """Each module's share of the summed pull."""
        total = self.strength()
        total = total / total.sum().clamp(min=1e-30)
        return {m: float(s) for m, s in zip(self.modules, total)}


@dataclass(frozen=True)
class RoutedInfo(Routing):
    """How one routed run chose what to read."""

    k: int = DEFAULT_K
    min_pull: float = MIN_PULL
    attention: dict[str, float] = field(default_factory=dict)  # module -> its share of the pull
    layers: tuple[int, ...] = ()
    scout_ms: float = 0.0  # inside TTFT
    pull: dict[str, float] = field(default_factory=dict)  # module -> its pull, 0..1
    focus: str = DEFAULT_FOCUS
    moves: tuple[tuple[int, str], ...] = ()  # (decode step, module) each time the focus moved ("": a clause ended)
    joint: tuple[str, ...] = ()  # modules prefilled together
    share: float = DEFAULT_SHARE
    sinks: int = DEFAULT_SINKS
    repeat_tokens: int = 0  # tokens read back from an identical earlier request (path "repeat")

    def to_json(self) -> dict:
        return {"route_k": self.k, "route_min_pull": self.min_pull, "route_kept": list(self.kept),
                "route_attention": {m: round(s, 4) for m, s in self.attention.items()},
                "route_layers": list(self.layers), "scout_ms": round(self.scout_ms, 3),
                "route_pull": {m: round(v, 4) for m, v in self.pull.items()}, "route_focus": self.focus,
                "route_focus_moves": [list(m) for m in self.moves], "route_joint": list(self.joint),
                "route_path": self.path, "route_recomputed_tokens": self.recomputed, "route_share": self.share,
                "route_sinks": self.sinks, "route_repeat_tokens": self.repeat_tokens}

    @classmethod
    def from_json(cls, data: dict) -> "RoutedInfo":
        kept, attention = tuple(data.get("route_kept") or ()), dict(data.get("route_attention") or {})
        return cls(k=data.get("route_k", DEFAULT_K), min_pull=data.get("route_min_pull", MIN_PULL), kept=kept,
                   dropped=tuple(m for m in attention if m not in kept), attention=attention,
                   layers=tuple(data.get("route_layers") or ()), scout_ms=data.get("scout_ms", 0.0),
                   pull=dict(data.get("route_pull") or {}), focus=data.get("route_focus", "off"),
                   moves=tuple((int(a), str(b)) for a, b in data.get("route_focus_moves") or ()),
                   joint=tuple(data.get("route_joint") or ()), path=data.get("route_path", "stored"),
                   recomputed=data.get("route_recomputed_tokens", 0), share=data.get("route_share", 1.0),
                   sinks=data.get("route_sinks", 0), repeat_tokens=data.get("route_repeat_tokens", 0))


@dataclass(frozen=True)
class _Choice:
    """What a routed fill chose inside TTFT."""

    seen: Scouted | None
    kept: tuple[str, ...]
    ms: float  # choosing, inside TTFT
    joint: tuple[str, ...]  # modules prefilled together
    path: str
    focus: Focus | None = None  # its ``changes`` fill in while decoding
    slots: list[int] | None = None  # each buffer slot's prompt rank, when the run can be kept for a repeat
    positions: range | None = None  # each rank's position id, when not the plan's (the tree path's)


# -- public API --

def routed_arm(ctx: DecodingContext) -> RunEvents[ArmResult]:
    run, info = yield from routed_run(ctx)
    return ArmResult(Arm("routed"), run, detail=info, repeat=info.path == "repeat")


def routed_run(ctx: DecodingContext, settings: RoutedSettings | None = None, *, keep: set[str] | None = None,
               layers: tuple[int, ...] = SCOUT_LAYERS) -> RunEvents[tuple[RunResult, RoutedInfo]]:
    """The modular run reading the modules the question routes to, and how it chose (``settings``: default the
    context's); ``keep`` forces the kept modules (the oracle); the modular arm's APE (T, S) scales their attention;
    ``ctx.prefix`` keeps runs for a repeat (joint.py) and, with ``tree`` on, serves an every-module question."""
    lm, plan, encoded, store, prefix = ctx.lm, ctx.plan, ctx.encoded, ctx.store, ctx.prefix
    s = settings or ctx.settings_of("routed")
    ape = ctx.settings_of("cached").ape  # APE is the modular arm's setting
    check_recompute(lm, "routing", "leave routed out of the arms")
    ranges = module_ranges(plan, encoded, store)  # store lookups before TTFT
    modules = tuple(dict.fromkeys(r.module for r in ranges if r.module is not None))
    ids, pos = plan.uncached()
    layers = tuple(sorted({x % lm.n_layers for x in layers}))
    key = None if prefix is None or keep is not None else run_key(
        plan, encoded, (s.k, s.min_pull, layers, ape, s.focus, s.joint, s.share, s.sinks, s.tree))
    if (hit := recall(prefix, key)) is not None:  # before TTFT, as the prefix arm's match
        return (yield from _repeat(ctx, *hit, plan.prompt_tokens - fresh_tokens(ranges)))
    whole = tree_match(prefix, plan) if s.tree == "on" and s.joint == "on" and keep is None else None
    ends = clause_ends(lm.tokenizer) if s.focus == "clause" else frozenset()  # before TTFT: once per tokenizer

    def choose_and_fill(buf: Lease) -> tuple[Fill, _Choice]:
        t0 = time.perf_counter()
        for span in ranges:
            span.write_into(buf)
        seen = scout(lm, buf, ranges, ids, pos, layers) if keep is None and modules else None
        kept = tuple(m for m in modules if keep is None or m in keep) if seen is None else choose(seen, s.k, s.min_pull)
        if whole is not None and seen is not None and 2 <= len(kept) == len(modules):
            return _tree_fill(plan, whole, buf, ranges, _Choice(seen, kept, _ms(t0), (), "tree"))
        together = kept if s.joint == "on" and seen is not None and len(kept) >= 2 else ()
        together, redo, drop, path = _recompute(plan, modules, kept, together, seen, s.share, s.sinks)
        choice = _Choice(seen, kept, _ms(t0), together, path)
        buf.reset()  # rebuilt: only what stays visible
        if together:
            work, slots = recompute_fill(lm, plan, encoded, store, buf, redo, drop)
            owners = _joint_owners(plan, kept, slots) if s.focus == "clause" and path == "partial" else None
            focused = _focus(owners, kept, modules, seen, ids, s.min_pull, ends)
            return replace(work, decode=AttentionSpec(focus=focused)), replace(choice, slots=slots, focus=focused)
        return _stored_fill(lm, plan, ranges, buf, choice, s.focus != "off", ape, s.min_pull, ends)

    chosen: list[_Choice] = []
    info = partial(_info, s=s, layers=layers if keep is None else (), modules=modules)
    stored = partial(_keep_for_repeat, ctx, key, chosen, ranges, info) if key is not None else None
    run = yield from timed_run(lm, "routed", plan.cached_tokens + len(ids), _recording(choose_and_fill, chosen),
                               ctx.sampling, ctx.decoder, after=stored)
    return run, info(chosen[-1], recomputed=run.recomputed_tokens)  # after its decode: the focus's moves


def _keep_for_repeat(ctx: DecodingContext, key: int, chosen: list[_Choice], ranges: list[Span], info,
                     lease: Lease, first: RunResult) -> None:
    """After TTFT, as the prefix arm's insert: the run's KV and choice kept for an identical request (joint.py)."""
    choice = chosen[-1]
    if choice.slots is not None:
        keep_run(ctx.prefix, key, ctx.plan, lease, choice.slots, [r.entry for r in ranges],
                 info(choice, recomputed=first.recomputed_tokens), list(ctx.keep) + used_keys(ctx.plan, ctx.encoded),
                 positions=choice.positions, logits=first.first_logits, focus=choice.focus)


def _recording(fill: Callable[[Lease], tuple[Fill, _Choice]], chosen: list[_Choice]) -> Callable[[Lease], Fill]:
    """``fill`` as timed_run takes it; what it chose goes to ``chosen``."""
    def recorded(buf: Lease) -> Fill:
        work, choice = fill(buf)
        chosen.append(choice)
        return work
    return recorded


def _recompute(plan: PromptPlan, modules: tuple[str, ...], kept: tuple[str, ...], together: tuple[str, ...],
               seen: Scouted | None, share: float, sinks: int) -> tuple[tuple[str, ...], set[int], set[int], str]:
    """(modules recomputed together, ranks recomputed, ranks left out, path) of the routing's choice."""
    per = module_ranks(plan, set(modules))
    every = {r for m in together for r in per[m]}
    picked = select_tokens(plan, seen.by_key, together, share, sinks) if together else ()
    if picked == ():  # nothing to recompute: read as stored
        return (), set(), set(), "stored"
    redo = every if picked is None else set(picked)  # None: no score per token, all of them
    drop = {r for m, rs in per.items() if m not in kept for r in rs}
    return together, redo, drop, "partial" if len(redo) < len(every) else "full"


def tree_match(prefix: PrefixCache | None, plan: PromptPlan):
    """The prefix tree's match of the prompt's tokens when it reaches past the prompt's last module token, else None.
    That KV is the full prefill's own (contiguous positions), so reading it is exact where a recompute is not."""
    if prefix is None:
        return None
    ids = list(plan.token_ids)
    end = max((at.ranks.stop for at in plan.placed() if at.cached), default=0)
    match = prefix.match(ids, limit=len(ids) - 1)
    return match if end and match.reused >= end else None


def _tree_fill(plan: PromptPlan, match, buf: Lease, ranges: list[Span], choice: _Choice) -> tuple[Fill, _Choice]:
    """``buf`` emptied, then holding the tree's KV of the prompt's first tokens; the rest prefilled after it at
    contiguous positions, as the prefix arm and the baseline number them. The modules' tokens this request encoded
    count as computed, though the tree's KV is read."""
    buf.reset()
    every = range(len(plan.token_ids))
    work = match_fill(list(plan.token_ids), match, buf)
    return (replace(work, precomputed_tokens=max(0, work.reused_tokens - fresh_tokens(ranges))),
            replace(choice, slots=list(every), positions=every))


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


# the fill's parts and the settings it reads
def _stored_fill(lm: LoadedModel, plan: PromptPlan, ranges: list[Span], buf: Lease, choice: _Choice, focus: bool,
                 ape: tuple[float, float] | None, min_pull: float, ends: frozenset[int]) -> tuple[Fill, _Choice]:
    """``buf`` (emptied) holding the kept modules as stored, the new tokens to prefill; with ``focus``, decode
    steps read the module the answer names."""
    ids, pos = plan.uncached()
    kept, modules = choice.kept, tuple(dict.fromkeys(r.module for r in ranges if r.module is not None))
    read = [r for r in ranges if r.module is None or r.module in kept]
    for span in read:
        span.write_into(buf)
    owners = slot_owners(read, 0, {m: i for i, m in enumerate(kept)}) if focus else None
    focused = None if not all(r.entry.level for r in read) else _focus(
        owners, kept, modules, choice.seen, ids, min_pull, ends)
    scale = ape_scale(lm, read, ape)
    slots = _stored_slots(plan, ranges, kept) if scale is None else None
    work = Fill(ids, pos, [r.entry for r in ranges], reused_tokens=sum(len(r) for r in read),
                precomputed_tokens=precomputed_tokens(ranges),  # the scout read the left-out modules' stored KV
                prefill=AttentionSpec(ape=scale), decode=AttentionSpec(ape=scale, focus=focused))
    return work, replace(choice, focus=focused, slots=slots)


def _repeat(ctx: DecodingContext, stored, pieces: list, whole: bool,
            known: int) -> RunEvents[tuple[RunResult, RoutedInfo]]:
    """An identical request again: its stored KV read back; with ``whole`` (the last token's KV too) the stored
    first logits are sampled and nothing is prefilled, else the last token is prefilled (as the prefix arm does).
    ``known``: the prompt's tokens less those this request encoded; all but the prefilled one are stored."""
    n = sum(b - a for _, a, b in pieces)
    token, position = stored.last
    was = stored.focus  # a fresh one: the focus moves as the answer is written again
    focus = None if was is None else was.fresh()

    def fill(buf: Lease) -> Fill:
        for entry, a, b in pieces:
            entry.write_into(buf, a, b)
        return Fill([token], [position], [e for e, *_ in pieces], reused_tokens=n,
                    precomputed_tokens=max(0, known - (not whole)), logits=stored.logits if whole else None,
                    decode=AttentionSpec(focus=focus))

    run = yield from timed_run(ctx.lm, "routed", n + 1, fill, ctx.sampling, ctx.decoder)
    return run, replace(stored.routing, path="repeat", recomputed=0, scout_ms=0.0,
                        moves=_moves(focus, stored.routing.kept), repeat_tokens=n)


def _stored_slots(plan: PromptPlan, ranges: list[Span], kept: tuple[str, ...]) -> list[int]:
    """Each buffer slot's prompt rank when the kept modules are read as stored, then the uncached tokens."""
    uncached = [r for at in plan.placed() if not at.cached for r in at.ranks]
    return [r for s in ranges if s.module is None or s.module in kept for r in range(s.rank, s.rank + len(s))] \
        + uncached


def scout_plan(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
               layers: tuple[int, ...]) -> Scouted:
    """The scout of ``plan`` alone, untimed (bench/routing.py)."""
    ranges = module_ranges(plan, encoded, store)
    lease = finish(take_lease(pool_of(lm), lease_tokens(plan.cached_tokens + plan.uncached_tokens, 0)))
    try:
        for span in ranges:
            span.write_into(lease)
        ids, pos = plan.uncached()
        return scout(lm, lease, ranges, ids, pos, tuple(sorted({x % lm.n_layers for x in layers})))
    finally:
        lease.release()


def scout(lm: LoadedModel, buf: Lease, ranges: list[Span], ids: list[int], pos: list[int],
          layers: tuple[int, ...]) -> Scouted:
    """Prefill ``ids`` over ``buf`` (holding ``ranges``) through layer ``max(layers)``, taking each module's pull."""
    modules = tuple(dict.fromkeys(r.module for r in ranges if r.module is not None))
    index = {m: i for i, m in enumerate(modules)}
    owner = {layer: slot_owners(ranges, layer, index) for layer in layers}  # slot -> module index, -1 none
    pull, mass = torch.zeros(len(layers), len(modules)), torch.zeros(len(layers), len(modules))
    others = torch.zeros(len(layers))
    by_token = torch.zeros(len(ids), len(modules))
    keys: list[torch.Tensor] = []  # per scout layer, the attention each cached slot got

    class Pull:
        def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
            if layer not in owner:
                return
            att = attention_weights(query, key, scaling)  # [kv_heads, group, queries, keys]
            cached = owner[layer]
            peak = att.amax(dim=(0, 1, 2))[: cached.shape[0]].float().cpu()
            row = layers.index(layer)
            routable = cached >= 0
            pull[row].scatter_reduce_(0, cached[routable], peak[routable], reduce="amax")
            per_key = att.sum(dim=(0, 1, 2))[: cached.shape[0]].float().cpu()
            mass[row].index_add_(0, cached[routable], per_key[routable])
            keys.append(per_key)
            others[row] = peak[~routable].max() if bool((~routable).any()) else 0.0
            per_token = att.amax(dim=(0, 1))[:, : cached.shape[0]].float().cpu()  # [queries, cached slots]
            into = cached[routable].expand(per_token.shape[0], -1)
            by_token.scatter_reduce_(1, into, per_token[:, routable], reduce="amax")

    with torch.inference_mode():
        run_until(lm, max(layers), "routing", "leave routed out of the arms",
                  input_ids=torch.tensor([list(ids)], device=lm.device),
                  position_ids=torch.tensor([list(pos)], device=lm.device), past_key_values=buf.cache(),
                  use_cache=True, logits_to_keep=1, attn_spec=AttentionSpec(scorer=Pull()))
    same = len({k.shape[0] for k in keys}) == 1  # compressed entries keep other slots per layer: no score per token
    return Scouted(modules, layers, pull, mass, others, by_token, torch.stack(keys).sum(0) if same else None)


def choose(seen: Scouted, k: int, min_pull: float) -> tuple[str, ...]:
    """The modules kept: all when none reaches ``min_pull``, else the ``k`` strongest or (k 0) those reaching it."""
    weight = seen.strength()
    if not len(weight) or float(weight.max()) < min_pull:
        return seen.modules
    if k > 0:
        take = set(torch.sort(weight, descending=True, stable=True).indices[:k].tolist())
    else:
        take = {i for i, w in enumerate(weight.tolist()) if w >= min_pull}
    return tuple(m for i, m in enumerate(seen.modules) if i in take)


def _info(choice: _Choice, s: RoutedSettings, layers: tuple[int, ...], recomputed: int,
          modules: tuple[str, ...]) -> RoutedInfo:
    """A routed run's detail, from what its fill chose (and where its focus moved while decoding)."""
    seen = choice.seen
    moves = _moves(choice.focus, choice.kept)
    shares, pull = ({}, {}) if seen is None else (seen.shares(), dict(zip(seen.modules, seen.strength().tolist())))
    return RoutedInfo(kept=choice.kept, dropped=tuple(m for m in modules if m not in choice.kept), recomputed=recomputed,
                      path=choice.path, k=s.k, min_pull=s.min_pull, attention=shares, layers=layers,
                      scout_ms=choice.ms, pull=pull, focus=s.focus, moves=moves, joint=choice.joint, share=s.share,
                      sinks=s.sinks)


def _moves(focus: Focus | None, kept: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    """(decode step, module) each time ``focus`` moved; "" where a clause ended."""
    return tuple((step, kept[m] if m >= 0 else "") for step, m in focus.changes) if focus else ()


def _focus(owners: torch.Tensor | None, kept: tuple[str, ...], modules: tuple[str, ...], seen: "Scouted | None",
           ids, min_pull: float, ends: frozenset[int]) -> Focus | None:
    """The decode-time focus over buffer slots of ``owners`` (index in ``kept``, -1 none), when two or more modules
    but not all are kept and the question names one of them."""
    if owners is None or seen is None or seen.by_token is None or not 2 <= len(kept) < len(modules):
        return None
    named = triggers(seen, ids, kept, min_pull)
    return Focus(owners, named, ends) if named else None


def _joint_owners(plan: PromptPlan, kept: tuple[str, ...], slots: list[int]) -> torch.Tensor:
    """Each buffer slot's index in ``kept`` (-1: no kept module's) from ``slots``, each slot's prompt rank."""
    owner = {r: kept.index(m) for m, rs in module_ranks(plan, set(kept)).items() for r in rs}
    return torch.tensor([owner.get(r, -1) for r in slots], dtype=torch.long)


_ENDS: dict[int, frozenset[int]] = {}


def clause_ends(tokenizer) -> frozenset[int]:
    """The token ids whose text holds . , ; ! ? or a newline (computed once per tokenizer)."""
    if id(tokenizer) not in _ENDS:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        _ENDS[id(tokenizer)] = frozenset(i for i, t in enumerate(texts) if any(c in t for c in ".,;!?\n"))
    return _ENDS[id(tokenizer)]


def triggers(seen: Scouted, ids, kept: tuple[str, ...], min_pull: float) -> dict[int, int]:
    """{token id: index in ``kept``} of the question tokens that name exactly one kept module."""
    cols = [seen.modules.index(m) for m in kept]
    pulls = seen.by_token[:, cols]  # [question tokens, kept]
    out: dict[int, int] = {}
    clash: set[int] = set()
    for tok, row in zip(ids, pulls):
        top = torch.topk(row, min(2, len(kept)))
        lead = float(top.values[0] - top.values[1]) if len(kept) > 1 else float(top.values[0])
        if float(top.values[0]) >= min_pull and lead >= FOCUS_MARGIN:
            best = int(top.indices[0])
            if out.get(int(tok), best) != best:
                clash.add(int(tok))
            out[int(tok)] = best
    return {t: m for t, m in out.items() if t not in clash}


register(ArmSpec("routed", routed_arm, order=40, reads=Reads.MODULES, settings=RoutedSettings, detail=RoutedInfo))
