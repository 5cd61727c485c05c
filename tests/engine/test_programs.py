"""Prompt programs (engine/programs/): compiled XML, call selection, rejected constructs, the CLI,
equivalence with hand-written schemas on a tiny and the real model, and a round-trip property test."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest

from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT, SAMPLES
from engine.cli import main
from engine.schema.layout import layout
from engine.schema.plan import plan_prompt
from engine.schema.pml import parse_prompt, parse_schema
from engine.programs import ProgramError, load_program_file
from engine.arms.registry import Sampling

PROGRAMS = SAMPLES / "programs"
EXAMPLES = {"travel_program": "travel_planner", "profile_program": "learner_profile"}
_counter = itertools.count()


def write_program(folder, source: str, name: str = "prog") -> str:
    """A fresh file per program: linecache (which inspect reads) is keyed by path."""
    path = folder / f"{name}_{next(_counter)}.py"
    path.write_text(source, encoding="utf-8")
    return str(path)


def load(tmp_path, body: str, header: str = ""):
    source = ("from engine.programs import Param, prompt_program, system\n" + header +
              "\n@prompt_program\n" + textwrap.dedent(body))
    return load_program_file(write_program(tmp_path, source))


# ----------------------------------------------------------------------------------------------
# The examples: checked-in XML, engine parse and layout
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stem", sorted(EXAMPLES))
def test_compiled_example_equals_checked_in_xml(stem):
    f = load_program_file(str(PROGRAMS / f"{stem}.py"))
    assert f.roots() == [EXAMPLES[stem]]
    prog = f.programs[EXAMPLES[stem]]
    assert prog.schema_xml() == (PROGRAMS / f"{stem}.xml").read_text(encoding="utf-8")
    assert f.example(prog.name).prompt_xml() == (PROGRAMS / f"{stem}.prompt.xml").read_text(encoding="utf-8")


@pytest.mark.parametrize("stem", sorted(EXAMPLES))
def test_compiled_example_parses_lays_out_and_plans(stem, tokenizer_bundle):
    f = load_program_file(str(PROGRAMS / f"{stem}.py"))
    prog = f.programs[EXAMPLES[stem]]
    lay = layout(parse_schema(prog.schema_xml(), f"{stem}.xml"), tokenizer_bundle[2])
    assert lay.name == prog.name and lay.modules
    plan = plan_prompt(lay, parse_prompt(f.example(prog.name).prompt_xml()))
    assert plan.cached_tokens > plan.uncached_tokens > 0


def test_travel_call_selects_modules_and_arguments():
    travel = load_program_file(str(PROGRAMS / "travel_program.py")).programs["travel_planner"]
    call = travel.bind(duration="a week", region="domestic", city="Chicago", travelers="my parents", budget=True)
    assert [s.xml() for s in call.imports] == [
        '<trip_plan duration="a week" travelers="my parents"><budget/><domestic city="Chicago"/></trip_plan>']
    assert '<overseas><kyoto/></overseas>' in travel(duration="3 days", region="overseas", dest="kyoto")
    with pytest.raises(ProgramError, match="matches no case of 'dest'.*'lisbon', 'kyoto'"):
        travel.bind(duration="3 days", region="overseas", dest="paris")
    with pytest.raises(ProgramError, match="needs an argument for 'city'"):
        travel.bind(duration="3 days", region="domestic")
    with pytest.raises(ProgramError, match="missing a required argument: 'region'"):
        travel.bind(duration="3 days")


# ----------------------------------------------------------------------------------------------
# Translation rules
# ----------------------------------------------------------------------------------------------

def test_flags_unions_match_names_and_else_members(tmp_path):
    f = load(tmp_path, '''
        def p(overseas: bool, kind: str, mode: str = "x", sure: bool = True):
            "Intro." "Same run."
            "Second statement."
            if overseas:
                "Abroad."
            else:
                "At home."
            if not sure:
                "Unsure."
            if kind == "New York":
                "NY."
            elif kind == "user":
                "A member named like a role."
            elif kind == "overseas":
                "Collides with the flag module above."
            else:
                "Anything else."
            match mode:
                case "x":
                    pass
                case "y":
                    "Y."
                case _:
                    "Other mode."
        ''')
    p = f.programs["p"]
    xml = p.schema_xml()
    schema = parse_schema(xml)
    names = [path for path, _ in schema.modules()]
    assert names == ["overseas", "not-overseas", "not-sure", "New-York", "user-2", "overseas-2", "kind-other",
                     "y", "mode-other"]
    assert "Intro.Same run. Second statement." in xml  # adjacent literals join exactly, statements with a space
    assert p.bind(overseas=False, kind="user", mode="x").imports == p.bind(False, "user").imports
    sel = [s.name for s in p.bind(overseas=False, kind="user", mode="x", sure=False).imports]
    assert sel == ["not-overseas", "not-sure", "user-2"]  # mode "x" is a `pass` branch: nothing imported
    sel = [s.name for s in p.bind(overseas=True, kind="Boston", mode="z").imports]
    assert sel == ["overseas", "kind-other", "mode-other"]
    with pytest.raises(ProgramError, match="must be True or False"):
        p.bind(overseas="yes", kind="user")


def test_nested_program_params_forwarding_and_defaults(tmp_path):
    f = load(tmp_path, '''
        def inner(topic: Param(len=4), weeks: Param(len=2, default="four"), deep: bool = False):
            "Learn " + topic + " in " + weeks + " weeks."
            if deep:
                "Go deep."

        @prompt_program
        def outer(topic, weeks=None, deep=False, level: str = "a"):
            system("Be brief.")
            inner(topic=topic, weeks=weeks, deep=deep)
            if level == "b":
                inner(topic="graphs", deep=True)
        ''')
    outer = f.programs["outer"]
    assert f.roots() == ["outer"]
    kinds = {p.name: p.kind for p in outer.params}
    assert kinds == {"topic": "param", "weeks": "param", "deep": "flag", "level": "choice"}
    xml = outer.schema_xml()
    assert '<param name="weeks" len="2" default="four"/>' in xml and '<module name="inner">' in xml
    assert xml.count('<module name="inner">') == 2  # the second call sits in module b, its own namespace
    prompt = outer.prompt_xml(topic="Rust & C", level="b", question="Where to start?")
    assert '<inner topic="Rust &amp; C"/>' in prompt
    assert '<b><inner topic="graphs"><deep/></inner></b>' in prompt
    assert prompt.rstrip().endswith("Where to start?\n</prompt>")
    with pytest.raises(ProgramError, match="interpolates 'topic' outside any module"):
        f.programs["inner"].schema_xml()  # fine nested, but its top level cannot hold a param


def test_passed_on_choices_accept_the_callees_values_and_literals_are_checked(tmp_path):
    f = load(tmp_path, '''
        def guide(dest: str):
            match dest:
                case "lisbon":
                    "Lisbon."
                case "kyoto":
                    "Kyoto."

        @prompt_program
        def trip(dest: str):
            if dest == "kyoto":
                "Bring cash."
            guide(dest=dest)
        ''')
    trip = f.programs["trip"]
    assert trip.params[0].choices == ("kyoto", "lisbon")
    assert [s.xml() for s in trip.bind(dest="lisbon").imports] == ["<guide><lisbon/></guide>"]
    with pytest.raises(ProgramError, match="matches no case of 'dest'"):
        trip.bind(dest="paris")
    with pytest.raises(ProgramError, match=r"guide\(\.\.\.\): dest='paris' matches no case") as info:
        load(tmp_path, '''
            def guide(dest: str):
                if dest == "kyoto":
                    "Kyoto."

            @prompt_program
            def trip(flag: bool):
                if flag:
                    guide(dest="paris")
            ''')
    assert info.value.problems[0].line == 12


def test_escaping_whitespace_and_chat_false(tmp_path, tokenizer_bundle):
    f = load(tmp_path, '''
        def code(on: bool, note: Param(len=12, default='say "hi" & <go>')):
            "Review: if a < b and c > d: pass  # & more"
            if on:
                "def f():\\n    return 1\\r\\n  # end \\n" + note
        ''')
    prog = f.programs["code"]
    schema = parse_schema(prog.schema_xml())
    layout(schema, tokenizer_bundle[2])
    (role,) = schema.children
    assert role.children[0].text == " Review: if a < b and c > d: pass  # & more "
    module = role.children[1]
    # inner whitespace is kept (\\r too); the run's ends collapse to one space, as everywhere in PML
    assert module.children[0].text == " def f():\n    return 1\r\n  # end "
    assert module.children[1].default == 'say "hi" & <go>'
    assert '<on note="tab&#9;here &amp; &lt;now&gt;"/>' in prog.prompt_xml(on=True, note="tab\there & <now>")
    assert parse_prompt(prog.prompt_xml(on=True, note="a\nb")).items[0].args == (("note", "a\nb"),)

    source = ("from engine.programs import prompt_program\n\n@prompt_program(chat=False)\ndef raw(on: bool):\n"
              "    'a < b & c'\n    if on:\n        'x'\n")
    xml = load_program_file(write_program(tmp_path, source)).programs["raw"].schema_xml()
    assert "<user>" not in xml and "<system>" not in xml
    assert parse_schema(xml).children[0].text == " a < b & c "


# ----------------------------------------------------------------------------------------------
# Rejected constructs: decoration-time ProgramError with file:line and a suggestion
# ----------------------------------------------------------------------------------------------

HEADER = '''from engine.programs import Param, prompt_program, system
GLOBAL = True


def helper():
    return "not a program"


@prompt_program
def prog(duration: Param(len=4), flag: bool = False, dest: str = "a", other: bool = False):
    "Intro."
'''
FIRST = HEADER.count("\n") + 1  # line of the snippet's first statement

BAD = {
    "for": ("for x in dest:\n    'a'", 0, "loops are not supported", "Param"),
    "while": ("while flag:\n    'a'", 0, "loops are not supported", "if/match"),
    "f-string": ("f'a trip of {duration}'", 0, "f-strings are not supported", "+ duration"),
    "f-string in concat": ("'a ' + f'{dest}'", 0, "f-strings are not supported", "concatenate"),
    "assignment": ("x = 'a'", 0, "assignments are not supported", "parameter"),
    "side effect": ("helper()", 0, "'helper' is not a prompt program", "decorate helper"),
    "print": ("print('hi')", 0, "'print' is not a prompt program", "decorate print"),
    "undefined": ("later()", 0, "'later' is not defined", "above prog"),
    "global condition": ("if GLOBAL:\n    'a'", 0, "not a parameter of prog", "call decides"),
    "and": ("if flag and other:\n    'a'", 0, "and/or conditions", "nest the if blocks"),
    "param condition": ("'x'\nif duration:\n    'a'", 1, "'duration' is a Param", "bool or str"),
    "non-param text": ("'going to ' + dest", 0, "'dest' is interpolated into the text but is not a Param",
                       "Param(len=N)"),
    "twice in a module": ("if flag:\n    duration\n    'and again ' + duration", 2, "interpolated twice",
                          "nested"),
    "flag and choice": ("if flag:\n    'a'\nif flag == 'b':\n    'b'", 2, "is a bool but is compared", "if flag:"),
    "capture pattern": ("match dest:\n    case x:\n        'a'", 1, "pattern `x` is not supported", "case _"),
    "guard": ("match dest:\n    case 'a' if flag:\n        'a'", 1, "guards", "nest an if"),
    "or pattern": ("match dest:\n    case 'a' | 'b':\n        'a'", 1, "pattern", "one value per case"),
    "late system": ("system('You are late.')", 0, "system() must come before any other text", "top"),
    "system in module": ("if flag:\n    system('x')", 1, "system() is only allowed as the first", "top"),
    "return": ("return 'a'", 0, "return is not supported", "if/else"),
    "duplicate case": ("if dest == 'a':\n    'a'\nelif dest == 'a':\n    'b'", 2, "tested twice", "merge"),
    "number": ("42", 0, "`42` is not supported", "string literals"),
    "control char": ("'bell \\x07'", 0, "XML cannot hold", "control characters"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsupported_constructs_raise_with_line_and_hint(tmp_path, case):
    snippet, offset, message, hint = BAD[case]
    path = write_program(tmp_path, HEADER + textwrap.indent(snippet, "    ") + "\n")
    with pytest.raises(ProgramError) as info:
        load_program_file(path)
    prob = info.value.problems[0]
    assert (prob.source, prob.line) == (path, FIRST + offset), str(info.value)
    assert message in prob.message and hint in prob.hint, str(info.value)
    assert str(info.value).startswith(f"{path}:{FIRST + offset}:")


def test_call_errors_point_at_the_call(tmp_path):
    source = ("from engine.programs import prompt_program\n\n@prompt_program\ndef p(kind: str):\n"
              "    if kind == 'a':\n        'A'\n\n\nEXAMPLE = p.bind(kind='b')\n")
    path = write_program(tmp_path, source)
    with pytest.raises(ProgramError, match="p\\(kind='b'\\) matches no case of 'kind'") as info:
        load_program_file(path)
    assert str(info.value).startswith(f"{path}:9:1: error: ")


def test_signature_problems_are_located(tmp_path):
    for params, message in [("*args", "are not supported"), ("question: str", "reserved"),
                            ("d: Param(len=2, default='a') = 'b'", "two different defaults")]:
        source = f"from engine.programs import Param, prompt_program\n\n@prompt_program\ndef p({params}):\n    'x'\n"
        path = write_program(tmp_path, source)
        with pytest.raises(ProgramError, match=message) as info:
            load_program_file(path)
        assert info.value.problems[0].line == 4


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def test_cli_compile_prints_the_schema(capsys):
    assert main(["compile", str(PROGRAMS / "travel_program.py") + ":travel_planner"]) == 0
    assert capsys.readouterr().out == (PROGRAMS / "travel_program.xml").read_text(encoding="utf-8")
    assert main(["compile", str(PROGRAMS / "profile_program.py")]) == 0  # the file's one root program
    assert capsys.readouterr().out == (PROGRAMS / "profile_program.xml").read_text(encoding="utf-8")
    assert main(["compile", str(PROGRAMS / "profile_program.py"), "--prompt"]) == 0
    assert capsys.readouterr().out == (PROGRAMS / "profile_program.prompt.xml").read_text(encoding="utf-8")


@pytest.mark.parametrize("source, line, what", [
    (HEADER + "    for d in dest:\n        'a'\n", FIRST, "loops are not supported"),
    ("def broken(:\n    pass\n", 1, "Python syntax error"),
    ("import os\n\nraise RuntimeError('no')\n", 3, "importing the file raised RuntimeError: no"),
])
def test_cli_compile_reports_located_errors(tmp_path, capsys, source, line, what):
    path = write_program(tmp_path, source)
    assert main(["compile", path + ":prog"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{path}:{line}:") and ": error: " in err[0] and what in err[0]


def test_cli_compile_errors_never_show_a_traceback(tmp_path):
    path = write_program(tmp_path, HEADER + "    x = 1\n")
    out = subprocess.run([sys.executable, "-m", "engine.cli", "compile", path], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"{path}:{FIRST}:5: error: assignments are not supported")
    missing = subprocess.run([sys.executable, "-m", "engine.cli", "compile", str(tmp_path / "nope.py:f")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr


def test_programs_module_imports_neither_torch_nor_gradio():
    code = "import sys, engine.programs\nprint(sorted(m for m in ('torch', 'gradio') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------------------------
# Equivalence: the compiled program runs exactly like the hand-written schema
# ----------------------------------------------------------------------------------------------

HAND_TRAVEL = """<schema name="travel">
  <system>You are a travel planner. Answer in a few short sentences or a brief bullet list.</system>
  <user>
    <module name="trip-plan">
      I am planning a trip of <param name="duration" len="4"/> for <param name="travelers" len="6" default="two adults"/>.
      <module name="budget">
        We are on a tight budget, so favor free sights, public transport and simple guesthouses.
      </module>
      <union>
        <module name="domestic">
          We want to stay in the country and spend our time in <param name="city" len="6"/>, with a mix of museums, local food and one day outdoors. Please keep the distances between sights short.
        </module>
        <module name="overseas">
          We want to travel abroad and have chosen the destination described below. Please plan one slower rest day and mention anything we should book in advance.
          <union>
            <module name="lisbon">
              Lisbon is a hilly capital on the Tagus estuary. Historic trams climb through the Alfama and Graça districts, and viewpoints called miradouros look out over red rooftops. The palaces of Sintra are about forty minutes away by train. Belém is known for its custard tarts and riverside monuments, and evenings often end with fado music.
            </module>
            <module name="kyoto">
              Kyoto was the seat of Japan's emperors for more than a thousand years and has well over a thousand temples and shrines. Visitors walk the gate-lined paths of Fushimi Inari, the Arashiyama bamboo grove and the lanes of Higashiyama. Popular temples get crowded by mid-morning, so start early. Nara, with its deer park, is about 45 minutes away by train.
            </module>
            <module name="reykjavik">
              Reykjavik, the capital of Iceland, is a compact base for exploring volcanic landscapes. The Golden Circle route links the Thingvellir rift valley, the Geysir hot springs and Gullfoss waterfall in one day by car. Geothermal swimming pools are part of daily life. The weather changes quickly, so pack waterproof layers; in midwinter, daylight lasts only four to five hours.
            </module>
            <module name="marrakesh">
              Marrakesh lies at the foot of the Atlas Mountains in Morocco. Its walled medina surrounds Jemaa el-Fnaa, a square that fills with food stalls and musicians every evening. Many visitors stay in riads, traditional houses built around a shaded courtyard. The Majorelle Garden and the covered souks are highlights, and day trips reach villages in the High Atlas.
            </module>
          </union>
        </module>
      </union>
    </module>
  </user>
