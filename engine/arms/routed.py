"""Question-routed reuse (``routed``): the question picks the modules it reads.

Modules encoded apart never saw each other. When several hold same-template facts about different
subjects, the question's attention spreads over all of them and the modular arm answers from the wrong
one; selecting *what the query reads* fixes it (selective attention to the top contexts, arXiv 2412.16545;
CacheFocus, arXiv 2502.11101). A routed run (:func:`run_routed`):

1. **Buffer** — every imported module's stored KV, as the modular arm assembles it.
2. **Scout** — the uncached tokens prefilled over it through the first ``max(SCOUT_LAYERS) + 1`` decoder
   layers only; at each layer of :data:`SCOUT_LAYERS`, each module's **pull**: the strongest attention
   any head of any uncached token pays any one of its keys (:func:`scout`).
3. **Route** — every module whose pull reaches ``route_min_pull`` (:data:`MIN_PULL`) stays visible, or with
   ``route_k`` > 0 the ``k`` strongest (:func:`choose`); the others leave the buffer. System text, scaffolds,
   arguments and new text are never routed out. A question that points at no module (no pull reaches the
   threshold: a greeting, or a question about every module) keeps them all.

Why the peak and not the attention mass: docs/arms.md (template words and sinks attend everywhere).
4. **Prefill and decode** — the buffer rebuilt with the kept modules, the uncached tokens prefilled over
   it, then decoding, as the modular arm does. A module left out is therefore invisible to the rest of
   the prefill and to every decoded token. With ``joint`` on, two or more kept modules are not read as
   stored but prefilled together with the new text (:func:`joint_fill`): modules encoded apart never saw
   each other, and two of one template, both visible, get their facts swapped or merged. Every module kept
   and recomputed is the full prefill after the system text.

TTFT, measured by :func:`engine.arms.runner.timed_run` like every arm's, includes the scout, the routing,
both copies and both prefills (``copy_ms`` holds everything before the second prefill). With every module
kept and ``joint`` off the buffer and the prefill are the modular arm's, so the run is the modular run bit for bit.

The settings are named in one place: :data:`SCOUT_LAYERS`, and :class:`RoutedSettings` (the CLI's
``--route-k`` / ``--route-min-pull``, the studio's controls), with the defaults chosen on bench/fidelity.py's
confusable set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.arms.registry import (Arm, ArmContext, ArmResult, ArmSettings, ArmSpec, Reads, RunResult, Sampling, TokenFn,
                                  register, setting)
from engine.arms.runner import Fill, ape_scale, check_recompute, run_until, timed_run, workspace
from engine.cache.assemble import buffer_ranks, copy_list_ranked, module_ranges, prefilled, slot_owners
from engine.cache.encode import EncodedSchema
from engine.cache.store import ModuleStore
from engine.errors import EngineError
from engine.kv import KVBuffer, LayeredKV
from engine.limits import Limit
from engine.model.attend import Focus, RankMask, attention_weights, scoring
from engine.model.load import LoadedModel
from engine.schema.layout import ANONYMOUS
from engine.schema.plan import CACHED, PromptPlan

# Each setting below names the split it was chosen on; the figures are in docs/arms.md and bench/results/.
# Decoder layers the scout reads (negative: from the end); it stops after the last. Chosen by bench/routing.py on
# bench/fidelity.py's confusable set (seed 1): the layers where the asked module's pull leads in every prompt.
SCOUT_LAYERS = (6, 7, 8, 9, 10, 11)
# The pull a module needs to stay (one head of one new token putting this much attention on one of its keys). Chosen
# on the same confusable set and fidelity.py's two-fact set (seed 2), checked on greetings (bench/routed_greetings.py);
# reported on bench/spanning.py's held-out split (seed 39).
MIN_PULL = 0.95
DEFAULT_K = 0  # 0: keep by the threshold; K > 0: the K strongest (when any module reaches the threshold)
# With two or more modules kept and read as stored (joint off), focus the decode steps on the module whose subject
# the answer last named (engine.model.attend.Focus): a question token names a module when its pull there reaches the
# threshold and leads every other kept module's by FOCUS_MARGIN. Chosen on fidelity.py's two-fact set (seed 2).
DEFAULT_FOCUS = "on"
FOCUS_MARGIN = 0.2
# Two or more modules kept are prefilled together (:func:`joint_fill`): chosen on bench/spanning.py's tune split
# (seed 38) over the decode-time focus, reported on its held-out split (seed 39).
DEFAULT_JOINT = "on"


@dataclass(frozen=True)
class RoutedSettings(ArmSettings):
    """The routed arm's settings (their one default each is here)."""

    k: int = setting(DEFAULT_K, "route_k", "Routed: modules kept (top k)",
                     "keep the k modules the question pulls hardest (0: every module whose pull reaches "
                     "route-min-pull)",
                     limit=Limit("route_k", 0, 256, whole=True, example="2"), metavar="K")
    min_pull: float = setting(MIN_PULL, "route_min_pull", "Routed: pull a module needs (0-1)",
                              "keep the modules some head of the question attends to this strongly (the attention on "
                              "one of their keys); when none does, keep them all", limit=Limit(
                                  "route_min_pull", 0.0, 1.0, meaning="an attention weight from 0 to 1", example="0.95"),
                              step=0.01, metavar="P")

    joint: str = setting(DEFAULT_JOINT, "route_joint", "Routed: recompute kept modules together",
                         "when routing keeps two or more modules (two reached the pull threshold, or none did and all "
                         "stay), prefill their tokens together in prompt order, as a full prefill does (on), or read "
                         "their stored KV (off)", choices=("on", "off"))
    focus: str = setting(DEFAULT_FOCUS, "route_focus", "Routed: focus while decoding",
                         "with two or more modules kept, each decode step reads only the module its newest token "
                         "points at, in the layers after the scout's (on), or every kept module (off)",
                         choices=("on", "off"))

    def check_with(self, config) -> None:
        if config.compression.at_run:
            raise EngineError("routing and question-aware retention cannot be combined yet (retention marks the "
                              "tokens of a buffer routing rebuilds); leave routed out of the arms or pick another "
                              "compression")


