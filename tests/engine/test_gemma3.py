"""The optional second packaged model, Gemma 3 270M (`make gemma3`), really loaded and run.

Skipped, with the reason, where its packages are not installed (CI does not need them).
"""

from __future__ import annotations

import pytest

from engine.errors import PMLError
from engine.model.packaged import PACKAGED
from engine.model.positions import TESTED_FAMILIES
from engine.arms.registry import Sampling

from conftest import SAMPLES

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not PACKAGED["gemma3-270m"].installed(),
                                 reason="Gemma 3 270M is optional and not installed here: run `make gemma3`")]


@pytest.fixture(scope="module")
def gemma():
    from engine.session import Engine

    eng = Engine(model="gemma3-270m", persist=False)
    eng.lm
    return eng


def test_gemma_facts_show_its_sliding_window_and_tested_family(gemma):
    info = gemma.info()
    assert info["model"] == "gemma-3-270m" and info["model_type"] == "gemma3_text"
    assert info["model_type"] in TESTED_FAMILIES and info["family_tested"] is True
    assert info["attention"] == "pml" and info["sliding_window"] == 512 and info["sliding_layers"] == 15
    assert info["kv_bytes_per_token"] == 2 * 18 * 1 * 256 * 4  # layers x 1 KV head x head dim 256, fp32


def test_role_tags_get_the_clear_error(gemma):
    with pytest.raises(PMLError, match="no chat template"):
        gemma.layout((SAMPLES / "doc_qa.xml").read_text(), str(SAMPLES / "doc_qa.xml"))


def test_the_base_model_sample_runs_past_the_window(gemma):
    schema, prompt = SAMPLES / "almanac.xml", SAMPLES / "almanac.prompt.xml"
    c = gemma.compare(schema.read_text(), prompt.read_text(), Sampling(6), schema_source=str(schema),
                      prompt_source=str(prompt))
    last = max(p for s in c.plan.segments for p in s.positions)
    assert last > 512  # the sliding layers' window is crossed, with gaps in the positions
    assert c.plan.cached_tokens > c.plan.uncached_tokens > 0
    assert "1874" in c.baseline.text and c.cached.token_ids  # Gemma writes digits one token each
