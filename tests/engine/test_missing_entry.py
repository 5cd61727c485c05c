"""Store entries that vanish: the store says so with MissingEntry, and the engine meets it before any arm is timed."""

from __future__ import annotations

import pytest

from conftest import SAMPLES
from engine.errors import MissingEntry, StorageError
from engine.arms.registry import Sampling
from engine.cache.store import ModuleStore


def test_the_store_raises_missing_entry_not_a_bare_key_error():
    with pytest.raises(MissingEntry, match="encode the schema again") as err:
        ModuleStore("cpu").get("0123456789abcdef")
    assert isinstance(err.value, StorageError) and not isinstance(err.value, KeyError)


def test_an_entry_missing_at_run_time_is_fetched_again_before_timing(tiny_lm, monkeypatch):
    from engine.session import Engine

    eng = Engine.from_loaded(tiny_lm)
    schema, prompt = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
    first = eng.compare(schema, prompt, Sampling(3))
    store = eng.store()
    real_get, missed, timed = store.get, [], []

    def flaky(key):
        if not missed:
            missed.append(key)
            raise MissingEntry(key)
        return real_get(key)

    monkeypatch.setattr(store, "get", flaky)
    from engine.arms import baseline, modular, prefix

    real_timed = baseline.timed_run  # every arm's run goes through engine.run.timing.timed_run
    for arm in (baseline, prefix, modular):
        monkeypatch.setattr(arm, "timed_run", lambda *a, **k: timed.append(missed[:]) or real_timed(*a, **k))
    again = eng.compare(schema, prompt, Sampling(3))
    assert missed and all(t == missed for t in timed)  # the miss happened before the first timed run
    assert len(timed) == 3 and again.cached.token_ids == first.cached.token_ids
