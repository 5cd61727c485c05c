"""A codec tokenizes each long text once while it is remembered: the ids are the tokenizer's, a copy per call,
and the memory stays within its bounds (least recently used out first)."""

from __future__ import annotations

import pytest

from engine.model.chat import make_codec
from engine.model.tokens import MIN_CHARS, CachedEncode
from engine.schema.layout import layout
from engine.schema.pml import parse_schema
from tests.conftest import spy_on_encode


class Counting:
    """A stand-in tokenizer: one id per character, each call counted."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.calls.append(text)
        return [ord(c) for c in text]


def long(tag: str, n: int = MIN_CHARS) -> str:
    return (tag * n)[:n]


def test_a_long_text_is_tokenized_once_and_each_caller_gets_its_own_ids():
    raw = Counting()
    encode = CachedEncode(raw)
    text = long("ab")
    first = encode(text)
    first.append(-1)  # a caller that mutates its ids changes nothing for the next
    assert encode(text) == [ord(c) for c in text] and raw.calls == [text]


def test_short_and_oversized_texts_are_not_remembered():
    raw = Counting()
    encode = CachedEncode(raw, max_chars=4 * MIN_CHARS)
    short, huge = "x" * (MIN_CHARS - 1), long("h", 4 * MIN_CHARS + 1)
    for text in (short, short, huge, huge):
        assert encode(text) == [ord(c) for c in text]
    assert raw.calls == [short, short, huge, huge] and len(encode) == 0


def test_the_least_recently_used_text_goes_first_within_the_bounds():
    raw = Counting()
    encode = CachedEncode(raw, max_chars=3 * MIN_CHARS, max_texts=10)
    a, b, c, d = (long(t) for t in "abcd")
    for text in (a, b, c, a, d):  # d makes 4 texts' worth: b, the least recently used, goes
        encode(text)
    raw.calls.clear()
    for text in (a, c, d, b):
        encode(text)
    assert raw.calls == [b] and len(encode) == 3
    few = CachedEncode(raw, max_texts=2)
    raw.calls.clear()
    for text in (a, b, c, c, a):  # a third text sends a, the oldest, out
        few(text)
    assert raw.calls == [a, b, c, a] and len(few) == 2


def test_a_schema_laid_out_twice_tokenizes_its_module_once(tokenizer_bundle, monkeypatch):
    tok = tokenizer_bundle[1]
    codec = make_codec(tok, 2048, "cached-test")
    plain = tok.encode
    seen = spy_on_encode(monkeypatch, tok)
    doc = "A module long enough to be remembered: " + " ".join(f"river {i} runs to the sea." for i in range(20))
    schema = f'<schema name="s"><module name="m">{doc}</module></schema>'
    first, second = layout(parse_schema(schema), codec), layout(parse_schema(schema), codec)
    assert seen.count(doc) == 1
    assert first.modules["m"] == second.modules["m"] and first.fingerprint == second.fingerprint
    own = first.pieces[first.modules["m"].pieces[0]]
    assert list(own.token_ids) == plain(doc, add_special_tokens=False)
