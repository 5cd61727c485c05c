"""The one walk over a plan (``PromptPlan.placed``), the copy ranges built on it (``Span``), and the token counts a
run carries (``RunResult.precomputed_tokens``), each against a hand-written or independently computed expectation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.arms.blend import BlendSettings
from engine.arms.modular import ModularSettings
from engine.arms.registry import Sampling
from engine.arms.routed import RoutedSettings
from engine.cache.assemble import (Span, buffer_ranks, copy_list, copy_list_ranked, fresh_tokens, module_ranges,
                                   precomputed_tokens, slot_owners)
from engine.run.types import RunResult
from engine.schema.layout import layout
from engine.schema.plan import CACHED, plan_prompt
from engine.schema.pml import parse_prompt, parse_schema
from engine.session import Engine
from studio.api.usage import cached_tokens, routed_out_tokens
from studio.views import metrics_html
from tests.engine.test_layout_plan import codec

# nested modules, a union inside a module, a scaffold over two modules, a cache="false" module
SCHEMA = """<schema name="walk">
  <system>sys</system>
  <user>
    <module name="doc">d1 d2 <module name="part">p1 p2</module> d3
      <union><module name="a">a1</module><module name="b">b1 b2</module></union> d4
    </module>
    <module name="one">q1</module>
    <module name="two">r1 r2</module>
    <module name="live" cache="false">l1 l2</module>
  </user>
  <scaffold name="pair" modules="one two"/>
