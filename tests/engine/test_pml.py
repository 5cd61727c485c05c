"""Parsing and validation of PML documents (no model needed)."""

from __future__ import annotations

import pytest

from conftest import SAMPLES
from engine.errors import PMLError, Problem
from engine.schema.pml import Module, Param, Role, Text, Union, compact, parse_prompt, parse_schema


def problems(text: str, prompt: bool = False) -> list[str]:
    with pytest.raises(PMLError) as info:
        (parse_prompt if prompt else parse_schema)(text, "t.xml")
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize("path", sorted(p for p in SAMPLES.glob("*.xml") if not p.name.endswith(".prompt.xml")))
def test_every_sample_schema_parses(path):
    schema = parse_schema(path.read_text(), str(path))
    assert schema.name == path.stem
    assert list(schema.modules())


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.prompt.xml")))
def test_every_sample_prompt_parses(path):
    prompt = parse_prompt(path.read_text(), str(path))
    assert prompt.schema == path.name.removesuffix(".prompt.xml")


def test_structure_of_the_spec_example():
    s = parse_schema("""<schema name="cities">
  <system>You are a travel planner.</system>
  <user>
    <module name="city-info">Facts about the cities below.</module>
    <module name="trip-plan">Plan a trip lasting <param name="duration" len="3"/> for a family.</module>
    <union scaffold="miami">
      <module name="tokyo">Tokyo is big.</module>
      <module name="miami">Miami is warm.</module>
    </union>
  </user>
  <scaffold name="plan-and-info" modules="city-info trip-plan"/>
</schema>""")
    assert s.name == "cities"
    system, user = [c for c in s.children if isinstance(c, Role)]
    assert system.children == (Text("You are a travel planner.", 2),)
    trip = user.children[1]
    assert isinstance(trip, Module) and trip.name == "trip-plan"
    assert [type(c) for c in trip.children] == [Text, Param, Text]
    assert trip.children[0].text == "Plan a trip lasting "  # trailing space kept: it joins the argument
    assert trip.children[1] == Param("duration", 3, None, 5)
    union = user.children[2]
    assert isinstance(union, Union) and union.scaffold == "miami"
    assert [m.name for m in union.members] == ["tokyo", "miami"]
    assert s.scaffolds[0].modules == ("city-info", "trip-plan")
    assert [p for p, _ in s.modules()] == ["city-info", "trip-plan", "tokyo", "miami"]


def test_whitespace_is_collapsed_at_the_ends_only():
    assert compact("\n    Hello\n      world  \n") == " Hello\n      world "
    assert compact("  \n ") == ""
    assert compact("x") == "x"
    s = parse_schema("<schema name='c'><module name='code'><![CDATA[\ndef f(a, b):\n    return a < b && b\n]]></module></schema>")
    text = s.children[0].children[0].text
    assert "    return a < b && b" in text


def test_reference_dialect_loads_unmodified():
    s = parse_schema("""<schema name="travel">
    <module name="travel-plan">
        I'm gearing up for a memorable escape for
        <parameter name="duration" length="5"/>
        days with <parameter name="who" length="6" scaffold="my family"/>.
        <union>
            <module name='domestic'>the city of <parameter name="city"/>.</module>
            <module name="overseas">abroad.</module>
        </union>
    </module>
</schema>""")
    plan = s.children[0]
    params = [c for c in plan.children if isinstance(c, Param)]
    assert params[0] == Param("duration", 5, None, 4)
    assert params[1].default == "my family"
    city = [c for c in plan.children if isinstance(c, Union)][0].members[0].children[1]
    assert city.name == "city" and city.length == 16  # reference default length when `length` is absent


def test_lt_in_code_gets_the_cdata_hint():
    (line,) = problems("<schema name='c'>\n<module name='m'>if a < b: pass</module></schema>")
    assert line.startswith("t.xml:2:")
    assert "error: malformed XML" in line
    assert "<![CDATA[" in line and "&lt;" in line


def test_bare_ampersand_hint():
    (line,) = problems("<schema name='c'><module name='m'>a && b</module></schema>")
    assert "&amp;" in line


