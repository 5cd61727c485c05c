"""The oracle: the engine's baseline run equals stock transformers on the same token ids.

Stock means an untouched model object with transformers' own SDPA attention (not the engine's
registered attention) driven by `model(ids)` and `model.generate`, so an error in the engine's
buffer, positions, masking or decode loop shows up as a difference here.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SAMPLES
from engine.runner import Sampling, run_baseline

N_NEW = 8


def stock_figures(model, ids: list[int], n_new: int, eos: tuple[int, ...]):
    """(last-position logits, greedy continuation) of a stock model, computed by transformers alone."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(input_ids=x).logits[0, -1].float()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, do_sample=False,
                             eos_token_id=list(eos), pad_token_id=eos[0])
    return logits, tuple(out[0, len(ids):].tolist())


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
def test_real_baseline_equals_stock_transformers(real_engine):
    from transformers import AutoModelForCausalLM

    from engine.models import default_model_dir

    stock = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    schema = (SAMPLES / "doc_qa.xml").read_text()
    prompt = (SAMPLES / "doc_qa.prompt.xml").read_text()
    check_against_stock(real_engine.lm, stock, schema, prompt)
