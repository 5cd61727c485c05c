"""Every numeric setting refuses NaN, infinities, huge and non-numbers with a message naming it, at every edge.

The CLI's options are found by walking the argparse parsers (``pml-studio`` with the studio's
``serve``, and ``app.py``), so an option added later is covered without touching this file.
The library path (RunConfig, Compression, Sampling) and the one check behind all of them
(``engine.config.Limit``) are tested here too; the studio's fields in tests/test_studio_*.py.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time

import pytest
from hypothesis import given, strategies as st

import app
from conftest import ROOT, SAMPLES
from engine.cli import build_parser
from engine.config import LIMITS, Compression, Limit, RunConfig, budget_from_mib, limit_of
from engine.errors import EngineError
from engine.limits import NumberArg
from studio.cli import EXTRA

BAD_VALUES = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", str(2**70), str(-2**70), "1e400", "-1e400", "",
              "abc", "0x10", "1,5", "4 2"]


def _numeric(action: argparse.Action) -> bool:
    return bool(action.option_strings) and (action.type in (int, float) or isinstance(action.type, NumberArg))


def _walk(parser: argparse.ArgumentParser, command: list[str]):
    """(parser, argv before the option, argv after it, option) of every numeric option under ``parser``."""
    positionals = [a for a in parser._actions if not a.option_strings and a.nargs != argparse.PARSER]
    dummies = ["x"] * len(positionals)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((parser, before, after, opt) for _, before, after, opt in _walk(sub, command + [name]))
        elif _numeric(action):
            yield parser, command, dummies, action.option_strings[-1]


def numeric_options() -> list[tuple[str, argparse.ArgumentParser, list[str], list[str], str]]:
    parsers = {"pml-studio": build_parser(EXTRA), "app.py": app.build_parser()}
    return [(f"{prog} {' '.join(before)} {opt}".replace("  ", " "), parser, before, after, opt)
            for prog, top in parsers.items() for parser, before, after, opt in _walk(top, [])]


OPTIONS = numeric_options()
EXPECTED = {"run --max-new-tokens", "run --temperature", "run --top-p", "run --seed", "run --retention",
            "run --budget-mb", "run --repair", "run --blend", "run --sink", "serve --port", "app.py --port"}


def test_the_walk_finds_every_numeric_option_and_each_uses_the_shared_check():
    found = {label.removeprefix("pml-studio ") for label, *_ in OPTIONS}
    assert EXPECTED <= found, EXPECTED - found
    for label, parser, before, after, opt in OPTIONS:
        action = next(a for a in _all_actions(parser, before) if opt in a.option_strings)
        assert isinstance(action.type, NumberArg), f"{label}: use engine.limits.NumberArg, not {action.type!r}"


def _all_actions(top: argparse.ArgumentParser, command: list[str]):
    parser = top
    for name in command:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser._actions


@pytest.mark.parametrize("form", ["joined", "separate"])
@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("label, parser, before, after, opt", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_every_bad_value_of_every_numeric_option_exits_2_naming_it(capsys, label, parser, before, after, opt,
                                                                   value, form):
    given_ = [f"{opt}={value}"] if form == "joined" else [opt, value]
    with pytest.raises(SystemExit) as info:
        parser.parse_args(before + given_ + after)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"error: argument {opt}: " in err and "must be" in err and "e.g." in err  # the range and a fix
    assert "Traceback" not in err


@pytest.mark.parametrize("args, option", [
    (["--budget-mb", "nan"], "--budget-mb"),
    (["--budget-mb", "inf"], "--budget-mb"),
    (["--temperature", "1", "--top-p", "0"], "--top-p"),
    (["--temperature", "nan"], "--temperature"),
    (["--seed", str(2**70)], "--seed"),
])
def test_the_reported_values_exit_2_at_once_from_the_real_command(args, option):
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "studio.cli", "run", str(SAMPLES / "doc_qa.xml"),
                        str(SAMPLES / "doc_qa.prompt.xml"), *args, "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert f"pml-studio run: error: argument {option}: " in r.stderr and "Traceback" not in r.stderr
    assert time.perf_counter() - start < 30  # refused while parsing: no model was loaded


def test_bad_values_are_refused_before_the_model_is_loaded():
    # `run` checks its own options before it imports the registered arms for theirs (and torch with them); the
    # commands that take no arm options (`check`, `layout`) never import torch
    code = ("import sys\nfrom studio.cli import main\ntry:\n    main(['{cmd}', 's.xml', 'p.xml', '--seed', '-1'])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules, 'engine.session' in sys.modules)\n")
    for cmd, torch_loaded in (("run", "False"), ("check", "False")):
        r = subprocess.run([sys.executable, "-c", code.format(cmd=cmd)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.stdout.split() == ["2", torch_loaded, "False"], r.stderr


def test_good_values_still_parse():
    args = build_parser(EXTRA).parse_args(["run", "s", "p", "--seed", str(2**64 - 1), "--temperature", "0.7",
                                           "--top-p", "1e-300", "--budget-mb", "0.5", "--repair", "4.0",
                                           "--max-new-tokens", "1"])
    assert (args.seed, args.temperature, args.top_p, args.budget_mb, args.repair) == (2**64 - 1, 0.7, 1e-300, 0.5, 4)
    assert isinstance(args.repair, int) and app.build_parser().parse_args(["--port", "8080"]).port == 8080


# -- the one check behind every edge ------------------------------------------------------------

ANY_VALUE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-2**80, max_value=2**80),
                      st.text(max_size=30), st.none(), st.booleans(),
                      st.floats(allow_nan=True, allow_infinity=True).map(repr),
                      st.integers(min_value=-2**80, max_value=2**80).map(str), st.lists(st.integers(), max_size=2))


@given(name=st.sampled_from(sorted(LIMITS)), value=ANY_VALUE)
def test_a_limit_returns_a_finite_number_in_range_or_raises_a_named_engine_error(name, value):
    limit = LIMITS[name]
    try:
        number = limit.check(value)
    except EngineError as err:
        assert str(err).startswith(f"{limit.name} must be ") and "got " in str(err)
        return
    assert math.isfinite(number) and limit.lo <= number <= limit.hi and not (limit.open_lo and number == limit.lo)
    assert isinstance(number, int) if limit.whole else isinstance(number, float)


def test_limit_reads_text_and_keeps_huge_whole_numbers_exact():
    seed = LIMITS["seed"]
    assert seed.check(str(2**64 - 1)) == 2**64 - 1 and seed.check(" 7 ") == 7 and seed.check(4.0) == 4
    assert Limit("x", 0, 10).check("2.5") == 2.5
    with pytest.raises(EngineError, match=r"seed must be a whole number from 0 to 18446744073709551615, got 2\.5"):
        seed.check(2.5)
    with pytest.raises(EngineError, match=r"got '1{36}\.\.\.; e\.g\. 0"):
        seed.check("1" * 5000)  # longer than Python converts to int: refused, not a ValueError


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 2**70, -2**70, "abc", "", None, True])
def test_library_dataclasses_refuse_non_finite_and_huge_values(bad):
    from engine.arms.registry import Sampling

    for field in ("max_new_tokens", "temperature", "top_p", "seed"):
        if bad in (None, "") and field == "temperature":
            continue
        with pytest.raises(EngineError, match=LIMITS[field].name):
            Sampling(**{field: bad})
    for field in ("blend", "repair", "sink", "budget_bytes"):
        if bad is not None or field != "budget_bytes":  # budget_bytes None is the default budget
            with pytest.raises(EngineError, match=limit_of(field).name):
                RunConfig.make(**{field: bad})
    for field in ("retention", "recent_frac", "window_frac"):
        with pytest.raises(EngineError, match=LIMITS[field].name):
            Compression(**{field: bad})
    if bad not in (None, ""):
        from engine.cache.store import ModuleStore

        with pytest.raises(EngineError, match="module memory budget"):
            budget_from_mib(bad)
        with pytest.raises(EngineError, match="module memory budget"):
            ModuleStore("cpu", budget_bytes=bad)
        with pytest.raises(EngineError, match="retention"):
            RunConfig().with_(retention=bad)


def test_sampling_survives_the_extremes_of_its_ranges():
    import torch

    from engine.arms.registry import Sampling
    from engine.run.sampling import sample as _sample

    logits = torch.randn(500) * 30
    best = int(torch.argmax(logits))
    gen = torch.Generator().manual_seed(2**64 - 1)
    for t in (5e-324, 1e-300, 1e-40):  # the logits overflow: sampling's limit, greedy
        assert _sample(logits, Sampling(temperature=t), gen) == best
    for p in (5e-324, 1e-300):  # below float32's smallest number: the likeliest token is kept all the same
        assert _sample(logits, Sampling(temperature=0.7, top_p=p), gen) == best
    assert 0 <= _sample(logits, Sampling(temperature=100, top_p=1.0), gen) < 500
