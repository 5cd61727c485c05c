"""The exactness oracle and the store, on a tiny random-weight Llama (seconds)."""

from __future__ import annotations

import pytest
import torch

from engine.model.attend import forward_kv
from engine.schema.plan import CACHED
from engine.arms.registry import Sampling
from tests.arm_runs import run_cached

DOCS = ("The red fox jumps over the lazy dog near the river bank.",
        "Quantum computers use qubits that can hold superpositions of states.",
        "The library opens at nine and closes at five on weekdays.")

FLAT = """<schema name="flat">
  <module name="d1">{0}</module>
  <module name="d2">{1}</module>
  <module name="d3">{2}</module>
</schema>""".format(*DOCS)

CHAT = """<schema name="chat">
  <system>You answer questions about the documents.</system>
  <user>
    <module name="d1">{0}</module>
    <module name="d2">{1}</module>
  </user>
  <scaffold name="both" modules="d1 d2"/>
</schema>""".format(*DOCS)


def compare(eng, schema, prompt, mode="prefixed", n=6):
    return eng.compare(schema, prompt, Sampling(n), config=eng.config.with_(mode=mode))


@pytest.mark.parametrize("mode", ["prefixed", "isolated"])
def test_one_prefix_module_plus_new_text_is_exact(tiny_engine, mode):
    c = compare(tiny_engine, FLAT, "<prompt schema='flat'><d1/> What jumps over the dog?</prompt>", mode)
    assert c.plan.cached_tokens > 10 and c.plan.uncached_tokens > 3
    assert c.agreement().max_first_logit_diff < 1e-4
    assert c.agreement().same_text and c.agreement().first_token_agree and c.agreement().first_token_kl < 1e-6


def test_prefixed_module_after_system_text_is_exact_isolated_is_not(tiny_engine):
    prompt = "<prompt schema='chat'><d1/> Which animal jumps?</prompt>"
    prefixed = compare(tiny_engine, CHAT, prompt, "prefixed")
    isolated = compare(tiny_engine, CHAT, prompt, "isolated")
    assert prefixed.agreement().max_first_logit_diff < 1e-4 and prefixed.agreement().same_text
    assert isolated.agreement().max_first_logit_diff > 1e-4  # the module never saw the system prompt


def test_scaffold_imported_whole_is_exact(tiny_engine):
    c = compare(tiny_engine, CHAT, "<prompt schema='chat'><d1/><d2/> Summarise both.</prompt>", "isolated")
    assert c.plan.scaffolds == ("both",)
    assert c.agreement().max_first_logit_diff < 1e-4 and c.agreement().same_text


def test_independent_modules_are_approximate_and_measured(tiny_engine):
    schema = CHAT.replace('<scaffold name="both" modules="d1 d2"/>', "")
    c = compare(tiny_engine, schema, "<prompt schema='chat'><d1/><d2/> Summarise both.</prompt>", "isolated")
    assert c.plan.scaffolds == ()
    assert c.agreement().max_first_logit_diff > 1e-4  # d2 never attended to d1: approximate by design
    # the reported KL is the KL of the two runs' own first-token distributions, computed here independently
    p, q = (torch.log_softmax(r.first_logits.double(), -1) for r in (c.baseline, c.cached))
    assert c.agreement().first_token_kl == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-3, abs=1e-9)
    assert c.agreement().first_token_kl > 1e-6


def test_module_reused_alone_at_its_offset_equals_one_pass_prefill(tiny_engine):
    eng = tiny_engine
    lay = eng.layout(FLAT)
    plan = eng.plan(lay, "<prompt schema='flat'><d2/> And then?</prompt>", Sampling(1))
    d2 = lay.modules["d2"]
    assert d2.start > 0  # d2 sits after d1's positions: its cache has a gap before it
    enc = eng.encode(lay, eng.config.with_(mode="isolated")).encoded
    cached = run_cached(eng.lm, plan, enc, eng.store())
    # One ordinary forward of the same tokens at the same (gapped) positions.
    seq = [t for s in plan.segments for t in s.token_ids]
    pos = [p for s in plan.segments for p in s.positions]
    with torch.inference_mode():
        out = eng.lm.model(input_ids=torch.tensor([seq]), position_ids=torch.tensor([pos]), use_cache=True)
    assert torch.allclose(out.logits[0, -1], cached.first_logits, atol=1e-4)
    # and the stored KV is what a one-pass prefill at those positions computes
    key = enc.module_keys["d2"]
    stored = eng.store().get(key)
    fresh = forward_kv(eng.lm.model, list(lay.pieces[d2.pieces[0]].token_ids), list(range(d2.start, d2.end)))
    assert stored.positions.tolist() == list(range(d2.start, d2.end))
    assert torch.allclose(stored.kv, fresh.kv, atol=1e-5)