</schema>"""  # noqa: E501

HAND_PROFILE = """<schema name="profile">
  <system>You are a patient tutor who adapts every explanation to the learner described in the user's message: their learning style, their level and the tone they prefer. Keep plans concrete and realistic.</system>
  <user>
    <union>
      <module name="visual">
        Learning style: visual. I remember ideas best when I can see them, so diagrams, tables, timelines and color-coded notes help me far more than long paragraphs.
      </module>
      <module name="verbal">
        Learning style: verbal. I learn best through words: clear written explanations, talking ideas through, and summarizing each step in my own sentences before moving on.
      </module>
      <module name="hands-on">
        Learning style: hands-on. I understand things by doing them, so I prefer short exercises, small projects and trying examples myself right after a brief explanation.
      </module>
    </union>
    <union>
      <module name="beginner">
        Level: beginner. I am new to this subject and do not know its basic terms yet, so please define new words and start from first principles.
      </module>
      <module name="intermediate">
        Level: intermediate. I know the basics and have practiced a little, but I still make mistakes with the harder parts and want to fill the gaps.
      </module>
      <module name="expert">
        Level: expert. I already use this subject in my work, so skip the fundamentals and focus on edge cases, trade-offs and ways to sharpen my skills.
      </module>
    </union>
    <union>
      <module name="formal">
        Tone: formal. Please write in a polite, professional register with complete sentences, and avoid slang, jokes and emoji.
      </module>
      <module name="casual">
        Tone: casual. Talk to me like a friendly study partner: relaxed, direct and encouraging, in plain everyday language.
      </module>
      <module name="playful">
        Tone: playful. Keep things light: a bit of humor, vivid comparisons and small challenges make studying feel like a game to me.
      </module>
    </union>
    <module name="examples">
      Whenever you introduce an idea, follow it with one short worked example.
    </module>
    <module name="goal">
      Goal: I want to get comfortable with <param name="topic" len="8"/> within the next <param name="weeks" len="3" default="four"/> weeks. I can study for about thirty minutes a day, five days a week.
    </module>
  </user>