def test_unclosed_tag_is_located():
    """At the start tag left open (line 2, column 3), not where the parser found </schema>."""
    (line,) = problems("<schema name='c'>\n  <module name='m'>text\n</schema>")
    assert line.startswith("t.xml:2:3:") and "<module> is never closed" in line and "</schema> on line 3" in line


@pytest.mark.parametrize("attack", [
    '<?xml version="1.0"?>\n<!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]>\n<schema name="a">&x;</schema>',
    '<!DOCTYPE s [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
    '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">]><schema name="a">&c;</schema>',
    '<!DOCTYPE s SYSTEM "http://127.0.0.1:9/x.dtd"><schema name="a"/>',
])
def test_doctype_entities_and_external_dtds_are_refused(attack):
    (line,) = problems(attack)
    assert "DOCTYPE and ENTITY declarations are not allowed" in line
    assert "root:" not in line  # nothing from /etc/passwd leaked into the message


@pytest.mark.parametrize("text", [
    "<![CDATA[ <!DOCTYPE html> ]]>",
    "<![CDATA[\n<!DOCTYPE html>\n<!ENTITY x 'y'>\n<html lang=\"en\"></html>\n]]>",
    "before <![CDATA[<!doctype html>]]> between <![CDATA[<!ENTITY % p SYSTEM \"file:///etc/passwd\">]]> after",
])
def test_doctype_inside_cdata_is_module_text(text):
    (name, module), = parse_schema(f"<schema name='web'><module name='page'>{text}</module></schema>").modules()
    body = "".join(c.text for c in module.children)
    assert name == "page" and "DOCTYPE" in body.upper() and "root:" not in body


def test_doctype_inside_a_comment_or_a_prompt_cdata_is_not_a_declaration():
    assert parse_schema("<!-- <!DOCTYPE x> --><schema name='a'><module name='m'>t</module></schema>").name == "a"
    prompt = parse_prompt("<prompt schema='a'><m/><![CDATA[ <!DOCTYPE html> ]]></prompt>")
    assert "<!DOCTYPE html>" in str(prompt)


@pytest.mark.parametrize("attack, where", [
    ("<![CDATA[ x ]]>\n<!DOCTYPE s [<!ENTITY x SYSTEM 'file:///etc/passwd'>]><schema name='a'>&x;</schema>", ":2:1:"),
    ("<!-- <![CDATA[ -->\n<!DOCTYPE s [<!ENTITY x SYSTEM 'file:///etc/passwd'>]><schema name='a'>&x;</schema>",
     ":2:1:"),  # a CDATA opener inside a comment hides nothing
    ("<![CDATA[ unterminated\n<!DOCTYPE s SYSTEM 'http://127.0.0.1:9/x.dtd'><schema name='a'/>", ":2:1:"),
])
def test_a_real_doctype_next_to_cdata_is_still_refused(attack, where):
    (line,) = problems(attack)
    assert where in line and "DOCTYPE and ENTITY declarations are not allowed" in line and "root:" not in line


def test_the_declaration_scan_is_linear_in_unclosed_openers():
    import time

    from engine.schema.xmldoc import _declaration

    start = time.perf_counter()
    assert _declaration("<!--" * 200_000 + "<![CDATA[" * 100_000 + "<?" * 200_000 + "\n<!DOCTYPE x>") == 2_100_001
    assert time.perf_counter() - start < 5  # a regex with lazy .*? per opener takes minutes here


