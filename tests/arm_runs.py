"""Shorthands the engine tests call an arm's run with: each builds the arm's context (``ArmContext`` + its
settings) and drains the run's events, as ``run_arm`` does for a benchmark. The engine itself has no positional
entry points: an arm takes its context."""

from __future__ import annotations

from engine.arms.blend import BlendSettings, blend_run
from engine.arms.compare import decoding
from engine.arms.modular import ModularSettings, cached_run, recomputed_run, repaired_run
from engine.arms.baseline import baseline_run
from engine.arms.prefix import prefix_run
from engine.arms.registry import ArmContext, Sampling
from engine.arms import routed
from engine.arms.routed import SCOUT_LAYERS, RoutedSettings, routed_run
from engine.run.events import Done, FirstToken, Token, finish


def context(lm, plan, encoded=None, store=None, sampling: Sampling = Sampling(), prefix=None, **settings):
    """A DecodingContext whose runs decode at once; ``settings``: arm name -> its ArmSettings."""
    return decoding(ArmContext(lm, plan, encoded, store, sampling, prefix, settings=settings))


def run_baseline(lm, plan, sampling: Sampling = Sampling()):
    return finish(baseline_run(context(lm, plan, sampling=sampling)))


def run_cached(lm, plan, encoded, store, sampling: Sampling = Sampling(), repair: int = 0, ape=None):
    t, s = ape or (1.0, 1.0)
    return finish(cached_run(context(lm, plan, encoded, store, sampling), ModularSettings(repair, t, s)))


def run_repaired(lm, plan, encoded, store, sampling: Sampling = Sampling(), k: int = 4, first=None):
    return finish(repaired_run(context(lm, plan, encoded, store, sampling), k, first))


def run_recomputed(lm, plan, encoded, store, redo, positions, sampling: Sampling = Sampling()):
    return finish(recomputed_run(context(lm, plan, encoded, store, sampling), redo, positions))


def run_blend(lm, plan, encoded, store, sampling: Sampling = Sampling(), ratio=None, rule=None, **kw):
    chosen = BlendSettings()
    for name, value in (("ratio", ratio), ("rule", rule)):  # unchecked: blend_run's own checks are under test
        if value is not None:
            object.__setattr__(chosen, name, value)
    return finish(blend_run(context(lm, plan, encoded, store, sampling), chosen, **kw))


def run_routed(lm, plan, encoded, store, sampling: Sampling = Sampling(), keep=None, layers=SCOUT_LAYERS,
               ape=None, prefix=None, **settings):
    """``settings``: RoutedSettings' fields by name (k, min_pull, focus, joint, share, sinks, tree)."""
    t, s = ape or (1.0, 1.0)
    chosen = RoutedSettings(**settings)
    if "min_pull" not in settings:  # read at call time: tests patch routed.MIN_PULL, past the setting's range too
        object.__setattr__(chosen, "min_pull", routed.MIN_PULL)
    ctx = context(lm, plan, encoded, store, sampling, prefix, cached=ModularSettings(0, t, s), routed=chosen)
    return finish(routed_run(ctx, keep=keep, layers=layers))


def run_prefix(lm, plan, prefix, sampling: Sampling = Sampling(), insert: bool = True, keep=()):
    ctx = context(lm, plan, sampling=sampling, prefix=prefix)
    from dataclasses import replace
    return finish(prefix_run(replace(ctx, keep=tuple(keep)), insert))[0]


def streamed(events, seen: dict):
    """The Comparison ``events`` end with; each arm's text after each of its tokens into ``seen``."""
    for event in events:
        if isinstance(event, (FirstToken, Token)):
            seen.setdefault(event.arm, []).append(event.text)
        elif isinstance(event, Done):
            return event.comparison
