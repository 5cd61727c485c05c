"""Model resolution and loading errors, chat-role fragments from the template."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine.errors import ModelError, StorageError
from engine.models import _check_fits, check_device, make_codec, resolve_model_path


def test_a_model_that_does_not_fit_is_refused_before_loading():
    huge = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, vocab_size=128256)
    with pytest.raises(ModelError) as info:
        _check_fits(huge, "huge-model", torch.float32, "cpu")
    msg = str(info.value)
    assert "GiB" in msg and "available" in msg and "smaller model" in msg


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
    from engine.layout import layout
    from engine.pml import parse_schema

    with pytest.raises(PMLError, match="no chat template"):
        layout(parse_schema("<schema name='s'><system>hi</system></schema>", "s.xml"), codec)
    ok = layout(parse_schema("<schema name='s'><module name='m'>plain text works</module></schema>"), codec)
    assert ok.modules["m"].end > 0