</schema>"""  # noqa: E501

QUESTION_TRAVEL = "Question: how long is the train ride from Kyoto to Nara, and what is Nara known for? Answer in one sentence."
QUESTION_PROFILE = "Write a short study plan for my first week: one line for each study day."

# (example, call kwargs, hand-written prompt), the prompts laid out like sample_schemas/*.prompt.xml
CALLS = [
    ("travel_program", dict(duration="5 days", region="overseas", dest="kyoto", question=QUESTION_TRAVEL), f"""
<prompt schema="travel">
  <trip-plan duration="5 days"><overseas><kyoto/></overseas></trip-plan>
  {QUESTION_TRAVEL}
</prompt>"""),
    ("travel_program", dict(duration="a week", region="domestic", city="Chicago", travelers="my parents",
                            budget=True, question="Where should we eat?"), """
<prompt schema="travel">
  <trip-plan duration="a week" travelers="my parents">
    <budget/>
    <domestic city="Chicago"/>
  </trip-plan>
  Where should we eat?
</prompt>"""),
    ("profile_program", dict(style="visual", level="beginner", tone="casual", topic="basic statistics",
                             question=QUESTION_PROFILE), f"""
<prompt schema="profile">
  <visual/>
  <beginner/>
  <casual/>
  <goal topic="basic statistics"/>
  {QUESTION_PROFILE}
