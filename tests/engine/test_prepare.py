"""``Engine.prepare`` lays a schema out and plans a prompt once; ``Engine.run`` runs arms on it, as often as asked."""

from __future__ import annotations

import pytest

from engine.arms.registry import Sampling
from engine.errors import ContextLengthError, EngineError
from engine.session import Engine
from tests.engine.test_engine_tiny import FLAT

PROMPT = "<prompt schema='flat'><d1/> What jumps over the dog?</prompt>"


def test_run_on_a_prepared_prompt_is_compare(tiny_engine):
    calls = []
    laid = tiny_engine.layout
    tiny_engine.layout = lambda *a, **k: calls.append(a) or laid(*a, **k)
    try:
        prepared = tiny_engine.prepare(FLAT, PROMPT, prompt_source="q.xml")
        first, again = (tiny_engine.run(prepared, Sampling(4)) for _ in range(2))
    finally:
        del tiny_engine.layout
    assert len(calls) == 1 and prepared.prompt_source == "q.xml" and prepared.plan.layout is prepared.layout
    whole = tiny_engine.compare(FLAT, PROMPT, Sampling(4))
    assert first.arm("cached").run.text == again.arm("cached").run.text == whole.arm("cached").run.text
    assert first.arm("baseline").run.token_ids == whole.arm("baseline").run.token_ids


def test_run_checks_the_answer_fits_and_the_tokenizer_is_this_engines(tiny_engine, tiny_lm):
    prepared = tiny_engine.prepare(FLAT, PROMPT, prompt_source="q.xml")
    with pytest.raises(ContextLengthError, match=r"q\.xml:1:1: error: .* at most \d+ new tokens fit"):
        tiny_engine.run(prepared, Sampling(prepared.plan.room + 1))
    other = Engine.from_loaded(tiny_lm)
    other._codec = type(tiny_lm.codec)(**{**vars(tiny_lm.codec), "fingerprint": "another"})
    with pytest.raises(EngineError, match="another tokenizer"):
        other.run(prepared, Sampling(1))
