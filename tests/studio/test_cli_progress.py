"""`pml-studio run` on a terminal is never silent for a phase (issue 64): the model's load, the encoding, each arm's
prefill before its first token, the decoding and the end, in the order they happen; `--quiet` silences it, and
`info` says what takes its time. The tiny model stands in for the CLI's Engine, as tests/studio/
test_studio_newcomer.py does."""

from __future__ import annotations

import json
import sys

import pytest

from engine import session
from engine.arms.registry import REGISTRY
from engine.session import Engine
from studio.arm_views import view_of
from studio.cli import main as studio_main
from studio.files import load_sample


def _run(tmp_path, monkeypatch, capsys, eng, *flags, make=None) -> tuple[str, list[str]]:
    """``make``: how the CLI's Engine(config) is made (default: ``eng``, whatever the config)."""
    monkeypatch.setenv("PML_STUDIO_MODULES", str(tmp_path / "modules"))  # nothing stored: it encodes
    monkeypatch.setattr(session, "Engine", make or (lambda *a, **k: eng))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    schema, prompt = load_sample("travel")
    (tmp_path / "travel.xml").write_text(schema)
    (tmp_path / "travel.prompt.xml").write_text(prompt)
    capsys.readouterr()
    assert studio_main(["run", str(tmp_path / "travel.xml"), str(tmp_path / "travel.prompt.xml"),
                        "--max-new-tokens", "3", *flags]) == 0
    out = capsys.readouterr()
    return out.out, [line for line in out.err.splitlines() if line.startswith("pml-studio: ")]


def test_run_tells_every_phase_in_order_on_a_terminal(tiny_lm, tmp_path, monkeypatch, capsys):
    eng = Engine.from_loaded(tiny_lm)
    out, lines = _run(tmp_path, monkeypatch, capsys, eng)
    assert lines[0].startswith("pml-studio: model tiny-llama ready in "), lines
    assert not any(line.startswith("pml-studio: ") for line in out.splitlines())  # never on stdout

    def at(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    encoded = max(i for i, line in enumerate(lines) if "encoding modules" in line)
    previous = encoded
    arms = [str(a) for a in REGISTRY if str(a) in eng.config.arms]
    for arm in arms:  # each arm's prefill is announced before its first token, after the one before
        title = view_of(arm).title
        start, first = at(f"{title}: prefilling…"), at(f"{title}: prefilled ")
        assert previous < start < first or (arm == arms[0] and start < first), (arm, lines)
        previous = first
    assert "decoding up to 2 more tokens in each arm" in lines[-2] and lines[-1].startswith("pml-studio: done: "), lines


@pytest.mark.parametrize("flag", ["--quiet", "--json"])
def test_quiet_and_json_silence_the_progress(tiny_lm, tmp_path, monkeypatch, capsys, flag):
    out, lines = _run(tmp_path, monkeypatch, capsys, Engine.from_loaded(tiny_lm), flag)
    assert lines == []
    if flag == "--json":
        json.loads(out)  # stdout is the JSON alone


def test_info_says_what_takes_its_time(tiny_lm, monkeypatch, capsys):
    monkeypatch.setattr(session, "Engine", lambda *a, **k: Engine.from_loaded(tiny_lm))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert studio_main(["info"]) == 0
    err = capsys.readouterr().err
    assert "the weights' load is what takes the time" in err and "ready in" in err, err


def test_run_with_routed_says_each_phase_once_and_why_it_warms(tiny_lm, tmp_path, monkeypatch, capsys):
    """`run --arms baseline,cached,routed` (issue 74): a line before the model's load (its longest silence: 15-18 s
    on the default model), "Baseline: prefilling…" once (it came before and after the warm-up), and the warm-up
    said to be routed's (it read as the prefix arm's, not asked for) with the flags that leave it out."""
    def engine(config=None, **settings):  # the CLI's own config (its arms), the weights not loaded yet
        eng = Engine.from_loaded(tiny_lm, config)
        eng._lm = None
        return eng

    monkeypatch.setattr(session, "load_model", lambda *a, **k: tiny_lm)
    _, lines = _run(tmp_path, monkeypatch, capsys, None, "--arms", "baseline,cached,routed", make=engine)
    assert lines[0].startswith("pml-studio: loading model ") and lines[1].startswith("pml-studio: model tiny-llama "
                                                                                      "ready in "), lines
    assert sum("Baseline: prefilling…" in line for line in lines) == 1, lines
    warm = next(i for i, line in enumerate(lines) if "warming the prefix cache" in line)
    assert "routed" in lines[warm] and "--no-warmup" in lines[warm] and "--route-tree off" in lines[warm], lines
    assert "prefix cache warmed" in lines[warm + 1] and "Baseline: prefilling…" in lines[warm + 2], lines
    assert not any("Prefix cache" in line or "encoding modules 0/1" in line for line in lines), lines
    assert [line.split(":")[1].strip() for line in lines if "prefilled " in line] == ["Baseline", "Modular cache",
                                                                                      "Routed"], lines


def test_info_says_when_fp32_runs_are_not_exact(tokenizer_bundle, monkeypatch, capsys):
    """A model on packed int8 weights computes in fp32 but rounds its products: `info`'s (and the Model tab's)
    reason for the dtype says runs "exact in fp32" match the baseline only to that rounding (issue 74: it said
    "fp32 so runs show as exact" beside a gemm-bf16 prefill)."""
    from engine.model.load import wrap_model
    from engine.model.weights import quantize_weights
    from tests.engine.test_stop_and_finite import tiny_llama

    model = tiny_llama(tokenizer_bundle[1])
    quantize_weights(model, "int8")
    lm = wrap_model(model, tokenizer_bundle[1], "tiny-int8", weights="int8")
    monkeypatch.setattr(session, "Engine", lambda *a, **k: Engine.from_loaded(lm))
    assert studio_main(["info", "--json"]) == 0
    reason = json.loads(capsys.readouterr().out)["dtype_reason"]
    assert "the linear weights are int8" in reason and "only to that rounding" in reason, reason