</prompt>"""),
    ("profile_program", dict(style="hands-on", level="expert", tone="playful", topic="SQL", weeks="six",
                             examples=True, question="What first?"), """
<prompt schema="profile">
  <hands-on/> <expert/> <playful/> <examples/>
  <goal topic="SQL" weeks="six"/>
  What first?
</prompt>"""),
]
HAND = {"travel_program": HAND_TRAVEL, "profile_program": HAND_PROFILE}


def assert_same_runs(eng, stem: str, kwargs: dict, hand_prompt: str, n: int) -> None:
    f = load_program_file(str(PROGRAMS / f"{stem}.py"))
    prog = f.programs[EXAMPLES[stem]]
    compiled = eng.compare(prog.schema_xml(), prog.prompt_xml(**kwargs), Sampling(n))
    hand = eng.compare(HAND[stem], hand_prompt, Sampling(n))
    assert compiled.plan.token_ids == hand.plan.token_ids  # the very same prompt tokens
    assert [s.positions for s in compiled.plan.segments] == [s.positions for s in hand.plan.segments]
    assert compiled.plan.cached_tokens == hand.plan.cached_tokens
    for a, b in [(compiled.baseline, hand.baseline), (compiled.cached, hand.cached)]:
        assert a.token_ids == b.token_ids
        assert float((a.first_logits - b.first_logits).abs().max()) < 1e-5
    assert compiled.agreement().max_first_logit_diff == pytest.approx(hand.agreement().max_first_logit_diff, abs=1e-5)


@pytest.mark.parametrize("stem, kwargs, hand_prompt", CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)])
def test_compiled_program_runs_like_hand_written_schema(tiny_engine, stem, kwargs, hand_prompt):
    assert_same_runs(tiny_engine, stem, kwargs, hand_prompt, n=6)


@pytest.mark.real_model
def test_compiled_travel_program_runs_like_hand_written_schema_on_real_model(real_engine):
    stem, kwargs, hand_prompt = CALLS[0]
    assert_same_runs(real_engine, stem, kwargs, hand_prompt, n=4)


# ----------------------------------------------------------------------------------------------
# Property: every generated valid program compiles, parses, lays out, and every call plans
# ----------------------------------------------------------------------------------------------

WORDS = st.text(alphabet="abcdefghij ABC.,;:!?'\"&<>-_é\n", min_size=1, max_size=24).filter(lambda s: s.strip())
VALUES = ["a", "b", "New York", "user", "f0", "x-other", "3 days", "", "Zürich", "a.b"]
FLAGS = ["f0", "f1"]
CHOICES = ["c0", "c1"]
PARAMS = ["p0", "p1", "p2"]


@st.composite
def body(draw, depth: int, in_module: bool) -> list[str]:
    """Statements (source lines, indented by 4 per level) of a module body or the program's top level."""
    lines: list[str] = []
    used: set[str] = set()  # params already interpolated in this module
    kinds = ["text", "text", "if", "chain", "match", "call", "pass"] if depth < 3 else ["text", "pass"]
    for _ in range(draw(st.integers(0 if in_module else 1, 4))):
        kind = draw(st.sampled_from(kinds))
        if kind == "text":
            free = [p for p in PARAMS if p not in used] if in_module else []
            parts = [repr(draw(WORDS))]
            if free and draw(st.booleans()):
                p = draw(st.sampled_from(free))
                used.add(p)
                parts += [p, repr(draw(WORDS))]
            lines.append(" + ".join(parts))
        elif kind == "pass":
            lines.append("pass")
        elif kind == "call":
            arg = draw(st.sampled_from(["p0", "'fixed'"]))
            lines.append(f"helper(hp={arg}, hf={draw(st.sampled_from(['f0', 'True', 'False']))})")
        elif kind == "if":
            neg = "not " if draw(st.booleans()) else ""
            lines.append(f"if {neg}{draw(st.sampled_from(FLAGS))}:")
            lines += _indent(draw(body(depth + 1, True)))
            if draw(st.booleans()):
                lines.append("else:")
                lines += _indent(_not_elif(draw(body(depth + 1, True))))
        else:
            var = draw(st.sampled_from(CHOICES))
            values = draw(st.lists(st.sampled_from(VALUES), min_size=1, max_size=3, unique=True))
            other = draw(st.booleans())
            if kind == "chain":
                for i, v in enumerate(values):
                    lines.append(f"{'if' if i == 0 else 'elif'} {var} == {v!r}:")
                    lines += _indent(draw(body(depth + 1, True)))
                if other:
                    lines.append("else:")
                    lines += _indent(_not_elif(draw(body(depth + 1, True))))
            else:
                lines.append(f"match {var}:")
                for v in values + (["_"] if other else []):
                    lines.append(f"    case {v if v == '_' else repr(v)}:")
                    lines += _indent(_indent(draw(body(depth + 1, True))))
    return lines or ["pass"]


