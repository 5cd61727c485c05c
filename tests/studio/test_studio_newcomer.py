"""Issue 48's handler and CLI checks: every kind of schema and prompt problem at the character a user would fix
(line and column counted here from the edited text), `check` finding the schema on its command line, and the
Compare figures named for what they measure."""

from __future__ import annotations

import html

import pytest

from engine.cli import main
from studio import views
from studio.errors import problem_lines
from studio.files import load_sample
from studio.tabs import prompt as prm
from studio.tabs import schema as sch
from tests.studio_fixtures import doc, studio  # noqa: F401  (studio: a fixture)

TRAVEL, TRAVEL_PROMPT = load_sample("travel")


def at(text: str, needle: str, nth: int = 0, shift: int = 0) -> str:
    """"line:col:" of the ``nth`` ``needle`` in ``text`` (plus ``shift`` characters), as an editor counts them."""
    i = -1
    for _ in range(nth + 1):
        i = text.index(needle, i + 1)
    i += shift
    return f"{text.count(chr(10), 0, i) + 1}:{i - (text.rfind(chr(10), 0, i) + 1) + 1}:"


def edit(text: str, old: str, new: str, nth: int = 0) -> str:
    i = -1
    for _ in range(nth + 1):
        i = text.index(old, i + 1)
    return text[:i] + new + text[i + len(old):]


# (what, edited schema, where the problem must be reported: (needle in the edited text, occurrence, shift), words)
SCHEMA_SLIPS = [
    ("'>' deleted", edit(TRAVEL, '"trip-plan">', '"trip-plan"'), ('"trip-plan"', 0, 11), "'>' is missing"),
    ("closing quote missing", edit(TRAVEL, 'name="duration" len', 'name="duration len'), ("duration len", 0, 8),
     "closing \" is missing"),
    ("opening quote missing", edit(TRAVEL, 'name="duration"', 'name=duration"'), ("duration\"", 0, 0),
     "has no quotes"),
    ("quote missing before '>'", edit(TRAVEL, 'name="lisbon">', 'name="lisbon>'), ("lisbon>", 0, 6),
     "closing \" is missing"),
    ("unclosed tag", edit(TRAVEL, "</module>", "", 1), ('<module name="lisbon"', 0, 0), "<module> is never closed"),
    ("one end tag too many", edit(TRAVEL, "</module>", "</module></module>", 0), ("</module>", 1, 0),
     "an extra </module>"),
    ("duplicate name", edit(TRAVEL, 'name="kyoto"', 'name="lisbon"'), ("lisbon", 2, 0), "first on line 13"),
    ("bad param length", edit(TRAVEL, 'len="4"', 'len="four"'), ("four", 0, 0), "positive whole number"),
    ("unknown attribute", edit(TRAVEL, 'len="6" default', 'len="6" defualt'), ("defualt", 0, 0),
     "unknown attribute 'defualt'"),
    ("unknown element", edit(TRAVEL, "Please keep", "<b>Please</b> keep"), ("b>Please", 0, 0),
     "unknown element <b>"),
    ("a bare '&' after non-ASCII text", edit(TRAVEL, "Graça", "Graça & Co"), ("& Co", 0, 0), "EntityRef"),
]


@pytest.mark.parametrize("what,text,where,words", SCHEMA_SLIPS, ids=[s[0] for s in SCHEMA_SLIPS])
def test_schema_problems_are_where_the_editor_shows_them(studio, what, text, where, words):
    v = sch.validate(studio, text)
    assert not v.ok and len(v.problems) >= 1
    assert v.problems[0].startswith(at(text, *where)) and words in v.problems[0], v.problems
    assert v.lines[0] == int(at(text, *where).split(":")[0])  # the highlighted line


PROMPT_SLIPS = [
    ("unknown import", edit(TRAVEL_PROMPT, "<kyoto/>", "<kyotoo/>"), ("kyotoo", 0, 0), "unknown module <kyotoo>"),
    ("unknown param", edit(TRAVEL_PROMPT, 'duration="5 days"', 'duraton="5 days"'), ("duraton", 0, 0),
     "has no param 'duraton'"),
    ("argument too long", edit(TRAVEL_PROMPT, 'duration="5 days"', 'duration="' + "very " * 30 + 'long"'),
     ("very", 0, 0), "tokens but the param allows"),
    ("tag left open", edit(TRAVEL_PROMPT, "</overseas>", ""), ("<overseas>", 0, 0), "<overseas> is never closed"),
    ("quote missing", edit(TRAVEL_PROMPT, 'duration="5 days"', 'duration="5 days'), ("days", 0, 4),
     "closing \" is missing"),
]