def test_store_holds_each_module_once_and_counts_bytes(tiny_engine):
    eng = tiny_engine
    other = FLAT.replace('name="flat"', 'name="flat2"').replace(DOCS[2], "A different third document here.")
    a = eng.encode(eng.layout(FLAT), eng.config.with_(mode="isolated"))
    b = eng.encode(eng.layout(other), eng.config.with_(mode="isolated"))
    assert a.encoded.module_keys["d1"] == b.encoded.module_keys["d1"]  # same tokens, positions, mode
    assert a.encoded.module_keys["d3"] != b.encoded.module_keys["d3"]
    keys = set(a.encoded.keys()) | set(b.encoded.keys())
    assert len(keys) == 4
    lay = eng.layout(FLAT)
    tokens = sum(len(p) for p in lay.pieces)
    assert a.store_bytes == tokens * eng.lm.kv_bytes_per_token
    again = eng.encode(eng.layout(FLAT), eng.config.with_(mode="isolated"))
    assert again.reused and again.encoded.keys() == a.encoded.keys()
    assert {u.source for u in again.encoded.units} == {"memory"}


def test_arguments_defaults_nested_unions_and_uncached_modules(tiny_engine):
    schema = """<schema name="t">
      <system>Plan trips.</system>
      <user>
        <module name="plan">A trip of <param name="days" len="4"/> for <param name="who" len="5" default="two adults"/>.
          <union scaffold="near">
            <module name="near">Stay close to home.</module>
            <module name="far">Fly abroad to <union><module name="rome">Rome, Italy.</module>
              <module name="oslo">Oslo, Norway.</module></union></module>
          </union>
        </module>
        <module name="today" cache="false">Today is Monday.</module>
      </user>
    </schema>"""
    c = compare(tiny_engine, schema, "<prompt schema='t'><plan days='5 days'><far><oslo/></far></plan><today/> "
                "Suggest one museum.</prompt>", n=4)
    segs = c.plan.segments
    arg = next(s for s in segs if s.source == "argument")
    days = c.plan.layout.modules["plan"].params[0]
    assert arg.positions[0] == days.start and arg.token_ids == tuple(tiny_engine.codec.encode("5 days"))
    assert any(s.owner == "today" and s.kind != CACHED for s in segs)  # cache="false": prefilled
    oslo = [s for s in segs if s.owner == "plan/far/oslo"]
    assert oslo and all(s.kind == CACHED for s in oslo)
    assert c.plan.imported == ("plan", "plan/far", "plan/far/oslo", "today")
    assert len(c.cached.token_ids) >= 1 and len(c.baseline.token_ids) >= 1


def test_cached_decode_matches_baseline_when_exact(tiny_engine):
    # one module at the prompt's start + new text is ordinary prefix caching: every decoded token must agree
    c = compare(tiny_engine, FLAT, "<prompt schema='flat'><d1/> Go on:</prompt>", n=12)
    assert len(c.baseline.token_ids) == len(c.cached.token_ids) == 12  # random weights: no EOS this early
    assert c.cached.token_ids == c.baseline.token_ids and c.agreement().same_text
    assert c.agreement().max_first_logit_diff < 1e-4
    assert c.cached.prefill_tokens == len(tiny_engine.codec.encode(" Go on:")) + len(tiny_engine.codec.generation_prompt)
    assert c.baseline.prefill_tokens == len(tiny_engine.codec.encode(DOCS[0])) + c.cached.prefill_tokens
    parts = c.cached.copy_ms + c.cached.prefill_ms + c.cached.sample_ms
    assert c.cached.ttft_ms == pytest.approx(parts, rel=1e-6)  # TTFT is exactly copy + prefill + first sample


def test_json_contract_fields(tiny_engine):
    j = compare(tiny_engine, FLAT, "<prompt schema='flat'><d1/> Next?</prompt>", n=3).to_json()
    for field in ("model", "storage", "prompt_tokens", "cached_tokens", "uncached_tokens", "store_bytes", "same_text",
                  "first_divergence", "first_token_agree", "first_token_kl"):
        assert field in j
    for path in ("baseline", "cached"):
        for field in ("text", "ttft_ms", "decode_ms_per_token"):
            assert field in j[path]
    assert "copy_ms" in j["cached"] and j["cached"]["ttft_includes_copy"] is True
    assert j["cached_tokens"] + j["uncached_tokens"] == j["prompt_tokens"]


def test_repair_with_question_retention_is_refused_up_front():
    from engine.config import Compression, RunConfig
    from engine.errors import EngineError

    with pytest.raises(EngineError, match="cannot be combined"):
        RunConfig.make(repair=4, compression=Compression(0.5, "question"))
    assert RunConfig.make(repair=4, compression=Compression(0.5, "pyramid")).settings_of("cached").repair == 4