@dataclass(frozen=True)
class Scouted:
    """What the scout saw: per scout layer, each module's pull (the strongest attention of any head of any
    uncached token on one of its keys)."""

    modules: tuple[str, ...]  # routable (top-level) modules, in prompt order
    layers: tuple[int, ...]
    pull: torch.Tensor  # [len(layers), len(modules)]: max over heads, uncached tokens and the module's keys
    mass: torch.Tensor  # [len(layers), len(modules)]: attention summed over heads and uncached tokens (reported only)
    others: torch.Tensor  # [len(layers)]: the same over cached tokens that are never routed (system text, scaffolds)
    by_token: torch.Tensor | None = None  # [uncached tokens, len(modules)]: each token's pull, over the scout layers

    def strength(self) -> torch.Tensor:
        """[len(modules)]: each module's pull over all the scout layers (the strongest)."""
        return self.pull.amax(0)

    def shares(self) -> dict[str, float]:
        """Each module's share of the modules' summed pull (sums to 1): what the studio's bars show."""
        total = self.strength()
        total = total / total.sum().clamp(min=1e-30)
        return {m: float(s) for m, s in zip(self.modules, total)}


@dataclass(frozen=True)
class RoutedInfo:
    """How one routed run chose what to read."""

    k: int
    min_pull: float
    kept: tuple[str, ...]  # modules left visible, in prompt order
    attention: dict[str, float] = field(default_factory=dict)  # module -> its share of the pull
    layers: tuple[int, ...] = ()
    scout_ms: float = 0.0  # inside TTFT
    pull: dict[str, float] = field(default_factory=dict)  # module -> its pull, 0..1
    focus: str = DEFAULT_FOCUS
    moves: tuple[tuple[int, str], ...] = ()  # (decode step, module) each time the focus moved
    joint: tuple[str, ...] = ()  # modules prefilled together

    def to_json(self) -> dict:
        return {"route_k": self.k, "route_min_pull": self.min_pull, "route_kept": list(self.kept),
                "route_attention": {m: round(s, 4) for m, s in self.attention.items()},
                "route_layers": list(self.layers), "scout_ms": round(self.scout_ms, 3),
                "route_pull": {m: round(v, 4) for m, v in self.pull.items()}, "route_focus": self.focus,
                "route_focus_moves": [list(m) for m in self.moves], "route_joint": list(self.joint)}

    @classmethod
    def from_json(cls, data: dict) -> "RoutedInfo":
        return cls(k=data.get("route_k", DEFAULT_K), min_pull=data.get("route_min_pull", MIN_PULL),
                   kept=tuple(data.get("route_kept") or ()), attention=dict(data.get("route_attention") or {}),
                   layers=tuple(data.get("route_layers") or ()), scout_ms=data.get("scout_ms", 0.0),
                   pull=dict(data.get("route_pull") or {}), focus=data.get("route_focus", "off"),
                   moves=tuple((int(a), str(b)) for a, b in data.get("route_focus_moves") or ()),
                   joint=tuple(data.get("route_joint") or ()))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def routed_arm(ctx: ArmContext) -> ArmResult:
    s = ctx.settings_of("routed")
    run, info = run_routed(ctx.lm, ctx.plan, ctx.encoded, ctx.store, ctx.sampling, ctx.on_token, k=s.k,
                           min_pull=s.min_pull, ape=ctx.settings_of("cached").ape,  # APE is the modular arm's setting
                           focus=s.focus, joint=s.joint)
    return ArmResult(Arm("routed"), run, detail=info)


