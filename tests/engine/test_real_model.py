"""Every sample schema really encoded and run on the default model (a few tokens each)."""

from __future__ import annotations

import pytest

from conftest import SAMPLES, arm_ms, decoded_fully, sample_pairs, stock_figures, timed
from engine.arms.registry import Sampling

pytestmark = pytest.mark.real_model


def test_default_model_facts(real_engine):
    info = real_engine.info()
    assert info["model"] == "SmolLM2-135M-Instruct"
    assert info["kv_bytes_per_token"] == 46_080  # 2 x 30 layers x 3 kv heads x 64 dims x 4 bytes
    assert info["layers"] == 30 and info["max_positions"] == 8192
    assert 130e6 < info["parameters"] < 140e6


@pytest.mark.parametrize("name, schema, prompt", sample_pairs(), ids=[n for n, _, _ in sample_pairs()])
def test_sample_encodes_and_runs(real_engine, real_stock, name, schema, prompt):
    # the modular arm against the full prefill; the prefix arm, cold here, would prefill all again (its
    # exactness on this model: test_prefix_arm_is_exact_on_the_real_model)
    only = real_engine.config.with_(arms=("baseline", "cached"))
    c, wall_ms = timed(real_engine.compare, schema.read_text(), prompt.read_text(), Sampling(3),
                       schema_source=str(schema), prompt_source=str(prompt), config=only)
    assert c.plan.cached_tokens > c.plan.uncached_tokens > 0
    eos = real_engine.lm.eos_ids
    logits, greedy = stock_figures(real_stock, c.plan.token_ids, 3, eos)  # transformers alone, same token ids
    assert c.baseline.token_ids == greedy and float((c.baseline.first_logits - logits).abs().max()) < 1e-4
    assert decoded_fully(c.cached, 3, eos)
    assert c.to_json()["same_text"] == (c.cached.token_ids == c.baseline.token_ids)
    assert arm_ms(c) <= wall_ms  # every arm's TTFT and decode time lie inside the call
    assert c.store.nbytes == sum(real_engine.store().get(k).nbytes for k in set(c_keys(real_engine, schema)))


def c_keys(eng, schema):
    lay = eng.layout(schema.read_text())
    return eng.encode(lay).encoded.keys()


def test_store_bytes_match_kv_bytes_per_token(real_engine):
    lay = real_engine.layout((SAMPLES / "doc_qa.xml").read_text())
    enc = real_engine.encode(lay)
    tokens = sum(len(p) for p in lay.pieces)  # no unions or scaffolds in doc_qa: every token stored once
    assert enc.store_bytes == tokens * real_engine.lm.kv_bytes_per_token


def test_scaffold_sample_is_exact_on_the_real_model(real_engine):
    c = real_engine.compare((SAMPLES / "scaffold.xml").read_text(), (SAMPLES / "scaffold.prompt.xml").read_text(),
                            Sampling(8))
    assert c.plan.scaffolds == ("policy-and-faq",)
    assert c.agreement().max_first_logit_diff < 1e-4 and c.agreement().same_text


def test_prefixed_first_module_is_exact_on_the_real_model(real_engine):
    schema = (SAMPLES / "doc_qa.xml").read_text()
    first = real_engine.layout(schema).top_level()[0]
    c = real_engine.compare(schema, f"<prompt schema='doc_qa'><{first}/> How many days a week is remote work "
                            "allowed?</prompt>", Sampling(8), config=real_engine.config.with_(mode="prefixed"))
    assert c.agreement().max_first_logit_diff < 1e-4 and c.agreement().same_text


def test_layouts_before_and_after_the_model_loads_share_cache_keys():
    from engine.model.load import load_tokenizer

    schema = (SAMPLES / "doc_qa.xml").read_text()
    from engine.session import Engine

    eng = Engine()
    before = eng.layout(schema)  # tokenizer only
    assert not eng.loaded
    eng.lm
    after = eng.layout(schema)
    assert before.fingerprint == after.fingerprint
    assert load_tokenizer(None)[2].fingerprint == eng.lm.codec.fingerprint
