"""Layout (position ids) and prompt planning, on a word-level fake tokenizer (pure, no torch)."""

from __future__ import annotations

import pytest

from engine.errors import ContextLengthError, PMLError
from engine.schema.layout import TextCodec, layout
from engine.schema.plan import CACHED, UNCACHED, plan_prompt
from engine.schema.pml import parse_prompt, parse_schema

VOCAB: dict[str, int] = {}


def encode(text: str) -> list[int]:
    """One token per whitespace-separated word (ids are stable within the test session)."""
    return [VOCAB.setdefault(w, 100 + len(VOCAB)) for w in text.split()]


def codec(max_positions: int = 4096) -> TextCodec:
    return TextCodec(encode=encode, role_open={"system": (1, 2), "user": (1, 3), "assistant": (1, 4)},
                     role_close={r: (5,) for r in ("system", "user", "assistant")}, generation_prompt=(1, 4),
                     bos=(), placeholder=0, max_positions=max_positions, fingerprint="fake")


SCHEMA = """<schema name="trip">
  <system>sys one two</system>
  <user>
    <module name="intro">a b c</module>
    <module name="plan">go for <param name="days" len="3"/> days <param name="who" len="4" default="my kids"/> ok
      <union scaffold="far">
        <module name="near">n1 n2</module>
        <module name="far">f1 f2 f3 f4 <union><module name="x">x1</module><module name="y">y1 y2</module></union></module>
      </union>
      end
    </module>
  </user>
  <scaffold name="both" modules="intro plan"/>
</schema>"""


@pytest.fixture()
def lay():
    return layout(parse_schema(SCHEMA, "s.xml"), codec())


def plan(lay, prompt: str, **kw):
    return plan_prompt(lay, parse_prompt(prompt, "p.xml"), **kw)


def test_positions_follow_the_spec(lay):
    m = lay.modules
    # anonymous: <system open>(2) sys one two(3) <close>(1) <user open>(2) = 8 tokens, then intro
    assert (m["intro"].start, m["intro"].end) == (8, 11)
    plan_ = m["plan"]
    assert plan_.start == 11
    days, who = plan_.params
    assert (days.start, days.length) == (13, 3)  # "go for" then 3 positions
    assert (who.start, who.length, who.default_tokens) == (17, 4, 2)  # after "days"
    near, far = m["plan/near"], m["plan/far"]
    assert near.start == far.start == 22  # after "ok": union members share their start
    x, y = m["plan/far/x"], m["plan/far/y"]
    assert x.start == y.start == far.start + 4
    assert far.end == far.start + 4 + 2  # longest inner member (y) decides
    union = lay.unions[near.union]
    assert union.end == far.end and union.default == "plan/far"
    assert lay.pieces[-2].start == far.end  # "end" follows the longest member
    assert lay.length == far.end + 1 + 1  # "end" + user close


def test_layout_rows_for_the_editor(lay):
    rows = {r["module"]: r for r in lay.rows()}
    assert rows["plan"]["params"] == "days[3], who[4]"
    assert rows["plan/far/y"]["tokens"] == 2
    assert list(rows) == ["intro", "plan", "plan/near", "plan/far", "plan/far/x", "plan/far/y"]


def test_unit_pieces_resolve_unions(lay):
    base = lay.unit_pieces("plan", {})
    owners = {lay.pieces[i].owner for i in base}
    assert owners == {"plan", "plan/far"}  # union default member 'far'; inner union has no default
    with_y = lay.unit_pieces("plan", lay.variant_of("plan/far/y"))
    assert {lay.pieces[i].owner for i in with_y} == {"plan", "plan/far", "plan/far/y"}


def test_context_overflow_names_the_module():
    with pytest.raises(ContextLengthError) as info:
        layout(parse_schema(SCHEMA, "s.xml"), codec(max_positions=20))
    assert "s.xml:1:1: error:" in str(info.value) and "module 'plan'" in str(info.value)


def test_default_longer_than_len_is_an_error():
    with pytest.raises(PMLError) as info:
        layout(parse_schema("<schema name='a'><module name='m'><param name='p' len='1' default='two words'/>"
                            "</module></schema>", "s.xml"), codec())
    assert "is 2 tokens, more than its len=1" in str(info.value)


