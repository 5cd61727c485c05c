"""An engine that runs a new schema per request (the API's transparent mode) remembers at most ENCODED_KEPT
encoded schemas; one it forgot runs again from the store's entries, encoding nothing."""

from __future__ import annotations

from engine import session
from engine.arms.registry import Sampling


def schema(i: int) -> tuple[str, str]:
    return (f'<schema name="s{i}"><module name="m">Document number {i} is about boats.</module></schema>',
            f'<prompt schema="s{i}"><m/> Which number?</prompt>')


def test_remembered_schemas_are_bounded_and_a_forgotten_one_reuses_its_entries(tiny_engine, monkeypatch):
    monkeypatch.setattr(session, "ENCODED_KEPT", 2)
    cfg = tiny_engine.config.with_(arms=("cached",))
    for i in range(4):
        tiny_engine.compare(*schema(i), Sampling(max_new_tokens=1), config=cfg)
    assert len(tiny_engine._encoded) == 2
    again = tiny_engine.compare(*schema(0), Sampling(max_new_tokens=1), config=cfg)
    assert again.encode["encoded"] == 0 and again.encode["memory"] == again.encode["units"]
