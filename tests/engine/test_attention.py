"""The grouped-query shortcut of the engine's attention (masked multi-token CPU calls): taken, and exact."""

from __future__ import annotations

import torch

from engine.model import attend  # the module whose globals the attention function reads
from engine.arms.registry import Sampling
from tests.arm_runs import run_cached

SCHEMA = """<schema name="g">
  <system>You answer questions about the documents.</system>
  <user>
    <module name="d1">The red fox jumps over the lazy dog near the river bank every morning.</module>
    <module name="d2">Quantum computers use qubits that can hold superpositions of states.</module>
  </user>
</schema>"""


def test_cached_prefill_takes_the_grouped_path_and_equals_transformers_own(tiny_engine, monkeypatch):
    eng = tiny_engine
    assert eng.lm.model.config.num_attention_heads > eng.lm.model.config.num_key_value_heads  # grouped heads
    lay = eng.layout(SCHEMA)
    plan = eng.plan(lay, "<prompt schema='g'><d1/><d2/> Which animal jumps over the dog?</prompt>", 6)
    enc = eng.encode(lay).encoded
    taken = []
    real = attend._grouped_masked_cpu
    monkeypatch.setattr(attend, "_grouped_masked_cpu", lambda *a: taken.append(real(*a)) or taken[-1])
    fast = run_cached(eng.lm, plan, enc, eng.store(), Sampling(6))
    assert any(taken)  # the uncached tokens over the module cache went through the shortcut
    monkeypatch.setattr(attend, "_GQA_WITH_MASK", False)
    stock = run_cached(eng.lm, plan, enc, eng.store(), Sampling(6))
    assert torch.allclose(fast.first_logits, stock.first_logits, atol=1e-5)
    assert fast.token_ids == stock.token_ids