def test_plan_arguments_defaults_and_tail(lay):
    p = plan(lay, "<prompt schema='trip'><intro/><plan days='five'><far><y/></far></plan> what now ?</prompt>")
    kinds = [(s.kind, s.source, s.owner) for s in p.segments]
    arg = next(s for s in p.segments if s.source == "argument")
    assert arg.positions == (13,) and arg.kind == UNCACHED  # at the param's first position
    who_default = [s for s in p.segments if s.owner == "plan" and s.positions and s.positions[0] == 17]
    assert who_default[0].token_ids == tuple(encode("my kids"))  # default kept, padding dropped
    # the question follows the last import, then the user-close and the generation prompt: all prefilled
    assert kinds[-3:] == [(UNCACHED, "text", ""), (UNCACHED, "anonymous", ""), (UNCACHED, "template", "")]
    end_of_y = lay.modules["plan/far/y"].end
    text_seg = p.segments[-3]
    # 'end' (plan's last text) is cached at its layout position; the question continues after it
    assert text_seg.positions[0] == lay.pieces[-2].end
    # prefilled: the argument, the question, the user turn's close (tail) and the generation prompt
    assert p.uncached_tokens == len(encode("five")) + len(encode("what now ?")) + 1 + 2
    assert end_of_y <= text_seg.positions[0]
    assert p.scaffolds == ("both",)
    covered = [s for s in p.segments if s.kind == CACHED and s.scaffold == "both"]
    assert {s.owner for s in covered} >= {"intro", "plan", "plan/far"}
    assert all(s.scaffold is None for s in p.segments if s.owner == "plan/far/y")  # not in the base unit


def test_role_text_is_a_new_turn_after_the_schema(lay):
    p = plan(lay, "<prompt schema='trip'><intro/><user>hello there</user></prompt>")
    *_, turn, gen = p.segments
    assert turn.token_ids == (1, 3) + tuple(encode("hello there")) + (5,)
    assert gen.token_ids == (1, 4)
    assert p.segments[-3].source == "anonymous" and p.segments[-3].kind == CACHED  # schema's user close: cached


@pytest.mark.parametrize("prompt, expected", [
    ("<prompt schema='other'><intro/></prompt>", "written for schema 'other' but the schema is 'trip'"),
    ("<prompt schema='trip'><intr/></prompt>", "unknown module <intr> at the schema's top level; hint: valid here: intro, plan"),
    ("<prompt schema='trip'><intro/><intro/></prompt>", "imported twice"),
    ("<prompt schema='trip'><plan days='1' weeks='2'/></prompt>", "has no param 'weeks'"),
    ("<prompt schema='trip'><plan days='one two three four'/></prompt>", "is 4 tokens but the param allows 3"),
    ("<prompt schema='trip'><plan/></prompt>", "needs an argument for param 'days'"),
    ("<prompt schema='trip'><plan days='1'><near/><far/></plan></prompt>", "members of one union"),
    ("<prompt schema='trip'><plan days='1'><x/></plan></prompt>", "unknown module <x> at module 'plan'"),
])
def test_prompt_validation_errors(lay, prompt, expected):
    with pytest.raises(PMLError) as info:
        plan(lay, prompt)
    text = str(info.value)
    assert expected in text and text.startswith("p.xml:1:")


def test_prompt_over_context_is_refused(lay):
    with pytest.raises(ContextLengthError) as info:
        plan(lay, "<prompt schema='trip'><intro/> q</prompt>", max_new_tokens=5000)
    assert "context is 4096" in str(info.value)


def test_gaps_where_modules_are_not_imported(lay):
    p = plan(lay, "<prompt schema='trip'><plan days='1'><near/></plan> q</prompt>")
    pos = [x for s in p.segments if s.kind == CACHED for x in s.positions]
    assert 7 in pos and 11 in pos and not any(8 <= x < 11 for x in pos)  # 'intro' (8..10) left out: a gap
    assert pos == sorted(pos)