def _not_elif(lines: list[str]) -> list[str]:
    """An `else:` body that is a lone `if` means `elif` (the compiler, like Python, reads it so), which
    may re-test a value of the same chain — an unreachable branch the compiler rightly rejects. A
    trailing `pass` keeps such a body a nested block, as the generator intends."""
    top = [line for line in lines if not line.startswith((" ", "elif ", "else:"))]  # statements, not clauses
    return lines + ["pass"] if len(top) == 1 and top[0].startswith("if ") else lines


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines] or ["    pass"]


PROPERTY_HEADER = '''from engine.programs import Param, prompt_program, system


@prompt_program
def helper(hp: Param(len=3), hf: bool = False):
    "Helper text " + hp + " end."
    if hf:
        "Helper flag."


@prompt_program
def root(p0: Param(len=4), p1: Param(len=4, default="x y"), p2: Param(len=2) = "z",
         f0: bool = False, f1: bool = False, c0: str = None, c1: str = None):
'''


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=body(0, False), with_system=st.booleans(),
       call=st.fixed_dictionaries({"f0": st.booleans(), "f1": st.booleans(),
                                   "c0": st.sampled_from(VALUES + [None]), "c1": st.sampled_from(VALUES + [None])}))
def test_generated_programs_compile_parse_lay_out_and_plan(tmp_path_factory, tokenizer_bundle, lines, with_system,
                                                           call):
    source = PROPERTY_HEADER + ("    system('You are terse.')\n" if with_system else "") + \
        "".join("    " + line + "\n" for line in lines)
    path = write_program(tmp_path_factory.getbasetemp(), source, "generated")
    prog = load_program_file(path).programs["root"]
    schema = parse_schema(prog.schema_xml(), path)
    lay = layout(schema, tokenizer_bundle[2])
    assert schema.name == "root" and lay.length == max((piece.end for piece in lay.pieces), default=0)
    choices = {p.name: p for p in prog.params}
    for var in CHOICES:  # a value no case lists is an error only when no chain on it has an else
        if call[var] is not None and not choices[var].open_choice and call[var] not in choices[var].choices:
            call[var] = None
    prompt = prog.prompt_xml(p0="hello", **call, question="Why?")
    plan = plan_prompt(lay, parse_prompt(prompt))
    assert plan.uncached_tokens > 0
