"""Model resolution and loading errors, the sanity and memory checks of a config, chat-role fragments from the
template."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from engine.errors import ModelError, StorageError
from engine.model.sanity import _check_fits
from engine.devices import check_device
from engine.model.chat import make_codec
from engine.model.load import load_config, resolve_model_path
from engine.model.sanity import check_shape


def test_a_model_that_does_not_fit_is_refused_before_loading():
    huge = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, vocab_size=128256)
    with pytest.raises(ModelError) as info:
        _check_fits(huge, "huge-model", torch.float32, "cpu")
    msg = str(info.value)
    assert "GiB" in msg and "available" in msg and "smaller model" in msg


def test_experts_count_in_the_memory_a_model_needs(monkeypatch):
    from transformers import Qwen2MoeConfig

    from engine.model import load as models, sanity

    monkeypatch.setattr(sanity, "available_bytes", lambda device: 64 * 2**30)
    dense = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, vocab_size=151936)
    _check_fits(Qwen2MoeConfig(**dense, num_experts=1), "dense", torch.float32, "cpu")  # ~5.6 GiB: fits
    many = Qwen2MoeConfig(**dense, num_experts=60_000, moe_intermediate_size=1408)
    with pytest.raises(ModelError, match="model 'moe' needs about"):
        _check_fits(many, "moe", torch.float32, "cpu")


@pytest.mark.parametrize("value, shown", [(4_000_000_000, "4,000,000,000"), (0, "0"), (-3, "-3"), (12.0, "12.0"),
                                          ("30", "'30'"), (True, "True"), ([30], "[30]")])
def test_a_size_must_be_a_whole_number_within_its_ceiling(value, shown):
    with pytest.raises(ModelError) as info:
        check_shape({"hidden_size": 64, "num_hidden_layers": value}, "m.gguf", "Get the file again.",
                    {"num_hidden_layers": "metadata field llama.block_count"})
    assert str(info.value) == (f"m.gguf: metadata field llama.block_count is {shown}, but the number of layers of a "
                               "model is a whole number from 1 to 10,000; the file is damaged or was made to exhaust "
                               "memory, so nothing was loaded. Get the file again.")


def test_sane_sizes_pass_and_a_per_layer_list_may_hold_zeros():
    check_shape({"num_hidden_layers": 10_000, "hidden_size": 1 << 18, "num_key_value_heads": [0, 8, 0, 8],
                 "num_experts": 0, "vocab_size": 262_144, "head_dim": None}, "m", "")
    with pytest.raises(ModelError, match=r"num_key_value_heads is \[0, -1\]"):
        check_shape({"num_key_value_heads": [0, -1]}, "m", "")


def test_a_folder_config_with_an_insane_size_is_refused_before_transformers_builds_it(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("config built"))
    # Qwen2's config makes one list entry per layer as it is built: 4e9 of them would fill the memory
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64,
                                                      "num_hidden_layers": 4_000_000_000}))
    with pytest.raises(ModelError) as info:
        load_config(str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: num_hidden_layers is 4,000,000,000, but")
    assert "config.json, or download the model again" in str(info.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"vocab_size": 2**30}}))
    with pytest.raises(ModelError, match="vocab_size is 1,073,741,824"):
        load_config(str(tmp_path))


def test_every_config_passes_the_same_checks_before_a_model_is_built(tmp_path, monkeypatch):
    from engine.model import load as models, sanity

    seen = []

    def refuse(config, where, *args, **kwargs):
        seen.append(where)
        raise ModelError("refused")

    monkeypatch.setattr(models, "check_config", refuse)
    monkeypatch.setattr(models, "_from_pretrained", lambda *a: pytest.fail("built before the check"))
    LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="refused"):
        models.load_model(str(tmp_path))
    assert seen == [str(tmp_path)]


def test_missing_and_invalid_model_folders(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_path("./no-such-model-folder")
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model_path(str(tmp_path))


def test_cuda_is_refused_with_an_explanation_when_absent():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(StorageError, match="needs a CUDA device"):
        check_device("cuda")
    with pytest.raises(StorageError, match="unknown storage"):
        check_device("tpu")


def test_chat_roles_come_from_the_tokenizer_template(tokenizer_bundle):
    _, tok, codec = tokenizer_bundle
    assert tok.decode(codec.role_open["user"]) == "<|im_start|>user\n"
    assert tok.decode(codec.role_close["system"]) == "<|im_end|>\n"
    assert tok.decode(codec.generation_prompt) == "<|im_start|>assistant\n"
    assert codec.bos == ()  # ChatML's <|im_start|> opens every turn: not a document BOS


def test_a_tokenizer_without_template_cannot_use_role_tags(tokenizer_bundle):
    _, tok, _ = tokenizer_bundle
    saved = tok.chat_template
    try:
        tok.chat_template = None
        codec = make_codec(tok, 2048, "no-template")
    finally:
        tok.chat_template = saved
    assert "no chat template" in codec.roles_error
    from engine.errors import PMLError
    from engine.schema.layout import layout
    from engine.schema.pml import parse_schema

    with pytest.raises(PMLError, match="no chat template"):
        layout(parse_schema("<schema name='s'><system>hi</system></schema>", "s.xml"), codec)
    ok = layout(parse_schema("<schema name='s'><module name='m'>plain text works</module></schema>"), codec)
    assert ok.modules["m"].end > 0
