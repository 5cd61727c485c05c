"""The header's model chip follows the load to "loaded" (issue 64): its timer keeps looking until the model is
loaded, even when "loading…" came and went before the load (the tokenizer's load holds the same lock)."""

from __future__ import annotations

from types import SimpleNamespace

from studio.tabs import model as mdl
from tests.studio_fixtures import studio  # noqa: F401 (fixture)


def test_the_header_keeps_looking_until_the_model_is_loaded(studio, monkeypatch):
    monkeypatch.setattr(studio, "engine", SimpleNamespace(loaded=False, loading=True, config=studio.engine.config,
                                                          lm=studio.engine.lm, info=studio.engine.info))
    chip, timer, *_ = mdl.status_tick(studio)
    assert "loading…" in chip and timer.active
    studio.engine.loading = False  # the tokenizer loaded; the model's load has not started yet
    chip, timer, *_ = mdl.status_tick(studio)
    assert "loaded" not in chip.replace("loads on", "") and timer.active  # the old timer stopped here, for good
    studio.engine.loaded = True
    chip, timer, *_ = mdl.status_tick(studio)
    assert "· loaded" in chip and not timer.active
