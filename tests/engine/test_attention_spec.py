"""Each arm's forwards receive the attention spec the arm built, as an argument (tiny random Llama, seconds).

The engine's attention function is wrapped in transformers' registry for the test: it records, per forward
(layer 0), the ``attn_spec`` keyword argument it was called with. Each arm's ``fill`` is wrapped too, so the
spec its :class:`Fill` names for the prefill and for the decode steps is known, and compared by identity.
"""

from __future__ import annotations

import pytest
from transformers import AttentionInterface

from engine.arms import baseline, blend, modular, routed
from engine.arms.registry import Sampling
from tests.arm_runs import run_baseline, run_blend, run_cached, run_repaired, run_routed
from engine.model import attend
from engine.model.attend import PLAIN, ApeScale, RankMask

SCHEMA = """<schema name="spec">
  <system>You answer questions about the documents.</system>
  <user><module name="d1">The red fox jumps over the lazy dog near the river bank.</module>
  <module name="d2">Quantum computers use qubits that can hold superpositions of states.</module>
  <module name="d3">The library opens at nine and closes at five on weekdays.</module></user>
</schema>"""
PROMPT = "<prompt schema='spec'><d1/><d2/><d3/> Which animal jumps?</prompt>"
NEW = 4  # tokens generated: one prefill forward, then NEW - 1 decode steps


@pytest.fixture
def seen(monkeypatch):
    """[(spec, queries)] of every forward through the engine's attention, in order."""
    calls: list[tuple] = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            calls.append((kwargs.get("attn_spec"), query.shape[-2]))
        return attend._pml_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(attend.ATTENTION, recording)
    yield calls
    AttentionInterface.register(attend.ATTENTION, attend._pml_attention)


@pytest.fixture
def fills(monkeypatch):
    """The Fill each arm's fill returned, in order (the arm modules' timed_run and timed_detail wrapped)."""
    made = []
    for arm in (baseline, modular, blend, routed):
        for runner in ("timed_run", "timed_detail"):
            if not hasattr(arm, runner):
                continue

            def wrapped(lm, name, capacity, fill, *a, _real=getattr(arm, runner), **k):
                return _real(lm, name, capacity, lambda buf: made.append(fill(buf)) or made[-1], *a, **k)

            monkeypatch.setattr(arm, runner, wrapped)
    return made


@pytest.fixture
def case(tiny_engine):
    lay = tiny_engine.layout(SCHEMA)
    plan = tiny_engine.plan(lay, PROMPT, max_new_tokens=NEW)
    return tiny_engine.lm, plan, tiny_engine.encode(lay).encoded, tiny_engine.store()


def _run_forwards(seen: list, fill) -> None:
    """The last NEW forwards are the run's: a prefill with ``fill.prefill``, then decode steps with ``fill.decode``."""
    prefill, *steps = seen[-NEW:]
    assert prefill[0] is fill.prefill and prefill[1] == len(fill.ids)
    assert all(spec is fill.decode and q == 1 for spec, q in steps)


def test_baseline_forwards_attend_plainly(case, seen, fills):
    lm, plan, *_ = case
    run_baseline(lm, plan, Sampling(NEW))
    assert len(seen) == NEW and all(spec is PLAIN for spec, _ in seen)
    _run_forwards(seen, fills[-1])


def test_the_cached_arm_passes_its_spec_and_with_ape_its_scale(case, seen, fills):
    lm, plan, enc, store = case
    run_cached(lm, plan, enc, store, Sampling(NEW))
    assert len(seen) == NEW and fills[-1].prefill.plain and fills[-1].decode.plain
    _run_forwards(seen, fills[-1])
    seen.clear()
    run_cached(lm, plan, enc, store, Sampling(NEW), ape=(0.9, 0.8))
    fill = fills[-1]
    _run_forwards(seen, fill)
    for spec in (fill.prefill, fill.decode):
        assert isinstance(spec.ape, ApeScale) and (spec.ape.t, spec.ape.s) == (0.9, 0.8)
        assert spec.ranks is None and spec.focus is None
    assert fill.prefill.ape is fill.decode.ape


def test_repair_passes_its_rank_mask_to_the_prefill_only(case, seen, fills):
    lm, plan, enc, store = case
    run = run_repaired(lm, plan, enc, store, Sampling(NEW), k=2)
    fill = fills[-1]
    assert run.recomputed_tokens > 0 and isinstance(fill.prefill.ranks, RankMask) and fill.decode.plain
    _run_forwards(seen, fill)


def test_blend_passes_nothing_to_its_selection_pass_and_its_rank_mask_to_the_prefill(case, seen, fills):
    lm, plan, enc, store = case
    run_blend(lm, plan, enc, store, Sampling(NEW), ratio=0.5, rule="deviation")
    fill = fills[-1]
    assert len(seen) == NEW + 1 and seen[0][0] is PLAIN  # the selection pass over the whole prompt
    assert seen[0][1] == len(plan.token_ids)
    assert isinstance(fill.prefill.ranks, RankMask) and fill.decode.plain
    _run_forwards(seen, fill)
    seen.clear()
    run_blend(lm, plan, enc, store, Sampling(NEW), ratio=0.5, rule="question")
    assert seen[0][0].scorer is not None and seen[0][0].ranks is None  # the question's attention, scored


def test_routed_passes_its_scorer_to_the_scout_and_its_masks_to_the_run(case, seen, fills, monkeypatch):
    lm, plan, enc, store = case
    monkeypatch.setattr(routed, "FOCUS_MARGIN", 0.0)  # a random model's question names a module only without a margin
    run_routed(lm, plan, enc, store, Sampling(NEW), k=2, min_pull=0.0, joint="on", focus="clause")
    fill = fills[-1]
    scout, *_ = seen
    assert len(seen) == NEW + 1 and scout[0].scorer is not None and scout[0].ranks is None
    # two kept modules partly prefilled together; the clause focus on the decode steps only
    assert isinstance(fill.prefill.ranks, RankMask) and fill.prefill.focus is None and fill.decode.focus is not None
    _run_forwards(seen, fill)
    seen.clear()
    run_routed(lm, plan, enc, store, Sampling(NEW), k=2, min_pull=0.0, joint="off", focus="on")
    fill = fills[-1]
    assert fill.prefill.ranks is None and fill.prefill.focus is None
    assert fill.decode.focus is not None  # the focus acts on the decode steps only
    _run_forwards(seen, fill)


def test_runs_decoded_together_pass_each_rows_key_mask(tiny_engine, seen):
    res = tiny_engine.compare(SCHEMA, PROMPT, Sampling(NEW))
    assert res.decode == "together" and len(res.arms) >= 3
    prefills = [spec for spec, _ in seen[: -(NEW - 1)]]
    steps = seen[-(NEW - 1):]  # after every arm's first token, the batch's steps
    assert all(spec.keys is None for spec in prefills)
    assert all(spec.keys is not None and spec.keys.shape[0] == len(res.arms) and q == 1 for spec, q in steps)
