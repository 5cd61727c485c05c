"""The text a run streams (engine/run/stream.py): decoded incrementally, it equals ``tokenizer.decode`` of every
token so far — over characters split across byte tokens, special tokens and a model's own runs — and each token
decodes a few tokens, however long the text."""

from __future__ import annotations

import pytest

from engine.arms.registry import Sampling
from engine.run.stream import LOOKBACK, PENDING, TextStream
from tests.arm_runs import streamed

SCHEMA = """<schema name="s">
  <system>You answer briefly.</system>
  <module name="a">Alpha owns a red kite and lives in Oslo.</module>
</schema>"""
PROMPT = """<prompt schema="s"><a/><user>Where does Alpha live?</user></prompt>"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character its token is spelled with."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def _byte_tokens(tok, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte (byte-level BPE has a token for each byte)."""
    chars = bytes_to_unicode()
    return tok.convert_tokens_to_ids([chars[b] for b in text.encode()])


def _streamed(tok, ids: list[int]) -> list[str]:
    stream = TextStream(tok)
    return [stream.push(i) for i in ids]


def _decoded(tok, ids: list[int]) -> list[str]:
    return [tok.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))]


def test_characters_split_over_byte_tokens_stream_as_decode_shows_them(tokenizer_bundle):
    tok = tokenizer_bundle[1]
    words = tok.encode("hi 😀 there 日本, ok", add_special_tokens=False)  # the emoji spans two tokens here
    ids = (words + _byte_tokens(tok, "😀é日") + [tok.eos_token_id] + _byte_tokens(tok, " 🎉x")
           + tok.encode(" done", add_special_tokens=False))
    assert len(_byte_tokens(tok, "😀")) == 4
    assert _streamed(tok, ids) == _decoded(tok, ids)
    assert "\ufffd" in "".join(_decoded(tok, ids))  # unfinished characters were on the way


def test_broken_bytes_stream_as_decode_shows_them(tokenizer_bundle):
    """Orphan continuation bytes, a character cut short, then text: each step still equals decode()."""
    tok, chars = tokenizer_bundle[1], bytes_to_unicode()
    ids = tok.convert_tokens_to_ids([chars[b] for b in b"\x80\x80a\xf0\x9f\x98b\xe6\x97\xa5\xf0"])
    ids += tok.encode(" end", add_special_tokens=False) + [tok.convert_tokens_to_ids(chars[0x9f])] * 7
    assert _streamed(tok, ids) == _decoded(tok, ids)


def test_each_token_decodes_a_few_tokens_however_long_the_text(tokenizer_bundle):
    tok = tokenizer_bundle[1]
    sizes: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(" the quick brown fox 😀 jumps over 日本 the lazy dog." * 20, add_special_tokens=False)
    stream = TextStream(Counting())
    texts = [stream.push(i) for i in ids]
    assert len(ids) > 200 and texts[-1] == tok.decode(ids)
    assert max(sizes) <= LOOKBACK + PENDING + 1


@pytest.mark.parametrize("decode", ["together", "apart"])
def test_a_tiny_models_streamed_text_is_the_decode_of_its_tokens(tiny_engine, decode):
    seen: dict[str, list[str]] = {}
    res = streamed(tiny_engine.events(SCHEMA, PROMPT, Sampling(max_new_tokens=24, temperature=1.5, seed=3),
                                      config=tiny_engine.config.with_(decode=decode)), seen)
    tok = tiny_engine.lm.tokenizer
    assert set(seen) == {a.value for a in res.arms}
    for arm, texts in seen.items():
        ids = list(res.arm(arm).run.token_ids)
        assert texts == _decoded(tok, ids) and texts[-1] == res.arm(arm).run.text, arm
