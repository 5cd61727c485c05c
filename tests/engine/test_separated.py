"""CacheBlend's separator form (engine/schema/separated.py): each module tokenized alone, no BOS, the separator's token
ids between them; checked against the tokenizer itself on the tests' model (tokenizer only, no weights)."""

from __future__ import annotations

import pytest

from engine.schema.separated import SEPARATOR, separated, separated_plan
from test_prefix import SCHEMA  # three documents d1, d2, d3

TEXTS = {"d1": "The red fox jumps over the lazy dog near the river bank every morning.",
         "d2": "Quantum computers use qubits that can hold superpositions of states.",
         "d3": "The library opens at nine and closes at five on weekdays."}


@pytest.fixture(scope="module")
def engine():
    from engine.session import Engine

    return Engine()  # the tests' model; layout and plan read its tokenizer only


@pytest.mark.parametrize("imports", [("d1", "d3"), ("d2",), ("d1", "d2", "d3")])
def test_each_module_is_tokenized_alone_between_separators(engine, imports):
    tok = engine.tokenizer
    plan = engine.plan(engine.layout(SCHEMA), f'<prompt schema="docs">{"".join(f"<{m}/>" for m in imports)} '
                                              "When does the library open?</prompt>")
    form = separated_plan(plan, engine.codec.encode, tok.decode)
    ids, sep = list(form.token_ids), tok.encode(SEPARATOR, add_special_tokens=False)
    assert form.separator_ids == tuple(sep) and len(sep) > 0
    assert [name for name, _, _ in form.chunks] == list(imports)  # schema order
    for name, a, b in form.chunks:
        alone = tok.encode(TEXTS[name], add_special_tokens=False)  # the module's text, tokenized by itself
        assert ids[a:b] == alone and ids[a - len(sep):a] == sep
        assert tok.bos_token_id is None or ids[a] != tok.bos_token_id
    last = form.chunks[-1][2]
    assert ids[last:last + len(sep)] == sep
    # what surrounds the modules is the plan's own: the chat opening and system text before, the question after
    first = form.chunks[0][1] - len(sep)
    assert ids[:first] == plan.token_ids[:first]
    assert tok.decode(ids[last + len(sep):]).endswith("When does the library open?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(ids).count(SEPARATOR.strip()) == len(imports) + 1


def test_the_form_from_texts_puts_one_separator_before_each_chunk_and_before_the_tail():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731  (one id per character)
    form = separated(encode, [1, 2], [("a", "xy"), ("b", "z")], [9], separator="#")
    assert form.token_ids == (1, 2, 35, 120, 121, 35, 122, 35, 9)
    assert form.chunks == (("a", 3, 5), ("b", 6, 7))