@pytest.mark.parametrize("what,text,where,words", PROMPT_SLIPS, ids=[s[0] for s in PROMPT_SLIPS])
def test_prompt_problems_are_where_the_editor_shows_them(studio, what, text, where, words):
    status = html.unescape(prm.preview(studio, TRAVEL, text)[0])
    first = status.split("<li><code>")[1]
    assert first.startswith(at(text, *where)) and words in first, status


def test_a_problem_line_carries_a_caret_under_the_column():
    from engine.errors import PMLError
    from engine.schema.pml import parse_schema

    text = edit(TRAVEL, 'name="kyoto"', 'name="lisbon"')
    with pytest.raises(PMLError) as err:
        parse_schema(text)
    (line,), _ = problem_lines(err.value, text)
    shown, caret = line.split("\n")[1:]
    assert caret.index("^") == shown.index("lisbon")  # the caret sits under the name to fix


def test_thousands_of_problems_on_one_long_line_list_the_first_around_their_columns(studio):
    """5,000 unknown attributes on one 60,000-character line: the Schema tab lists the first problems, each with the
    part of the line around its column (the caret under the attribute), one line for the rest, and the title
    counts them all."""
    from engine.errors import MAX_PROBLEMS
    from studio.errors import SHOWN

    text = '<schema name="s"><module name="m" ' + " ".join(f'a{i}="v"' for i in range(5000)) + ">x</module></schema>"
    v = sch.validate(studio, text)
    assert len(v.problems) == MAX_PROBLEMS + 1 and v.problems[-1].startswith(f"... and {5000 - MAX_PROBLEMS} more")
    assert "5000 problem(s)" in v.status_html()
    for i, line in enumerate(v.problems[:-1]):
        head, shown, caret = line.split("\n")
        assert head.startswith(at(text, f" a{i}=", shift=1)) and len(shown) < SHOWN + 20
        assert shown[caret.index("^"):].startswith(f"a{i}=")
    assert len("\n".join(v.problems)) < 20_000


def test_the_layout_says_when_it_is_stale(studio, tmp_path):
    table = sch._validate_ui(studio, tmp_path, edit(TRAVEL, "</schema>", ""), None)[1]
    assert "STALE" in table.label
    table = sch._validate_ui(studio, tmp_path, TRAVEL, None)[1]
    assert "STALE" not in table.label and len(table.value["data"]) > 3