def run_routed(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
               sampling: Sampling = Sampling(), on_token: TokenFn | None = None, k: int = DEFAULT_K,
               min_pull: float | None = None, layers: tuple[int, ...] = SCOUT_LAYERS,
               keep: set[str] | None = None, ape: tuple[float, float] | None = None,
               focus: str = DEFAULT_FOCUS, joint: str = DEFAULT_JOINT) -> tuple[RunResult, RoutedInfo]:
    """The modular run reading only the modules the question routes to (module docstring).

    ``keep`` forces the kept modules instead of scouting (the oracle of bench/fidelity.py); ``layers`` are the
    scout's; ``ape`` (T, S) scales the attention over the kept modules as APE does (:class:`engine.model.attend.ApeScale`;
    the scout reads the plain attention); ``focus`` "on": with two or more modules kept, decode steps read the one
    their newest token points at (:class:`engine.model.attend.Focus`); ``joint`` "on": two or more modules that
    reached the threshold are prefilled together (:func:`joint_fill`). Returns the run (arm ``"routed"``) and how
    it chose.
    """
    check_recompute(lm, "routing", "leave routed out of the arms")
    min_pull = MIN_PULL if min_pull is None else min_pull
    ranges = module_ranges(plan, encoded, store)  # store lookups happen before TTFT, as for the other arms
    units = [u for _, _, _, u in ranges]
    modules = tuple(dict.fromkeys(u for u in units if u is not None))
    ids, pos = plan.uncached()
    layers = tuple(sorted({x % lm.n_layers for x in layers}))
    chose: dict = {}

    def fill(buf: KVBuffer) -> Fill:
        t0 = time.perf_counter()
        for entry, a, b, _ in ranges:
            entry.write_into(buf, a, b)
        seen = None
        if keep is None and modules:
            seen = scout(lm, buf, ranges, ids, pos, layers)
            kept = choose(seen, k, min_pull)
            chose.update(attention=seen.shares(), pull=dict(zip(seen.modules, seen.strength().tolist())))
        else:
            kept = tuple(m for m in modules if keep is None or m in keep)
        together = kept if joint == "on" and seen is not None and len(kept) >= 2 else ()
        chose.update(kept=kept, ms=(time.perf_counter() - t0) * 1000, joint=together, focus=None)
        buf.lengths = [0] * len(buf.lengths)  # rebuilt: only what stays visible
        if together:
            return joint_fill(lm, plan, encoded, store, buf, set(together), set(modules))
        read = [r for r in ranges if r[3] is None or r[3] in kept]
        for entry, a, b, _ in read:
            entry.write_into(buf, a, b)
        chose["focus"] = _focus(read, kept, modules, seen, ids, min_pull) if focus == "on" else None
        return Fill(ids, pos, [e for e, *_ in ranges], reused_tokens=sum(b - a for _, a, b, _ in read),
                    ape=ape_scale(lm, read, ape), focus=chose["focus"])

    run, _ = timed_run(lm, "routed", plan.cached_tokens + len(ids) + sampling.max_new_tokens + 1, fill, sampling,
                       on_token)
    moves = tuple((step, chose["kept"][m]) for step, m in chose["focus"].changes) if chose["focus"] else ()
    info = RoutedInfo(k=k, min_pull=min_pull, kept=chose["kept"], attention=chose.get("attention", {}),
                      layers=layers if keep is None else (), scout_ms=chose["ms"], pull=chose.get("pull", {}),
                      focus=focus, moves=moves, joint=chose["joint"])
    return run, info


def joint_fill(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, buf: KVBuffer,
               together: set[str], routable: set[str]) -> Fill:
    """Fill ``buf`` (emptied) for a prefill of the modules ``together`` and the uncached tokens under the prompt-order
    mask: system text and scaffolds from the store, the other routable modules left out. The modules then see each
    other and the text before them, as in a full prefill, at their own positions."""
    redo, drop = set(), set()
    rank = 0
    for s in plan.segments:
        top = plan.layout.modules[s.owner].top if s.kind == CACHED and not s.scaffold and s.owner != ANONYMOUS else None
        if top in routable:
            (redo if top in together else drop).update(range(rank, rank + len(s)))
        rank += len(s)
    copies = copy_list_ranked(plan, encoded, store, redo | drop)
    for entry, a, b, _ in copies:
        entry.write_into(buf, a, b)
    ids, pos, ranks = prefilled(plan, redo)
    positions = [p for s in plan.segments for p in s.positions]
    mask = RankMask(buffer_ranks(copies, lm.n_layers), torch.tensor(ranks, dtype=torch.long))
    return Fill(ids, pos, [e for e, *_ in copies], reused_tokens=sum(b - a for _, a, b, _ in copies),
                recomputed_positions=tuple(positions[r] for r in sorted(redo)), mask=mask)