@pytest.mark.parametrize("attack", [
    '<!DOCTYPE s [<!ENTITY x SYSTEM "file://{secret}">]><schema name="a"><module name="m">&x;</module></schema>',
    '<!DOCTYPE s [<!ENTITY % p SYSTEM "file://{secret}"> %p;]><schema name="a"><module name="m">t</module></schema>',
    '<!DOCTYPE s SYSTEM "file://{secret}"><schema name="a"><module name="m">t</module></schema>',
])
def test_the_parser_itself_never_reads_a_file_named_in_a_document(tmp_path, monkeypatch, attack):
    """With the text scan switched off, lxml still neither expands entities nor loads a DTD, and the
    parsed document's DOCTYPE is refused all the same."""
    import engine.schema.xmldoc as pml  # the one module that reads a document with lxml

    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    monkeypatch.setattr(pml, "_declaration", lambda text: None)
    with pytest.raises(PMLError) as info:
        parse_schema(attack.format(secret=secret), "t.xml")
    text = " ".join(str(p) for p in info.value.problems)
    assert "TOP-SECRET" not in text and "DOCTYPE and ENTITY declarations are not allowed" in text
    assert {k: pml.PARSER_OPTIONS[k] for k in ("resolve_entities", "no_network", "load_dtd", "huge_tree")} == {
        "resolve_entities": False, "no_network": True, "load_dtd": False, "huge_tree": False}


