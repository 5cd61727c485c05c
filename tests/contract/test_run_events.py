"""Results leave the engine as data: a run is a generator of typed events the caller pulls and stops by closing
it, so no token callback, stop callback or stop exception is left in the engine or the studio."""

from __future__ import annotations

import re

from tests.conftest import ROOT

CALLBACKS = re.compile(r"\b(TokenFn|RunStopped|on_token|on_arm|should_stop|token_sink)\b")


def test_no_callback_carries_a_runs_results():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}"
             for folder in ("engine", "studio") for p in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if CALLBACKS.search(line)]
    assert found == [], "\n".join(found)