def test_check_uses_the_schema_named_on_its_command_line(tmp_path, capsys):
    schema, prompt = tmp_path / "my-travel-copy.xml", tmp_path / "bad.prompt.xml"
    schema.write_text(TRAVEL)
    prompt.write_text(edit(TRAVEL_PROMPT, "<kyoto/>", "<kyotoo/>"))
    assert main(["check", str(schema), str(prompt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [line for line in err if "unknown module <kyotoo>" in line] and len(err) == 1, err
    assert err[0].startswith(f"{prompt}:{at(prompt.read_text(), 'kyotoo')}")  # the same place as the page's
    prompt.write_text(TRAVEL_PROMPT)
    assert main(["check", str(schema), str(prompt)]) == 0


def _doc(speedups: dict, same: dict, batch: int = 3) -> dict:
    base = {"ttft_ms": 1000.0, "copy_ms": 12.0, "prefill_ms": 900.0, "prefill_tokens": 300, "new_tokens": 8,
            "decode_ms_per_token": 80.0, "decode_batch": batch, "peak_rss_bytes": 9e8, "text": "x"}
    data = {"arms": ["baseline", *speedups], "prompt_tokens": 300, "cached_tokens": 280, "storage": "cpu",
            "mode": "contextual", "baseline": base}
    for arm, s in speedups.items():
        stem = "" if arm == "cached" else f"{arm}_"
        data[arm] = {**base, "ttft_ms": 1000.0 / s}
        data.update({f"{stem}same_text": same[arm], f"{stem}first_divergence": None if same[arm] else 2,
                     f"{stem}first_token_agree": True, f"{stem}first_token_kl": 0.0, f"{stem}max_first_logit_diff": 0})
    return data


def test_the_headline_is_the_fastest_arm_whose_answer_is_the_baselines():
    summary = views.summary_html(doc(_doc({"prefix": 18.4, "cached": 4.9}, {"prefix": True, "cached": True})))
    assert "18.4×" in summary and "Prefix cache" in summary and "4.9×" not in summary  # was the modular arm's, always
    summary = views.summary_html(doc(_doc({"prefix": 18.4, "cached": 30.0}, {"prefix": True, "cached": False})))
    assert "18.4×" in summary and "Prefix cache" in summary  # faster but a different answer: not the headline
    summary = views.summary_html(doc(_doc({"prefix": 2.0, "cached": 3.0}, {"prefix": False, "cached": False})))
    assert "3.0×" in summary and "no faster arm's answer is the baseline's" in html.unescape(summary)


def test_figures_are_named_for_what_they_measure():
    data = _doc({"prefix": 2.0, "cached": 3.0, "routed": 4.0}, {"prefix": True, "cached": True, "routed": True})
    data["routed"].update(scout_ms=300.0, route_kept=["kyoto"], route_attention={"kyoto": 0.9})
    comparison = doc(data)
    routed, cached = views.metrics_html(comparison, "routed"), views.metrics_html(comparison, "cached")
    assert "scout pass" in routed and "scout pass" not in cached and "KV copy (in TTFT)" in cached
    assert "decode (shared batch)" in cached and "80.0 ms/step, a batch of up to 3 arms" in cached
    alone = views.metrics_html(doc(_doc({"cached": 3.0}, {"cached": True}, batch=1)), "cached")
    assert "shared" not in alone and "80.0 ms/token" in alone


def _run_travel(tmp_path, monkeypatch, capsys, tty: bool, eng, *flags) -> tuple[str, str]:
    """`pml-studio run` on the travel sample, by the tiny model (the CLI's Engine is the test's)."""
    import sys

    from engine import session

    monkeypatch.setenv("PML_STUDIO_MODULES", str(tmp_path / f"modules-{tty}"))  # nothing stored: it encodes
    monkeypatch.setattr(session, "Engine", lambda *a, **k: eng)
    schema, prompt = tmp_path / "travel.xml", tmp_path / "travel.prompt.xml"
    schema.write_text(TRAVEL)
    prompt.write_text(TRAVEL_PROMPT)
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    from studio.cli import main as studio_main
    assert studio_main(["run", str(schema), str(prompt), "--max-new-tokens", "3", *flags]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_run_says_each_phase_on_a_terminal_only(tiny_lm, tmp_path, monkeypatch, capsys):
    import json
    import re

    from engine.arms.registry import REGISTRY
    from engine.session import Engine
    from studio.arm_views import view_of

    eng = Engine.from_loaded(tiny_lm)
    out, err = _run_travel(tmp_path, monkeypatch, capsys, True, eng)
    phases = [line for line in err.splitlines() if line.startswith("pml-studio: ")]
    assert any(line.startswith("pml-studio: encoding modules 1/") for line in phases), err
    for arm in (str(a) for a in REGISTRY if str(a) in eng.config.arms):
        said = rf"pml-studio: {re.escape(view_of(arm).title)}: prefilled \d+ tokens, first token after [\d,]+ ms"
        assert any(re.match(said, line) for line in phases), (arm, phases)
    assert phases[-2] == "pml-studio: decoding up to 2 more tokens in each arm…"
    assert phases[-1].startswith("pml-studio: done: ")
    assert not any(line.startswith("pml-studio: ") for line in out.splitlines())  # never on stdout
    out, err = _run_travel(tmp_path, monkeypatch, capsys, False, Engine.from_loaded(tiny_lm), "--json")
    json.loads(out)
    assert "pml-studio: encoding" not in err and "first token after" not in err  # a log file gets no progress


def test_info_in_words_and_api_help_described(capsys):
    from engine.cli import human
    from studio.cli import main as studio_main

    assert human({"packed": 145, "own": 0, "built": False}) == "packed 145, own 0, built no"
    assert human(None) == human("") == "none" and human(630167424) == "630,167,424"
    assert studio_main(["info"]) == 0
    shown = capsys.readouterr().out
    assert "{" not in shown and "None" not in shown and "False" not in shown and "True" not in shown, shown
    assert all(len(line.split(None, 1)) == 2 for line in shown.splitlines()), shown  # no key without a value
    with pytest.raises(SystemExit):
        studio_main(["api", "--help"])
    assert "Serve the OpenAI-compatible API alone" in capsys.readouterr().out


def test_a_422_names_the_field_not_pydantics_union_member():
    import pydantic

    from studio.api.routes import _validation
    from studio.api.types import ChatRequest

    with pytest.raises(pydantic.ValidationError) as err:
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
    api = _validation(err.value.errors(include_url=False))
    assert api.param == "temperature" and "expected a number, got 'hot'" in str(api), (api.param, str(api))


def test_arm_colours_apart_and_the_load_button_quiet_once_loaded(studio):
    import colorsys

    from studio.arm_views import views as arm_views
    from studio.tabs import model as mdl

    def hue(colour: str) -> float:
        r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
        return colorsys.rgb_to_hls(r, g, b)[0] * 360

    hues = {v.arm: hue(v.color) for v in arm_views()}
    for a in hues:
        for b in hues:
            if a < b:  # History draws each arm in its colour: no two within 30° of hue (prefix and routed were 2°)
                assert min(abs(hues[a] - hues[b]), 360 - abs(hues[a] - hues[b])) > 30, (a, b, hues)
    studio.engine.lm  # the model loaded
    assert mdl.load_button(studio)["variant"] == "secondary"
