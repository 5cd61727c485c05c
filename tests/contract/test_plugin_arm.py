"""An arm plugs in by itself: a toy arm registered here, in the test, with no edit to any other file,
appears in the CLI, the run --json document, the run log, the History tab and the Compare tab, and its
settings and detail survive the round trip through the run log.

The toy arm ``echo`` runs the baseline's full prefill and reports its one setting back as its detail; its
setting ``echo_k`` enables it (``--echo-k 3`` alone adds it to the arms, as ``--blend R`` does). The engine
file has no words for it: the studio shows it through the default view (a title from its name, a colour
from the palette), and one view of its own (:class:`EchoView`, what a view file would hold) adds its chips.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from engine.arms.baseline import baseline_run
from engine.arms.registry import (ArmResult, DecodingContext, ArmSettings, ArmSpec, Arm, Reads, Sampling, register, setting,
                                  unregister)
from engine.limits import Limit
from studio import arm_views
from tests.conftest import SAMPLES


@dataclass(frozen=True)
class EchoSettings(ArmSettings):
    k: int = setting(2, "echo_k", "Echo: k", "a number the echo arm reports back",
                     limit=Limit("echo_k", 0, 8, whole=True, example="3"), enables=True, metavar="K")


@dataclass(frozen=True)
class EchoInfo:
    k: int

    def to_json(self) -> dict:
        return {"echo_k_used": self.k}

    @classmethod
    def from_json(cls, data: dict) -> "EchoInfo":
        return cls(data.get("echo_k_used", -1))


class EchoView(arm_views.View):
    """Only the chips of its own: every other field comes from the default view."""

    def chips(self, detail: EchoInfo) -> list[str]:
        return [f"echoed k={detail.k}"]


def echo_arm(ctx: DecodingContext):
    run = yield from baseline_run(ctx, arm="echo")
    return ArmResult(Arm("echo"), run, detail=EchoInfo(ctx.settings_of("echo").k))


@pytest.fixture
def echo():
    register(ArmSpec("echo", echo_arm, order=90, reads=Reads.NOTHING, settings=EchoSettings, detail=EchoInfo))
    try:
        yield
    finally:
        unregister("echo")


@pytest.fixture
def echo_view(echo):
    arm_views.register(EchoView("echo"))
    try:
        yield
    finally:
        arm_views.unregister("echo")


def test_an_arm_without_a_view_gets_the_default_one(echo):
    view = arm_views.view_of("echo")
    assert (view.title, view.progress) == ("Echo", "Echo: running…") and view.color in arm_views.PALETTE
    assert view.chips(EchoInfo(3)) == [] and view.bars(EchoInfo(3)) == []
    assert "Echo" in [v.title for v in arm_views.views()]


def test_the_cli_offers_the_arm_and_its_setting(echo):
    from engine import cli
    from studio.cli import EXTRA

    parser = cli.build_parser(EXTRA)
    args = parser.parse_args(["run", "s.xml", "p.xml", "--arms", "baseline,echo", "--echo-k", "5"])
    cfg = cli.config_from_args(args)
    assert cfg.arms == ("baseline", "echo") and cfg.settings_of("echo").k == 5
    assert cfg.settings_of("echo") == EchoSettings(5)
    alone = cli.config_from_args(parser.parse_args(["run", "s.xml", "p.xml", "--echo-k", "3"]))
    assert alone.arms[-1] == "echo"  # an enabling setting above 0 adds its arm
    with pytest.raises(SystemExit):  # its range is checked like every numeric option
        parser.parse_args(["run", "s.xml", "p.xml", "--echo-k", "9"])
    assert "--echo-k" in parser._subparsers._group_actions[0].choices["run"].format_help()


def test_the_json_the_run_log_and_history_carry_it(echo_view, tiny_engine, tmp_path):
    from engine.arms.compare import Comparison
    from engine.runlog import RunLog
    from studio.state import Studio
    from studio.tabs import history

    schema, prompt = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
    cfg = tiny_engine.config.with_(arms=("baseline", "cached", "echo"), echo_k=4)
    comparison = tiny_engine.compare(schema, prompt, Sampling(3), config=cfg)
    doc = arm_views.document(comparison)  # run --json as pml-studio writes it
    assert doc["arms"] == ["baseline", "cached", "echo"] and doc["echo"]["echo_k_used"] == 4
    assert doc["echo"]["text"] == doc["baseline"]["text"]  # it ran the baseline's prefill
    assert doc["echo_speedup"] == doc["by_arm"]["echo"]["speedup"] is not None
    assert doc["echo_same_text"] is True and doc["by_arm"]["echo"]["title"] == "Echo"

    log = RunLog(tmp_path / "runs.db")
    run_id = log.record(doc, schema, prompt)
    row = log.get(run_id)
    assert row["arms"]["echo"]["ttft_ms"] == doc["echo"]["ttft_ms"]
    back = Comparison.from_json(json.loads(row["result_json"]))  # the JSON rounds a speedup to 3 decimals
    assert back.arm("echo").detail == EchoInfo(4)
    assert back.speedup("echo") == pytest.approx(doc["echo_speedup"], abs=5e-4)

    studio = Studio(tiny_engine, log)
    cells = dict(zip(history.headers(), history.rows(studio)[0]))
    assert cells["Echo TTFT"].startswith(f"{doc['echo']['ttft_ms']:.0f} ms")
    assert "echoed k=4" in history.run_detail(studio, run_id)

    from engine.cli import run_text
    assert "Echo: echoed k=4" in run_text(doc, arm_views.WORDS)  # pml-studio run's text says it too


def test_the_studio_makes_its_column_control_and_checkbox(echo, tiny_engine, tmp_path):
    import gradio as gr

    from engine.runlog import RunLog
    from studio.app import build_app
    from studio.settings import run_config
    from studio.tabs import compare

    demo = build_app(tiny_engine, RunLog(tmp_path / "runs.db"))
    by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    assert "echo-text" in by_id and "echo-metrics" in by_id  # its Compare column
    assert isinstance(by_id["echo-k"], gr.Slider) and by_id["echo-k"].maximum == 8  # its Encode control
    assert ("Echo", "echo") in [tuple(c) for c in by_id["arms"].choices]  # the arms checkbox
    cfg = run_config(tiny_engine.config, {"arms": ["baseline", "echo"], "echo_k": 6.0})
    assert cfg.arms == ("baseline", "echo") and cfg.settings_of("echo").k == 6
    assert compare._progress("echo") == "Echo: running…"  # the default view's