def test_xinclude_is_never_processed(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    include = f'<xi:include xmlns:xi="http://www.w3.org/2001/XInclude" href="{secret}" parse="text"/>'
    (line,) = problems(f"<schema name='a'><module name='m'>{include}</module></schema>")
    assert "unknown element" in line and "TOP-SECRET" not in line
    prompt = parse_prompt(f"<prompt schema='a'>{include}</prompt>", "p.xml")  # an import no schema has
    assert "TOP-SECRET" not in repr(prompt) and prompt.items[0].name.endswith("}include")


def test_undefined_entity_is_a_syntax_error():
    (line,) = problems("<schema name='a'><module name='m'>&nbsp;</module></schema>")
    assert "malformed XML" in line


@pytest.mark.parametrize("doc, expected", [
    ("<schema name='a'><module name='m'><b>bold</b></module></schema>", "unknown element <b> in module 'm'"),
    ("<schema name='a'><module name='m'/><module name='m'/></schema>", "module 'm' is declared twice"),
    ("<schema name='a'><user><module name='m'/></user><module name='m'/></schema>", "declared twice"),
    ("<schema name='a'><param name='p' len='3'/></schema>", "only allowed inside a <module>"),
    ("<schema name='a'><module name='m'><param name='p'/></module></schema>", "needs a len attribute"),
    ("<schema name='a'><module name='m'><param name='p' len='0'/></module></schema>", "positive whole number"),
    ("<schema name='a'><module name='m'><param name='p' len='2'/><param name='p' len='2'/></module></schema>",
     "declared twice"),
    ("<schema name='a'><union>loose text<module name='x'/></union></schema>", "text directly inside <union>"),
    ("<schema name='a'><union scaffold='z'><module name='x'/></union></schema>", "is not one of its members"),
    ("<schema name='a'><module name='m'><user>hi</user></module></schema>", "only allowed at the top"),
    ("<schema name='a'><module name='1bad'/></schema>", "not a valid identifier"),
    ("<schema name='a'><module name='m' cache='maybe'/></schema>", "cache=\"maybe\""),
    ("<schema name='a'><module nam='m'/></schema>", "unknown attribute 'nam'"),
    ("<schema name='a'><module name='x'/><scaffold name='s' modules='x y'/></schema>",
     "'y', which is not a top-level module"),
    ("<schema name='a'><module name='x'/><scaffold name='s' modules='x'/></schema>", "needs at least two"),
    ("<schema name='a'><union><module name='x'/><module name='y'/></union><scaffold name='s' modules='x y'/></schema>",
     "two members of one union"),
    ("<schema name='a'><module name='user'/></schema>", "reserved"),
    ("<prompt schema='a'/>", "a schema starts with <schema"),
    ("", "the document is empty"),
])
def test_schema_errors_name_the_problem(doc, expected):
    lines = problems(doc)
    assert any(expected in line for line in lines), lines
    assert all(line.startswith("t.xml:") and ": error: " in line for line in lines)


def test_several_problems_are_reported_together():
    lines = problems("<schema name='a'>\n<module name='m'><b/></module>\n<module name='m'/>\n</schema>")
    assert len(lines) == 2
    assert lines[0].startswith("t.xml:2:") and lines[1].startswith("t.xml:3:")


@pytest.mark.parametrize("doc, expected", [
    ("<prompt schema='a'><doc>text inside</doc></prompt>", "contains text"),
    ("<prompt schema='a'><module name='x'/></prompt>", "schema element"),
    ("<prompt schema='a'><user><doc/></user></prompt>", "holds new text only"),
    ("<prompt><doc/></prompt>", "needs a 'schema' attribute"),
])
def test_prompt_errors(doc, expected):
    lines = problems(doc, prompt=True)
    assert any(expected in line for line in lines), lines


def test_prompt_items_keep_order_and_roles():
    p = parse_prompt("<prompt schema='s'>\n  <a x='1'><b/></a>\n  Question one?\n  <user>Follow-up</user>\n</prompt>")
    a, text, user = p.items
    assert a.name == "a" and a.args == (("x", "1"),) and a.children[0].name == "b"
    assert text.text.strip() == "Question one?" and text.role is None
    assert user.role == "user" and user.text == "Follow-up"


# ----------------------------------------------------------------------------------------------
# Many problems: located in one pass over the text, the first listed, the rest counted
# ----------------------------------------------------------------------------------------------

def many_attributes(n: int, per_line: int = 50) -> str:
    """A schema whose one module has ``n`` unknown attributes, ``per_line`` to a line, their values multibyte."""
    rows = ["  " + " ".join(f'a{i}="ü€"' for i in range(k, min(k + per_line, n))) for k in range(0, n, per_line)]
    return '<schema name="s">\n<module name="m"\n' + "\n".join(rows) + ">text</module>\n</schema>\n"


def editor_place(text: str, offset: int) -> tuple[int, int]:
    """(line, column) of ``offset`` counted the slow, obvious way."""
    before = text[:offset].split("\n")
    return len(before), len(before[-1]) + 1


def test_thousands_of_problems_list_the_first_where_an_editor_shows_them_and_count_the_rest(monkeypatch):
    """5,000 unknown attributes: the first MAX_PROBLEMS are located (only they: locating each one used to count
    newlines from the text's start) and the error says how many more there are."""
    from engine.errors import MAX_PROBLEMS
    from engine.schema import pml

    made = []
    monkeypatch.setattr(pml, "Problem", lambda *a, **kw: made.append(a) or Problem(*a, **kw))
    text = many_attributes(5000)
    with pytest.raises(PMLError) as info:
        parse_schema(text, "t.xml")
    err = info.value
    assert len(err.problems) == MAX_PROBLEMS and err.more == 5000 - MAX_PROBLEMS
    assert len(made) == MAX_PROBLEMS  # the rest were counted, never located
    for i, p in enumerate(err.problems):
        assert (p.line, p.col) == editor_place(text, text.index(f' a{i}="') + 1) and f"'a{i}'" in p.message
    lines = str(err).splitlines()
    assert len(lines) == MAX_PROBLEMS + 1 and lines[-1] == f"... and {5000 - MAX_PROBLEMS} more problems (fix these first)"


def test_a_name_fifty_thousand_characters_long_is_cut_in_the_message():
    name = "n" * 50_000
    (line,) = problems(f'<schema name="s"><module name="m" {name}="1">x</module></schema>')
    assert len(line) < 1200 and "characters left out" in line and line.startswith("t.xml:1:35:")


def test_the_line_index_agrees_with_counting_at_every_offset():
    from engine.schema.where import Lines

    text = "<a>\r\n  ü€😀 x\n\n<b x='1'/>\nlast"
    lines = Lines(text)
    for offset in range(len(text) + 3):
        assert lines.at(offset) == editor_place(text, min(offset, len(text))), offset
    assert [lines.line(n) for n in range(0, 7)] == ["", "<a>\r", "  ü€😀 x", "", "<b x='1'/>", "last", ""]
    # libxml2's byte column of 'x' on line 2 (after 1 + 1 + 2 + 3 + 4 + 1 bytes) is its character column, 7
    assert lines.char_col(2, 1 + 1 + 2 + 3 + 4 + 1 + 1) == 7 and lines.char_col(9, 5) == 5
