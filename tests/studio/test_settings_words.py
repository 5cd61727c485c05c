"""Every setting says first what it does to the answer and to the time; the papers' terms come second (issue 64):
in `pml-studio run --help` and in the studio's controls."""

from __future__ import annotations

import re

import gradio as gr
import pytest

from engine.arms.registry import settings_specs
from engine.cli import main
from engine.runlog import RunLog

JARGON = re.compile(r"EPIC|LegoLink|CacheBlend|\bAPE\b|arXiv|log-sum-exp|PyramidInfer|KIVI|prefixed|S·T|sinks")
TIME = re.compile(r"time|first token|sooner|later|faster|slower")


def _plain(first: str, where: str) -> None:
    assert not JARGON.search(first), f"{where}: jargon before the plain words: {first!r}"
    assert "answer" in first and TIME.search(first), f"{where}: what it does to the answer and the time: {first!r}"


def test_every_arm_setting_leads_with_its_effect_on_the_answer_and_the_time():
    for spec, _, s in settings_specs():
        _plain(s.help, f"{spec.name} {s.key}")
        assert s.words.split("\n")[0] == s.help


def test_run_help_gives_the_effect_first_and_the_terms_after(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for spec, _, s in settings_specs():
        flag = "--" + s.key.replace("_", "-")
        said = " ".join(f"{spec.name} arm: {s.help}".split())
        assert said in text, flag
        before = text[:text.index(said)]
        assert re.findall(r"(--[a-z-]+) ", before)[-1] == flag  # the effect, as written, right after its flag
        if s.how:
            assert " ".join(s.how.split())[:30] in text[len(before) + len(said):][:len(s.how) + 10], flag

def test_the_studio_controls_say_the_effect_first(tiny_engine, tmp_path):
    from studio.app import build_app

    demo = build_app(tiny_engine, RunLog(tmp_path / "runs.db"))
    keys = {s.key.replace("_", "-") for _, _, s in settings_specs()} | {"sink", "retention", "compression-method",
                                                                        "storage-dtype"}
    shown = {b.elem_id: b.info for b in demo.blocks.values()
             if isinstance(b, (gr.Radio, gr.Slider, gr.Textbox)) and b.elem_id in keys}
    assert set(shown) == keys
    for elem, info in shown.items():
        _plain(info.split("\n")[0], elem)
