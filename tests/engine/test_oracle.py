"""The oracle: the engine's baseline run equals stock transformers on the same token ids.

Stock means an untouched model object with transformers' own SDPA attention (not the engine's
registered attention) driven by `model.generate` (its first step's logits and its greedy ids), so
an error in the engine's buffer, positions, masking or decode loop shows up as a difference here.
"""

from __future__ import annotations

import pytest

from conftest import SAMPLES, stock_figures
from engine.arms.registry import Sampling
from tests.arm_runs import run_baseline

N_NEW = 8


def check_against_stock(lm, stock_model, schema: str, prompt: str) -> None:
    from engine.session import Engine

    eng = Engine.from_loaded(lm)
    plan = eng.plan(eng.layout(schema), prompt, max_new_tokens=N_NEW)
    ours = run_baseline(lm, plan, Sampling(N_NEW))
    logits, greedy = stock_figures(stock_model, plan.token_ids, N_NEW, lm.eos_ids)
    assert stock_model.config._attn_implementation == "sdpa"  # really the stock attention
    assert float((ours.first_logits - logits).abs().max()) < 1e-4
    assert ours.token_ids == greedy[: len(ours.token_ids)] and len(ours.token_ids) == len(greedy)


def test_tiny_baseline_equals_stock_transformers(tiny_lm):
    from transformers import LlamaForCausalLM

    stock = LlamaForCausalLM(tiny_lm.model.config.__class__(**{**tiny_lm.model.config.to_dict(),
                                                               "attn_implementation": "sdpa"})).eval()
    stock.load_state_dict(tiny_lm.model.state_dict())
    schema = (SAMPLES / "travel.xml").read_text()
    prompt = (SAMPLES / "travel.prompt.xml").read_text()
    check_against_stock(tiny_lm, stock, schema, prompt)


@pytest.mark.real_model
def test_real_baseline_equals_stock_transformers(real_engine, real_stock):
    schema = (SAMPLES / "doc_qa.xml").read_text()
    prompt = (SAMPLES / "doc_qa.prompt.xml").read_text()
    check_against_stock(real_engine.lm, real_stock, schema, prompt)
