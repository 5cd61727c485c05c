"""A run stopped on request ends within a token and leaves the engine clean; a model that computes NaN is a named
error (never empty answers marked same_text); ``run --json`` is strict JSON; a hub id is refused at once, offline;
packed weights are counted as parameters (issue 37, items 8 and 9)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.arms.registry import Sampling
from engine import errors
from engine.errors import ModelError
from engine.model.load import load_model, load_tokenizer, resolve_model_path, wrap_model
from engine.session import Engine
from studio import files

SAMPLING = Sampling(max_new_tokens=12)


@pytest.fixture(scope="module")
def travel_docs():
    return files.load_sample("travel")


def tiny_llama(tok, tie: bool = True, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=tie, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("decode", ["together", "apart"])
def test_a_stopped_run_ends_within_a_token_and_the_next_run_is_whole(tiny_engine, travel_docs, decode):
    schema, prompt = travel_docs
    cfg = tiny_engine.config.with_(decode=decode, arms=("baseline", "prefix", "cached"))
    whole = tiny_engine.compare(schema, prompt, SAMPLING, config=cfg)
    tokens, asked, answered = [], [], []

    def on_token(arm, text):  # the Stop button pressed while the 4th token shows
        tokens.append(arm)
        if len(tokens) == 4:
            asked.append(len(tokens))

    def should_stop():
        if asked and not answered:
            answered.append(len(tokens))
        return bool(asked)

    with pytest.raises(errors.RunStopped, match="stopped on request"):
        tiny_engine.compare(schema, prompt, SAMPLING, config=cfg, on_token=on_token, should_stop=should_stop)
    assert answered and len(tokens) == answered[0]  # nothing generated once the engine saw the stop
    # it saw it at its next step: apart, before the next token; together, after the batch step under way, which
    # gives each of the other arms one token at most
    late = tokens[4:]
    assert late == [] if decode == "apart" else (len(set(late)) == len(late) < 3 and tokens[3] not in late)
    again = tiny_engine.compare(schema, prompt, SAMPLING, config=cfg)
    assert {a.value: r.run.token_ids for a, r in again.arms.items()} == \
        {a.value: r.run.token_ids for a, r in whole.arms.items()}


def test_a_run_stopped_before_it_starts_computes_nothing(tiny_engine, travel_docs):
    schema, prompt = travel_docs
    seen = []
    with pytest.raises(errors.RunStopped):
        tiny_engine.compare(schema, prompt, SAMPLING, on_token=lambda arm, text: seen.append(arm),
                            progress=lambda *step: seen.append(step), should_stop=lambda: True)
    assert seen == []


def test_a_model_that_computes_nan_is_refused_at_load(tokenizer_bundle):
    model = tiny_llama(tokenizer_bundle[1])
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # a checkpoint with one NaN
    with pytest.raises(errors.NonFiniteLogits, match="non-finite logits"):
        wrap_model(model, tokenizer_bundle[1], "nan-llama")


def test_logits_that_turn_nan_are_a_named_error_not_an_empty_answer(tokenizer_bundle, travel_docs):
    """A rope that overflows past the load's 4-token check (here: its frequencies made NaN after load) reaches the
    runs: the first token's NaN logits are an error naming the arm, never a text marked same_text."""
    lm = wrap_model(tiny_llama(tokenizer_bundle[1]), tokenizer_bundle[1], "rope-nan-llama")
    rope = lm.model.model.rotary_emb
    rope.inv_freq.fill_(float("nan"))
    engine = Engine.from_loaded(lm)
    with pytest.raises(errors.NonFiniteLogits, match=r"at the first token of the \w+ arm.*rope"):
        engine.compare(*travel_docs, SAMPLING)


def test_run_json_writes_non_finite_numbers_as_null(monkeypatch, tmp_path, capsys):
    """`run --json` is read by strict parsers: a NaN or infinite figure is null, never bare NaN."""
    from engine import cli, session

    doc = {"model": "m", "store_stats": {}, "first_token_kl": float("nan"),
           "cached": {"ttft_ms": float("inf"), "x": [1.0, float("-inf")]}}

    class Fake:
        lm = None  # the CLI loads the model before the run, to say how long that took

        def __init__(self, config):
            pass

        def compare(self, *args, **kwargs):
            return type("Result", (), {"to_json": lambda self: doc})()

    monkeypatch.setattr(session, "Engine", Fake)
    schema, prompt = tmp_path / "s.xml", tmp_path / "p.xml"
    schema.write_text("<schema name='s'>x</schema>")
    prompt.write_text("<prompt schema='s'>y</prompt>")
    assert cli.main(["run", str(schema), str(prompt), "--json", "--no-persist"]) == 0
    out = capsys.readouterr().out

    def refuse(name):
        raise AssertionError(f"bare {name} in the JSON")

    data = json.loads(out, parse_constant=refuse)
    assert data == {"model": "m", "store_stats": {}, "first_token_kl": None,
                    "cached": {"ttft_ms": None, "x": [1.0, None]}}


def test_a_hub_id_is_refused_at_once_and_nothing_asks_a_hub(monkeypatch):
    import transformers

    def asked(*args, **kwargs):
        pytest.fail(f"transformers was asked for {args[:1]}")

    monkeypatch.setattr(transformers.PreTrainedConfig, "get_config_dict", asked)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", asked)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    for call in (resolve_model_path, load_tokenizer, load_model):
        with pytest.raises(ModelError, match=r"no model 'org/name': not a packaged model.*offline"):
            call("org/name")


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tie", [True, False])
def test_packed_weights_are_counted_as_parameters(tokenizer_bundle, tmp_path, kind, tie, monkeypatch):
    """A model loaded with --weights int8 / int4 has the parameter count of the same model in fp32 (its packed
    layers keep their weights as buffers, which torch's parameters() leaves out), and every load reads local
    files only."""
    import transformers

    tok = tokenizer_bundle[1]
    model = tiny_llama(tok, tie=tie)
    expected = sum(p.numel() for p in model.parameters())  # transformers' own count of the fp32 model
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("local_files_only"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    fp32 = load_model(str(folder))
    packed = load_model(str(folder), weights=kind)
    assert packed.weights == kind and packed.weight_bytes < fp32.weight_bytes
    assert packed.n_params == fp32.n_params == expected
    assert packed.info()["parameters"] == expected
    assert seen == [True, True]


def test_compile_of_a_directory_says_it_is_one(tmp_path, capsys):
    from engine import cli

    assert cli.main(["compile", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and ("folder" in err or "directory" in err) and "no such file" not in err
