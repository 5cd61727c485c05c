"""Fixtures and helpers shared by the studio's per-tab handler tests (tests/test_studio_*.py)."""

from __future__ import annotations

import pytest

from engine.arms.compare import Comparison
from engine.runlog import RunLog
from studio import files
from studio.state import Studio
from studio.tabs import schema as sch

TRAVEL_PROMPT = """<prompt schema="travel">
  <trip-plan duration="5 days"><overseas><kyoto/></overseas></trip-plan>
  Question: how long is the train ride from Kyoto to Nara, and what is Nara known for? Answer in one sentence.
</prompt>
"""
CPU = {"storage": "cpu", "mode": "prefixed"}


@pytest.fixture
def studio(tiny_engine, tmp_path):
    return Studio(tiny_engine, RunLog(tmp_path / "runs.db"))


@pytest.fixture
def travel(studio):
    schema, prompt = files.load_sample("travel")
    return schema, prompt, sch.validate(studio, schema).spec


def settings(**kw) -> dict:
    return {**CPU, **kw}


def doc(data: dict) -> Comparison:
    """A comparison read back from a (partial) run --json document, as the History tab reads the run log."""
    return Comparison.from_json(data)
