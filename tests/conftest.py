"""Shared fixtures: a tiny random-weight Llama (seconds) and the real default model (session-wide)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

# Persisted module files go to a throw-away folder (subprocesses inherit it), never the user's cache;
# it is removed when the session ends (unless the caller chose the folder).
_OWN_MODULES = None if "PML_STUDIO_MODULES" in os.environ else tempfile.mkdtemp(prefix="pml-test-modules-")
if _OWN_MODULES:
    os.environ["PML_STUDIO_MODULES"] = _OWN_MODULES


def pytest_sessionfinish(session, exitstatus):
    if _OWN_MODULES:
        shutil.rmtree(_OWN_MODULES, ignore_errors=True)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_schemas"


@pytest.fixture(scope="session")
def tokenizer_bundle():
    """(name, tokenizer, codec) of the default model, without its weights."""
    from engine.models import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_lm(tokenizer_bundle):
    """A 2-layer random-weight Llama with the default model's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models import wrap_model

    _, tok, _ = tokenizer_bundle
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return wrap_model(model, tok, "tiny-llama", fingerprint="tiny-llama-seed0")


@pytest.fixture
def tiny_engine(tiny_lm):
    from engine.session import Engine

    return Engine.from_loaded(tiny_lm)


@pytest.fixture(scope="session")
def real_engine():
    from engine.session import Engine

    eng = Engine()
    eng.lm  # load once per session
    return eng


def sample_pairs() -> list[tuple[str, pathlib.Path, pathlib.Path]]:
    out = []
    for schema in sorted(SAMPLES.glob("*.xml")):
        if schema.name.endswith(".prompt.xml"):
            continue
        out.append((schema.stem, schema, schema.with_name(schema.stem + ".prompt.xml")))
    return out