def scout_plan(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
               layers: tuple[int, ...]) -> Scouted:
    """The scout of ``plan`` alone, untimed, at ``layers`` (bench/routing.py reads every layer's this way)."""
    ranges = module_ranges(plan, encoded, store)
    buf = workspace(lm).buffer(plan.cached_tokens + plan.uncached_tokens + 1)
    for entry, a, b, _ in ranges:
        entry.write_into(buf, a, b)
    ids, pos = plan.uncached()
    return scout(lm, buf, ranges, ids, pos, tuple(sorted({x % lm.n_layers for x in layers})))


def scout(lm: LoadedModel, buf: KVBuffer, ranges: list, ids: list[int], pos: list[int],
          layers: tuple[int, ...]) -> Scouted:
    """Prefill ``ids`` over ``buf`` (filled with ``ranges``, in order) through layers ``0..max(layers)`` and take,
    at each of ``layers``, each module's pull: the strongest attention any head of any of them pays one of its keys."""
    modules = tuple(dict.fromkeys(u for *_, u in ranges if u is not None))
    index = {m: i for i, m in enumerate(modules)}
    owner = {layer: slot_owners(ranges, layer, index) for layer in layers}  # buffer slot -> module index (-1: never routed)
    pull, mass = torch.zeros(len(layers), len(modules)), torch.zeros(len(layers), len(modules))
    others = torch.zeros(len(layers))
    by_token = torch.zeros(len(ids), len(modules))

    class Pull:
        def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
            if layer not in owner:
                return
            att = attention_weights(query, key, scaling)  # [kv_heads, group, queries, keys]
            cached = owner[layer]
            peak = att.amax(dim=(0, 1, 2))[: cached.shape[0]].float().cpu()  # each key's strongest pull
            row = layers.index(layer)
            routable = cached >= 0
            pull[row].scatter_reduce_(0, cached[routable], peak[routable], reduce="amax")
            mass[row].index_add_(0, cached[routable], att.sum(dim=(0, 1, 2))[: cached.shape[0]].float().cpu()[routable])
            others[row] = peak[~routable].max() if bool((~routable).any()) else 0.0
            per_token = att.amax(dim=(0, 1))[:, : cached.shape[0]].float().cpu()  # [queries, cached slots]
            into = cached[routable].expand(per_token.shape[0], -1)
            by_token.scatter_reduce_(1, into, per_token[:, routable], reduce="amax")

    with torch.inference_mode(), scoring(Pull()):
        run_until(lm, max(layers), "routing", "leave routed out of the arms",
                  input_ids=torch.tensor([list(ids)], device=lm.device),
                  position_ids=torch.tensor([list(pos)], device=lm.device), past_key_values=buf.cache(),
                  use_cache=True, logits_to_keep=1)
    return Scouted(modules, layers, pull, mass, others, by_token)


def choose(seen: Scouted, k: int, min_pull: float) -> tuple[str, ...]:
    """The modules kept, in prompt order: none reaching ``min_pull`` keeps them all; else the ``k`` strongest
    (``k`` > 0; ties keep the earlier module), or every module whose pull reaches ``min_pull``."""
    weight = seen.strength()
    if not len(weight) or float(weight.max()) < min_pull:
        return seen.modules
    if k > 0:
        take = set(torch.sort(weight, descending=True, stable=True).indices[:k].tolist())
    else:
        take = {i for i, w in enumerate(weight.tolist()) if w >= min_pull}
    return tuple(m for i, m in enumerate(seen.modules) if i in take)


def _focus(read: list, kept: tuple[str, ...], modules: tuple[str, ...], seen: "Scouted | None", ids,
           min_pull: float) -> Focus | None:
    """The decode-time focus over the rebuilt buffer (``read``), when it holds two or more modules but not all (a
    question that pointed nowhere keeps the modular run's decoding), the scout saw the question and no entry is
    compressed (its slots differ per layer)."""
    if seen is None or seen.by_token is None or not 2 <= len(kept) < len(modules) \
            or any(isinstance(e, LayeredKV) for e, *_ in read):
        return None
    return Focus(slot_owners(read, 0, {m: i for i, m in enumerate(kept)}), triggers(seen, ids, kept, min_pull))


def triggers(seen: Scouted, ids, kept: tuple[str, ...], min_pull: float) -> dict[int, int]:
    """{token id: index in ``kept``} of the question tokens that name one kept module: their pull there reaches
    ``min_pull`` and leads every other kept module's by :data:`FOCUS_MARGIN`. A token id naming two modules names none."""
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