</schema>"""
PROMPT = "<prompt schema='walk'><doc><part/><b/></doc><one/><two/><live/> what now</prompt>"


@pytest.fixture(scope="module")
def walk():
    lay = layout(parse_schema(SCHEMA, "s.xml"), codec())
    return lay, plan_prompt(lay, parse_prompt(PROMPT, "p.xml"))


def test_placed_walks_every_segment_with_its_rank_and_owning_module(walk):
    _, plan = walk
    placed = list(plan.placed())
    assert [at.segment for at in placed] == list(plan.segments)
    ids = plan.token_ids
    # ranks count every token before: the segment's tokens sit there in the prompt's token order
    assert [at.rank for at in placed] == [sum(len(s) for s in plan.segments[:i]) for i in range(len(placed))]
    assert all(tuple(ids[r] for r in at.ranks) == at.segment.token_ids for at in placed)
    # by hand: nested modules and union members belong to their top-level module; the scaffold's joint KV, the
    # system text, the cache="false" module and the new text to no module
    anonymous = ("", None, None)
    assert [(at.segment.owner, at.segment.scaffold, at.module) for at in placed] == [
        anonymous, anonymous, anonymous, anonymous,
        ("doc", None, "doc"), ("doc/part", None, "doc"), ("doc", None, "doc"), ("doc/b", None, "doc"),
        ("doc", None, "doc"),
        ("one", "pair", None), ("two", "pair", None),
        ("live", None, None), anonymous, anonymous, anonymous]
    assert [at.cached for at in placed] == [s.kind == CACHED for s in plan.segments]


def test_without_its_scaffold_a_module_owns_its_tokens(walk):
    lay, _ = walk
    plan = plan_prompt(lay, parse_prompt("<prompt schema='walk'><one/> hi</prompt>", "p.xml"))
    assert plan.scaffolds == ()
    assert [at.module for at in plan.placed() if at.segment.owner == "one"] == ["one"]


class _Entry:
    """A stand-in store entry: only identity matters to the copy lists; every layer holds every token."""

    level = True

    def __init__(self, key: str):
        self.key = key

    def kept_at(self, layer: int, a: int, b: int) -> torch.Tensor:
        return torch.arange(b - a)


def _fakes(lay, fresh: set[str]):
    """An encoded schema and a store where piece ``i`` lies in entry ``K<i % 2>`` (a scaffold's in ``S:<name>``) at
    offset ``10 * i``; ``fresh``: the keys this request encoded."""
    entries: dict[str, _Entry] = {}

    def locate(piece, scaffold):
        return (f"S:{scaffold}" if scaffold else f"K{piece % 2}"), 10 * piece

    encoded = SimpleNamespace(locate=locate, fresh_keys=lambda: frozenset(fresh))
    store = SimpleNamespace(get=lambda key: entries.setdefault(key, _Entry(key)))
    return encoded, store


def _per_token(plan, encoded):
    """(entry key, offset in the entry, rank, module) of every cached token, computed token by token."""
    out, rank = [], 0
    for s in plan.segments:
        for i in range(len(s)):
            if s.kind == CACHED:
                key, off = encoded.locate(s.piece, s.scaffold)
                top = None if s.scaffold or not s.owner else s.owner.split("/")[0]
                out.append((key, off + s.offset + i, rank + i, top))
        rank += len(s)
    return out


def _tokens_of(spans, ranked=True):
    return [(s.entry.key, s.start + j, s.rank + j if ranked else None, s.module) for s in spans for j in range(len(s))]


def test_spans_cover_the_cached_tokens_in_prompt_order(walk):
    lay, plan = walk
    encoded, store = _fakes(lay, fresh={"K1"})
    want = _per_token(plan, encoded)
    assert _tokens_of(module_ranges(plan, encoded, store)) == want
    assert _tokens_of(copy_list(plan, encoded, store), ranked=False) == [(k, o, None, m) for k, o, _, m in want]
    skip = {want[0][2], want[5][2], want[6][2], want[-1][2]}
    ranked = copy_list_ranked(plan, encoded, store, skip)
    assert _tokens_of(ranked) == [t for t in want if t[2] not in skip]
    # merged where both the entry offsets and the ranks follow on: no two neighbours could be one span
    assert all(not (a.entry is b.entry and a.end == b.start and a.rank + len(a) == b.rank)
               for a, b in zip(ranked, ranked[1:]))
    assert torch.equal(buffer_ranks(ranked, 2)[1], torch.tensor([t[2] for t in want if t[2] not in skip]))
    index = {"doc": 0}
    assert slot_owners(ranked, 0, index).tolist() == [0 if t[3] == "doc" else -1 for t in want if t[2] not in skip]
    # stored: the tokens of entries this request did not encode; ranks prefilled again are not stored
    assert precomputed_tokens(ranked) == sum(t[0] != "K1" for t in want if t[2] not in skip)
    ranges = module_ranges(plan, encoded, store)
    assert precomputed_tokens(ranges, skip) == sum(t[0] != "K1" and t[2] not in skip for t in want)
    assert fresh_tokens(ranges) == sum(t[0] == "K1" for t in want)
    assert len(Span(_Entry("x"), 3, 7)) == 4


def _runs(tokens, ranked: bool) -> int:
    """How many maximal runs ``tokens`` (key, offset, rank, module) fall into: a run breaks where the entry
    changes, the offset does not follow on, or (``ranked``) the rank does not."""
    return sum(1 for i, t in enumerate(tokens) if i == 0 or t[0] != tokens[i - 1][0] or t[1] != tokens[i - 1][1] + 1
               or (ranked and t[2] != tokens[i - 1][2] + 1))


def test_adjacent_spans_merge_across_segments(walk):
    """Each top-level module's pieces laid end to end in its own entry (as a unit is encoded): spans merge over
    segment boundaries, never over an entry's gap (the union member left out) nor, ranked, over a skipped rank."""
    lay, plan = walk
    unit = [(p.owner or "").split("/")[0] for p in lay.pieces]
    starts = [sum(len(q.token_ids) for q, u in zip(lay.pieces[:i], unit) if u == unit[i]) for i in range(len(unit))]
    entries: dict[str, _Entry] = {}
    encoded = SimpleNamespace(locate=lambda piece, scaffold: (f"K:{unit[piece]}", starts[piece]),
                              fresh_keys=frozenset)
    store = SimpleNamespace(get=lambda key: entries.setdefault(key, _Entry(key)))
    want = _per_token(plan, encoded)
    plain, ranked = copy_list(plan, encoded, store), copy_list_ranked(plan, encoded, store, {want[3][2]})
    assert _tokens_of(plain, ranked=False) == [(k, o, None, m) for k, o, _, m in want]
    assert len(plain) == _runs(want, ranked=False) < len(module_ranges(plan, encoded, store))
    kept = [t for t in want if t[2] != want[3][2]]
    assert _tokens_of(ranked) == kept and len(ranked) == _runs(kept, ranked=True)


# -- the counts a run carries -----------------------------------------------------------------------------------

SCHEMA_CARRIED = """<schema name="carried"><system>Answer from the notes.</system><user>{}</user></schema>"""


def test_a_run_carries_the_tokens_it_did_not_compute_and_the_api_reports_them(tiny_lm):
    """First sight: every unit is encoded, nothing stored. Again after one module's entry was evicted (encoded again
    now): each arm's stored tokens are the prompt less what it prefilled less that module's tokens it did not
    prefill, counted from the plan; the API's cached_tokens reads that count."""
    word = "qz7carried"  # a schema no other test stores (each test process has its own store, tests/conftest.py);
    # fixed, not random: which tokens blend recomputes depends on the text, and the count below must be checkable
    docs = [f"{word} the fox runs by the river at dawn.", f"{word} a heron waits on the stone.",
            f"{word} the mill turns when wind comes, and the miller counts the sacks of grain he carries to the "
            f"market by the bridge, one for the baker, two for the inn, three for the long winter."]
    # d2 is evicted below: long enough that blend's 30 % cannot recompute every token of it
    schema = SCHEMA_CARRIED.format("".join(f'<module name="d{i}">{d}</module>' for i, d in enumerate(docs)))
    prompt = "<prompt schema='carried'><d0/><d1/><d2/> Where is the fox?</prompt>"
    eng = Engine.from_loaded(tiny_lm)
    cfg = eng.config.with_(arms=("baseline", "cached", "blend", "routed"), warmup=False,
                           arm_settings={"blend": BlendSettings(ratio=0.3), "routed": RoutedSettings(k=1, min_pull=0.0),
                                         "cached": ModularSettings(repair=2)})
    first = eng.compare(schema, prompt, Sampling(2), config=cfg)
    assert all(u["source"] == "encoded" for u in first.encode["detail"])
    for arm in ("cached", "blend", "routed"):
        assert first.arm(arm).run.precomputed_tokens == cached_tokens(first, arm) == 0
    store, key = eng.store(), eng.encode(first.plan.layout, cfg).encoded.module_keys["d2"]
    store.evict(key)
    if store.disk is not None:
        store.disk.delete(key)
    again = eng.compare(schema, prompt, Sampling(2), config=cfg)
    assert [u["unit"] for u in again.encode["detail"] if u["source"] == "encoded"] == ["d2"]
    for arm in ("cached", "blend", "routed"):
        run = again.arm(arm).run
        redone = set(run.recomputed_positions)
        new = sum(p not in redone for s in again.plan.segments if s.owner == "d2" for p in s.positions)
        assert new > 0
        assert run.precomputed_tokens == cached_tokens(again, arm)
        assert run.precomputed_tokens == again.plan.prompt_tokens - run.prefill_tokens - new
        assert RunResult.from_json(arm, run.to_json()).precomputed_tokens == run.precomputed_tokens
    assert again.arm("cached").run.recomputed_tokens > 0 and again.arm("blend").run.recomputed_tokens > 0
    kept = again.arm("routed").detail.kept
    assert len(kept) == 1 and routed_out_tokens(again, "routed") == sum(
        len(s) for s in again.plan.segments if s.owner.startswith("d") and s.owner not in kept)
    assert again.arm("baseline").run.precomputed_tokens == cached_tokens(again, "baseline") == 0
    # the studio's figures read the same count: the cached arm reused d2's tokens, encoded for this run
    cached = again.arm("cached").run
    assert f"{cached.precomputed_tokens:,} stored before this run" in metrics_html(again, "cached")
