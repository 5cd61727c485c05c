"""Runs an arm named by label (bench/labels.py) on one plan, as the fidelity and spanning benchmarks do: the
encodings are made once per (mode, sink) and a routed run's choice is kept beside its result."""

from __future__ import annotations

from dataclasses import replace

from bench.labels import parse_arm
from engine.arms.blend import BlendSettings, blend_run, cached_ranks
from engine.arms.compare import decoding, run_arm
from engine.arms.modular import ModularSettings, recomputed_run, repaired_run
from engine.arms.prefix import warm_prefix
from engine.arms.registry import ArmContext, Sampling
from engine.arms.routed import RoutedSettings, routed_run
from engine.cache.assemble import used_keys
from engine.cache.prefix import PrefixCache, schema_order_prompt
from engine.run.events import finish
from engine.session import Engine


class Runner:
    """Runs named arms on one plan; encodings are made once per (mode, sink) and freed per prompt."""

    def __init__(self, eng: Engine, lay, plan, sampling: Sampling, targets: tuple[int, ...] = ()):
        self.eng, self.lay, self.plan, self.sampling = eng, lay, plan, sampling
        self.store = eng.store()
        self.encoded: dict = {}
        self.blend_ms: dict[str, float] = {}  # blend arm -> its last selection time (inside its TTFT)
        self.targets = targets  # the modules holding the asked facts (doc indices): the oracles keep them
        self.routed: dict[str, dict] = {}  # routed arm -> what it kept
        self._tree: PrefixCache | None = None

    def _owner(self, rank: int) -> str:
        """The top-level module the prompt token of ``rank`` belongs to ('' for the anonymous text)."""
        start = 0
        for s in self.plan.segments:
            if rank < start + len(s):
                return self.lay.modules[s.owner].top if s.owner in self.lay.modules else ""
            start += len(s)
        return ""

    def encoded_for(self, mode: str, sink: int):
        if (mode, sink) not in self.encoded:
            self.encoded[(mode, sink)] = self.eng.encode(self.lay, self.eng.config.with_(mode=mode, sink=sink)).encoded
        return self.encoded[(mode, sink)]

    def tree(self, enc) -> PrefixCache:
        """A prefix tree holding the schema-order prompt's KV, as Engine.compare warms it (outside TTFT)."""
        if self._tree is None:
            self._tree = PrefixCache(self.store)
            finish(warm_prefix(self.eng.lm, self._tree, schema_order_prompt(self.lay).token_ids,
                               used_keys(self.plan, enc)))
        return self._tree

    def run(self, arm: str, sampling: Sampling | None = None):
        spec, sampling = parse_arm(arm), sampling or self.sampling
        if spec.get("special") == "baseline":
            return run_arm(ArmContext(self.eng.lm, self.plan, None, None, sampling), "baseline").run
        enc = self.encoded_for(spec["mode"], spec["sink"])
        targets = {f"doc{j}" for j in self.targets}
        t, s = spec["ape"] or (1.0, 1.0)
        cached = ModularSettings(repair=spec["repair"] or 0, ape_t=t, ape_s=s)
        ctx = decoding(ArmContext(self.eng.lm, self.plan, enc, self.store, sampling, settings={"cached": cached}))
        if spec["oracle"] == "oracle":
            routed = RoutedSettings(focus=spec["focus"])
            return finish(routed_run(ctx, routed, keep=targets))[0]
        if spec["oracle"] == "oracle recompute":
            redo = [r for r in cached_ranks(self.plan) if self._owner(r) in targets]
            positions = self.plan.positions
            return finish(recomputed_run(ctx, set(redo), tuple(positions[r] for r in redo)))
        if spec["route"] is not None or spec["pull"] is not None:
            return self._routed(arm, spec, ctx, enc, targets)
        if spec["blend"]:
            blend = BlendSettings(ratio=spec["blend"] / 100, rule=spec["rule"])
            run, info = finish(blend_run(ctx, blend, check_layer=spec["check"]))
            self.blend_ms[arm] = info.selection_ms
            return run
        if spec["repair"] or spec["first"] is not None:
            return finish(repaired_run(ctx, spec["repair"], spec["first"]))
        return run_arm(ctx, "cached").run

    def _routed(self, arm: str, spec: dict, ctx, enc, targets: set[str]):
        """A routed run as ``spec`` sets it; what it chose kept in ``self.routed``."""
        kw = {"k": spec["route"] or 0, "focus": spec["focus"], "joint": spec["joint"], "tree": "on" if spec["tree"] else "off"}
        kw.update({} if spec["pull"] is None else {"min_pull": spec["pull"] / 100})
        kw.update({} if spec["share"] is None else {"share": spec["share"] / 100})
        kw.update({} if spec["sinks"] is None else {"sinks": spec["sinks"]})
        if spec["tree"]:
            ctx = replace(ctx, prefix=self.tree(enc))
        layers = {"layers": spec["layers"]} if spec["layers"] else {}
        run, info = finish(routed_run(ctx, RoutedSettings(**kw), **layers))
        self.routed[arm] = {"kept": list(info.kept), "asked_kept": targets <= set(info.kept),
                            "joint": list(info.joint), "pull": {m: round(v, 4) for m, v in info.pull.items()},
                            "scout_ms": round(info.scout_ms, 2), "focus_moves": [list(m) for m in info.moves],
                            "path": info.path}
        return run
