"""The `run --json` contract: every key path the document had before the arms refactor is still there
(tests/data/run-json-keys-v1.json, written by tests/data/make_run_json_keys_v1.py at commit 9d7bb5f),
and a document read back with Comparison.from_json writes the same document."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import SAMPLES
from engine.arms.compare import Comparison
from engine.arms.registry import Sampling

SNAPSHOT = pathlib.Path(__file__).resolve().parent.parent / "data" / "run-json-keys-v1.json"


def key_paths(doc, pre: str = "") -> set[str]:
    """Dotted key paths of a JSON document; list items of objects as ``key[]``."""
    out: set[str] = set()
    if isinstance(doc, dict):
        for k, v in doc.items():
            q = f"{pre}.{k}" if pre else k
            out.add(q)
            out |= key_paths(v, q)
    elif isinstance(doc, list):
        for v in doc:
            if isinstance(v, dict):
                out |= key_paths(v, pre + "[]")
    return out


@pytest.fixture(scope="module")
def documents(tiny_lm):
    from engine.session import Engine

    eng = Engine.from_loaded(tiny_lm)
    schema, prompt = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
    arms = ("baseline", "prefix", "cached")
    return [eng.compare(schema, prompt, Sampling(max_new_tokens=3), config=eng.config.with_(arms=arms, repair=r))
            for r in (0, 2)]


def test_every_key_of_the_old_document_is_still_written(documents):
    old = set(json.loads(SNAPSHOT.read_text()))
    new = set().union(*(key_paths(c.to_json()) for c in documents))
    assert sorted(old - new) == []  # a key removed or renamed breaks the tools that read run --json


def test_legacy_agreement_keys_are_the_arms_agreements(documents):
    c = documents[0]
    doc = c.to_json()
    for arm, prefix in (("cached", ""), ("prefix", "prefix_")):
        agree = c.agreement(arm)
        assert doc[f"{prefix}same_text"] == agree.same_text
        assert doc[f"{prefix}first_token_kl"] == pytest.approx(agree.first_token_kl, abs=1e-6)
        # the speedup is the two arms' own TTFTs as the document writes them (to the microsecond), not a stored
        # figure; the tiny model's TTFTs are fractions of a millisecond, so the unrounded ratio may differ by more
        assert doc[f"{prefix}speedup"] == pytest.approx(doc["baseline"]["ttft_ms"] / doc[arm]["ttft_ms"], abs=1e-3)
        assert doc[f"{prefix}speedup"] == pytest.approx(c.baseline.ttft_ms / c.arm(arm).run.ttft_ms, rel=0.01)
        assert doc["by_arm"][arm]["agreement"]["same_text"] == agree.same_text


def test_an_arm_not_run_is_null_with_its_figures(tiny_lm):
    from engine.session import Engine

    eng = Engine.from_loaded(tiny_lm)
    schema, prompt = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
    doc = eng.compare(schema, prompt, Sampling(2), config=eng.config.with_(arms=("cached",))).to_json()
    assert doc["arms"] == ["cached"] and doc["baseline"] is None and doc["prefix"] is None
    assert doc["speedup"] is None and doc["same_text"] is None and doc["prefix_same_text"] is None
    assert doc["cached"]["text"] is not None and doc["by_arm"]["cached"]["agreement"] is None


def test_a_document_reads_back_to_itself(documents):
    for c in documents:
        doc = json.loads(json.dumps(c.to_json()))
        assert Comparison.from_json(doc).to_json() == doc
