"""Studio handlers called directly (no server), on the tiny random-weight Llama — Schema tab: samples, validation, uploads and prompt programs."""

from __future__ import annotations

import ast
import csv

import gradio as gr
import pytest

from engine.runlog import RunLog
from studio import builder as b
from studio import files, views
from studio.settings import Panel
from studio.state import Studio
from studio.tabs import compare as cmp
from studio.tabs import encode as enc
from studio.tabs import history as hist
from studio.tabs import model as mdl
from studio.tabs import prompt as prm
from studio.tabs import schema as sch
from tests.conftest import ROOT

from tests.studio_fixtures import CPU, TRAVEL_PROMPT, doc, settings, studio, travel  # noqa: F401 (fixtures)


def test_samples_are_every_schema_file_and_all_validate(studio):
    names = files.sample_names()
    assert "travel" in names and not any(n.endswith(".prompt") for n in names)
    for name in names:
        schema, prompt = files.load_sample(name)
        v = sch.validate(studio, schema)
        assert v.ok, (name, v.problems)
        assert v.rows and v.spec.schema == v.name
        status, tokens = prm.preview(studio, schema, prompt)
        assert "✓" in status, (name, status)
        assert 'class="tok tok-cached"' in tokens


def test_invalid_schema_comes_back_as_line_col_messages(studio):
    text = '<schema name="s">\n  <module name="a">hi</module>\n  <module name="a">again</module>\n</schema>\n'
    v = sch.validate(studio, text)
    assert not v.ok and v.spec is None
    assert v.problems and v.problems[0].startswith("3:")
    assert 3 in v.lines
    assert "3 | <module" in v.problems[0]  # the offending line is quoted
    assert "1 problem(s)" in v.status_html()
    shown = views.highlight_html(text, v.lines)
    assert "#fde2e1" in shown and "#fde2e1" not in views.highlight_html(text)  # only the offending line is red


def test_malformed_and_empty_schema_do_not_raise(studio):
    v = sch.validate(studio, "<schema name='x'><module name='a'>")
    assert not v.ok and v.problems[0].split(":")[0].isdigit()
    assert not sch.validate(studio, "").ok
    assert not sch.validate(studio, "   ").ok


def test_upload_reads_schema_or_prompt(tmp_path):
    schema, prompt = files.load_sample("travel")
    (tmp_path / "s.xml").write_text(schema)
    (tmp_path / "p.xml").write_text(prompt)
    (tmp_path / "x.xml").write_text("<other/>")
    assert files.read_upload(str(tmp_path / "s.xml")) == ("schema", schema)
    assert files.read_upload(str(tmp_path / "p.xml")) == ("prompt", prompt)
    with pytest.raises(gr.Error, match="neither"):
        files.read_upload(str(tmp_path / "x.xml"))


def test_import_program_fills_schema_and_prompt(studio):
    from tests.conftest import SAMPLES

    imp = files.import_program(str(SAMPLES / "programs" / "travel_program.py"))
    assert imp.ok and imp.roots == ("travel_planner",) and imp.program == "travel_planner"
    assert imp.schema == (SAMPLES / "programs" / "travel_program.xml").read_text()
    assert imp.prompt == (SAMPLES / "programs" / "travel_program.prompt.xml").read_text()
    assert "✓ imported" in imp.status
    assert sch.validate(studio, imp.schema).ok and "✓" in prm.preview(studio, imp.schema, imp.prompt)[0]
    again = files.import_program(str(SAMPLES / "programs" / "travel_program.py"), "travel_planner")
    assert again.schema == imp.schema  # importing twice is fine


def test_import_program_without_example_and_with_several_roots(tmp_path):
    src = ('from engine.programs import prompt_program\n\n@prompt_program\ndef first(x: bool):\n    "A."\n'
           '    if x:\n        "B."\n\n\n@prompt_program\ndef second(y: bool):\n    "C."\n    if y:\n        "D."\n')
    (tmp_path / "two.py").write_text(src)
    imp = files.import_program(str(tmp_path / "two.py"))
    assert imp.ok and imp.roots == ("first", "second") and imp.program == "first" and imp.prompt is None
    assert "no example call" in imp.status and "second" in imp.status
    other = files.import_program(str(tmp_path / "two.py"), "second")
    assert other.program == "second" and 'name="second"' in other.schema
    assert b.empty_prompt("second") == '<prompt schema="second">\n</prompt>\n'
    schema, prompt, _, status, path = sch.on_python(str(tmp_path / "two.py"))
    assert prompt == b.empty_prompt("first") and path == str(tmp_path / "two.py")


def test_import_program_problems_are_inline(tmp_path):
    (tmp_path / "loop.py").write_text('from engine.programs import prompt_program\n\n@prompt_program\n'
                                      'def f(xs):\n    for x in xs:\n        "hi"\n')
    imp = files.import_program(str(tmp_path / "loop.py"))
    assert not imp.ok and imp.schema is None and imp.roots == ()
    assert "5:5:" in imp.status and "loops" in imp.status and "for x in xs" in imp.status
    (tmp_path / "boom.py").write_text("import os\nraise RuntimeError('no')\n")
    assert "2:1:" in files.import_program(str(tmp_path / "boom.py")).status
    (tmp_path / "plain.py").write_text("x = 1\n")
    assert "no @prompt_program" in files.import_program(str(tmp_path / "plain.py")).status
    (tmp_path / "s.xml").write_text("<schema/>")
    assert "not a Python file" in files.import_program(str(tmp_path / "s.xml")).status
    assert "no file" in files.import_program(None).status
